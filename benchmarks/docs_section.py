"""Replace one script's ``## `` section of docs/benchmarks.md, leaving the sections other scripts wrote as they are.

Shared by the hand-run scripts that write their own section (quickstart_seeds.py, export_peak.py, scale.py);
``run.py`` keeps those sections when it rewrites its own (``other_sections``).
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
