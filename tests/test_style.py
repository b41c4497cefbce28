"""The code base is ruff-clean (lint and format), as configured in pyproject.toml."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(command: list[str]) -> None:
    # Run ruff from this interpreter's environment, not from PATH: CI calls `.venv/bin/python -m pytest` without
    # activating the venv, so the `ruff` executable is not on PATH there.
    if importlib.util.find_spec("ruff") is None:
        pytest.fail(f"ruff is not installed in {sys.prefix}; install the test extras: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
