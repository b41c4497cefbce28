"""Test-wide settings: no network, quiet tokenizers, small shared fixtures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Nothing may be fetched from a model hub during tests: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
