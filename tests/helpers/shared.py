"""Session fixtures built once per test run, also when pytest-xdist runs the suite in several worker processes.

The README's test command runs ``pytest -n 2 --dist loadfile``: two workers, each taking whole test files. A
session-scoped fixture is then made once *per worker*, so the expensive ones shared across files (the ``gym fit``
runs of every shipped config, the memory job, the kill/resume tests' model folder) would be trained twice. They go
through :func:`built_once` instead: the first worker to ask builds the folder under the run's common temporary
directory while holding a file lock, the other waits for the lock and reuses it (the pattern pytest-xdist documents,
"Making session-scoped fixtures execute only once"). Without xdist it is a plain build under the session's
temporary directory. The users only read what was built (each test copies a checkpoint before damaging or resuming
it), so sharing across processes changes nothing they see.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

DONE = ".built"


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder every worker of this run sees (xdist's workers each get a sub-folder of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``run_root/name``, filled by ``build(folder)`` by the first process of this run to ask for it.

    A build that raised leaves no mark, so the next process to ask builds again (and shows its own error)."""
    folder = run_root(tmp_path_factory) / name
    with FileLock(str(folder) + ".lock"):
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / DONE).touch()
    return folder
