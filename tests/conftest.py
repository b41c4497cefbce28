"""Test-wide settings: no network, quiet tokenizers, small shared fixtures."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.floors import FLOORS
from helpers.shared import built_once, heaviest_files_first, in_worker, one_thread_per_worker
from helpers.warm_deepspeed import ALL_OPS, warm

# Nothing may be fetched from a model hub during tests: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if in_worker():
    one_thread_per_worker()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, workers take files in the order :func:`pytest_collection_modifyitems` leaves them."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(request: pytest.FixtureRequest) -> None:
    """Build DeepSpeed's JIT ops once per session, before any multi-rank test races two ranks to build them.

    The multi-rank tests are all marked slow; a run that selects none of them skips the build (~1-7 min when the
    torch extensions cache is cold, ~1 s when warm).
    """
    if any(item.get_closest_marker("slow") for item in request.session.items):
        for name, status in warm(ALL_OPS).items():
            print(f"DeepSpeed op {name}: {status}", file=sys.stderr)


@pytest.fixture(autouse=True)
def restored_environment() -> Iterator[None]:
    """Each test sees the environment the session started with. An in-process Trainer writes MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE, ... into ``os.environ`` (Lightning's ``LightningEnvironment`` picks the port once and
    keeps it there); a later test's subprocess would inherit that port, which the earlier test's TCPStore may still
    hold (EADDRINUSE in benchmarks/gpu.sh --cpu-smoke, seen twice in full-suite runs)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def two_rank_memory_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The MemoryCallback's 2-rank training job (tests/callbacks/test_memory_monitor.py), made once per test run for
    every strategy of ``helpers.memory_job.STRATEGIES`` (in one launch) and for any other strategy asked for; returns
    the folder holding a strategy's memory.json and throughput.json. The callback test and the planner's validation
    read the same runs instead of launching them twice."""
    from helpers.memory_job import STRATEGIES, run_two_ranks

    def run(strategy: str) -> Path:
        names = STRATEGIES if strategy in STRATEGIES else (strategy,)
        root = built_once(tmp_path_factory, "memory-" + "-".join(names), lambda out: run_two_ranks(names, out))
        return root / strategy

    return run


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Any]:
    """A ``gym fit`` run of a shipped config on 2 CPU ranks (``helpers.cli_runs``) for a (strategy, LoRA) pair: the
    export, damaged-checkpoint and hung-rank tests share them. The first request of the run (``helpers.shared``: also
    across xdist's workers) makes every pair, in one launch (one process-group start and import instead of ten: ~80 s
    less on 2 cores)."""
    from helpers.cli_runs import CONFIGS, CliRun, cli_runs

    pairs = [(name, with_lora) for name in CONFIGS for with_lora in (False, True)]

    def folder(root: Path, pair: tuple[str, bool]) -> Path:
        return root / f"cli-{pair[0]}-{int(pair[1])}"

    def build(root: Path) -> None:
        cli_runs({pair: folder(root, pair) for pair in pairs})

    def run(strategy: str, lora: bool = False) -> Any:
        root = built_once(tmp_path_factory, "cli-runs", build)
        return CliRun.of(folder(root, (strategy, lora)))

    return run


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The kill/resume tests' tiny pretrained Llama folder and their 24 prompt/completion records (one copy per
    test run: checkpointing/test_resume.py, checkpointing/test_elastic.py, checkpointing/test_world_size.py)."""
    from helpers.strategy_worker import records, save_tiny_pretrained

    def build(root: Path) -> None:
        save_tiny_pretrained(root / "model")
        write_jsonl(root / "train.jsonl", records())

    root = built_once(tmp_path_factory, "resume-shared", build)
    return root / "model", root / "train.jsonl"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture
def variable_length_jsonl(tmp_path: Path) -> Path:
    """Prompt/completion records whose completions differ a lot in length (so token weighting matters)."""
    records = [
        {"prompt": f"{i}+{i}=", "completion": " ".join(str(i * 7 + k) for k in range(1 + (i * 5) % 11))}
        for i in range(16)
    ]
    return write_jsonl(tmp_path / "train.jsonl", records)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests :data:`FLOORS` names ``floors``; under pytest-xdist, order the files heaviest first."""
    for item in items:
        if item.nodeid.startswith(FLOORS):
            item.add_marker(pytest.mark.floors)
    if in_worker():
        heaviest_files_first(items)
