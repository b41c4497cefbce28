"""The floors subset (``pytest -m floors``, tests/helpers/floors.py) still names tests: a renamed or removed test
would otherwise drop out of the floors stage of .ci/run without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.floors import FLOORS, floor_files

ROOT = Path(__file__).resolve().parents[1]


def test_every_floors_entry_names_collected_tests() -> None:
    files = floor_files()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "floors", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    selected = [line for line in proc.stdout.splitlines() if "::" in line]
    missing = [entry for entry in FLOORS if not any(node.startswith(entry) for node in selected)]
    assert not missing, f"FLOORS entries that name no test: {missing}"
