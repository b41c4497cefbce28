"""Replace one script's ``## `` section of docs/benchmarks.md, leaving the sections other scripts wrote as they are.

Shared by the hand-run scripts that write their own section (quickstart_seeds.py, export_peak.py, scale.py);
``run.py`` replaces its own sections the same way (``updated_document``), so the introduction and the summary of
claims at the top of the document stay where they are.
"""

from __future__ import annotations

import re


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
