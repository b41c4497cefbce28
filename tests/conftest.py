"""Test-wide settings: no network, quiet tokenizers, small shared fixtures."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.warm_deepspeed import ALL_OPS, warm

# Nothing may be fetched from a model hub during tests: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(request: pytest.FixtureRequest) -> None:
    """Build DeepSpeed's JIT ops once per session, before any multi-rank test races two ranks to build them.

    The multi-rank tests are all marked slow; a run that selects none of them skips the build (~1-7 min when the
    torch extensions cache is cold, ~1 s when warm).
    """
    if any(item.get_closest_marker("slow") for item in request.session.items):
        for name, status in warm(ALL_OPS).items():
            print(f"DeepSpeed op {name}: {status}", file=sys.stderr)


@pytest.fixture(scope="session")
def two_rank_memory_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The MemoryCallback's 2-rank training job (tests/test_callbacks_memory.py), run at most once per strategy per
    session; returns the folder holding its memory.json and throughput.json. The callback test and the planner's
    validation read the same runs instead of launching them twice."""
    from test_callbacks_memory import run_two_ranks

    done: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp(strategy)
            run_two_ranks(strategy, out)
            done[strategy] = out
        return done[strategy]

    return run


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Any]:
    """A ``gym fit`` run of a shipped config on 2 CPU ranks (``helpers.cli_runs``), made at most once per session
    for each (strategy, LoRA) pair: the export, damaged-checkpoint and hung-rank tests share them."""
    from helpers.cli_runs import cli_run as make_run

    done: dict[tuple[str, bool], Any] = {}

    def run(strategy: str, lora: bool = False) -> Any:
        if (strategy, lora) not in done:
            done[strategy, lora] = make_run(strategy, lora, tmp_path_factory.mktemp(f"cli-{strategy}-{int(lora)}"))
        return done[strategy, lora]

    return run


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The kill/resume tests' tiny pretrained Llama folder and their 24 prompt/completion records (one copy per
    session: test_checkpointing_resume.py, test_checkpointing_elastic.py, test_checkpointing_world_size.py)."""
    from helpers.strategy_worker import save_tiny_pretrained
    from test_checkpointing_resume import records

    root = tmp_path_factory.mktemp("resume_shared")
    return save_tiny_pretrained(root / "model"), write_jsonl(root / "train.jsonl", records())


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
