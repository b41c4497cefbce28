"""Replace one benchmark's ``## `` section of docs/benchmarks.md (or docs/planner.md), leaving the sections other
benchmarks wrote, the introduction and the summary of claims as they are; and the command line a section cites.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.paths import DOCS


def replace_section(document: str, heading: str, section: str) -> str:
    """``document`` with the section whose first line is ``heading`` replaced by ``section`` (appended when it has
    none); one blank line is kept before the next section."""
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _: section.rstrip("\n") + "\n\n", document, count=1).rstrip("\n") + "\n"
    return document.rstrip("\n") + "\n\n" + section


HISTORY = "\n## History\n"


def replace_section_before_history(document: str, heading: str, section: str) -> str:
    """``replace_section``, but a section new to ``document`` goes before its closing History section (which
    ``replace_section`` would append it after)."""
    if heading not in document and HISTORY in document:
        document = document.replace(HISTORY, "\n" + section.rstrip("\n") + "\n" + HISTORY, 1)
    return replace_section(document, heading, section)


def write_section(heading: str, section: str, doc: Path = DOCS) -> None:
    """Replace (or add, before the History section) ``heading``'s section of ``doc``."""
    doc.write_text(replace_section_before_history(doc.read_text() if doc.exists() else "", heading, section))


def command_line(module: str, argv: Sequence[str]) -> str:
    """How a section names the run that wrote it: ``python -m MODULE ARGS``."""
    return shlex.join(["python", "-m", module, *argv])
