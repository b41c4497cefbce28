"""Side by side: the ratio cells of several ``run.py`` passes of the same code (the verdict runs: three full passes).

    for i in 1 2 3; do python -m benchmarks.run --sections fit zero fsdp overhead --out /tmp/verdict$i.md; done
    python -m benchmarks.verdicts /tmp/verdict1.md /tmp/verdict2.md /tmp/verdict3.md --write-docs

Reads every table row of sections 1 and 2-3 that carries a ratio cell (``**ratio** [low, high] verdict``, written
by ``run.ratio_cell``) and prints one row per comparison: each run's ratio, interval and verdict, and whether all
runs agree. ``--write-docs`` puts the table into docs/benchmarks.md as its own section (``benchmarks.common.docs``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.common.docs import replace_section
from benchmarks.common.paths import DOCS
from benchmarks.run import TITLES, previous_own_sections
from gym_lightning.callbacks.reports import markdown_table

HEADING = "## Verdict runs: the same code, three passes"
CELL = re.compile(r"\*\*(?P<ratio>[\d.]+)\*\* \[(?P<low>[\d.]+), (?P<high>[\d.]+)\] (?P<verdict>✅|❌|≈)")
SECTIONS = ("fit", "strategies")  # run.py's sections with ratio verdicts


def ratio_rows(document: str) -> dict[str, str]:
    """``comparison -> ratio cell`` of the ratio tables in sections 1 and 2-3 of one ``run.py`` document."""
    rows: dict[str, str] = {}
    sections = previous_own_sections(document)
    for key in SECTIONS:
        for line in sections.get(TITLES[key], "").splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            match = CELL.search(cells[-1]) if len(cells) > 1 else None
            if match:
                rows[cells[0]] = match.group(0)
    return rows


def agreement(cells: list[str]) -> str:
    """``yes`` when every run gave the same verdict, else the verdicts seen."""
    verdicts = [match.group("verdict") if (match := CELL.search(cell)) else "?" for cell in cells]
    return "yes" if len(set(verdicts)) == 1 else "no (" + " / ".join(verdicts) + ")"


def comparison_table(paths: list[Path]) -> str:
    """The markdown table: a row per comparison, a column per run, and the agreement."""
    runs = [ratio_rows(path.read_text()) for path in paths]
    names = list(dict.fromkeys(name for run in runs for name in run))
    header = ["comparison", *(f"run {i + 1}" for i in range(len(runs))), "same verdict in every run"]
    rows = []
    for name in names:
        cells = [run.get(name, "(not run)") for run in runs]
        rows.append([name, *cells, agreement(cells)])
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run.py outputs of the same code")
    parser.add_argument("--note", default="", help="a line put under the heading (dates, load, commit)")
    parser.add_argument("--write-docs", action="store_true", help="replace this section of docs/benchmarks.md")
    args = parser.parse_args()
    table = comparison_table(args.runs)
    print(table)
    if args.write_docs:
        section = f"{HEADING}\n\n{args.note}\n\n{table}\n" if args.note else f"{HEADING}\n\n{table}\n"
        DOCS.write_text(replace_section(DOCS.read_text(), HEADING, section))


if __name__ == "__main__":
    main()
