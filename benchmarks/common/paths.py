"""The repository's folders and the documents the benchmarks write."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmarks"
CONFIGS = REPO_ROOT / "configs"
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
PLANNER_DOC = REPO_ROOT / "docs" / "planner.md"
HISTORY = REPO_ROOT / "docs" / "benchmarks-history.md"
MIB = 2**20
GIB = 2**30
