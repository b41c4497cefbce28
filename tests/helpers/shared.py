"""How the suite shares a machine between pytest-xdist's workers: built-once session fixtures, threads, file order.

The README's test command runs ``pytest -n 3 --dist loadfile``: three workers on 2 cores (one more than the cores: a
worker often waits on a launch's start or a timeout), each taking whole test files. A
session-scoped fixture is then made once *per worker*, so the expensive ones shared across files (the ``gym fit``
runs of every shipped config, the memory job, the kill/resume tests' model folder) would be trained twice. They go
through :func:`built_once` instead: the first worker to ask builds the folder under the run's common temporary
directory while holding a file lock, the other waits for the lock and reuses it (the pattern pytest-xdist documents,
"Making session-scoped fixtures execute only once"). Without xdist it is a plain build under the session's
temporary directory. The users only read what was built (each test copies a checkpoint before damaging or resuming
it), so sharing across processes changes nothing they see.

Each worker computes with one intra-op thread (:func:`one_thread_per_worker`), and the files go out heaviest first
(:func:`heaviest_files_first`), so that the last minutes are not one long file on one worker.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

DONE = ".built"


def in_worker() -> bool:
    """Whether this process is one of pytest-xdist's workers."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder every worker of this run sees (xdist's workers each get a sub-folder of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if in_worker() else base


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


def one_thread_per_worker() -> None:
    """One intra-op thread in each worker and in what it starts (rank processes, notebook kernels): the workers
    share the 2 cores. With torch's default (a thread per core) each worker's OpenMP threads spin at barriers while
    the other worker's processes hold the cores; notebooks/01_quickstart's 1,410 small steps then took over 600 s
    instead of ~75 s alone (suite run with -n 2, both workers on 2 threads)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # a plugin imported it before this conftest: the variable came too late for it
        sys.modules["torch"].set_num_threads(1)


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` by whole files, the files with the most ``slow`` tests (process launches) first, the others
    in collection order; tests keep their order inside a file. The workers take files in this order (xdist's own
    order, by number of tests, put the notebooks' few long tests last)."""

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow = Counter(file_of(item) for item in items if item.get_closest_marker("slow"))
    position = {name: index for index, name in enumerate(dict.fromkeys(map(file_of, items)))}
    items.sort(key=lambda item: (-slow[file_of(item)], position[file_of(item)]))
