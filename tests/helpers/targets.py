"""Reading a tokenized sample's targets back as text, for the data tests."""

from __future__ import annotations

from typing import Any

from gym_lightning.loss import IGNORE_INDEX


def target_runs(ids: list[int], labels: list[int], tokenizer: Any) -> list[str]:
    """The decoded contiguous runs of target tokens (labels equal to their ids; anything else is ``-100``)."""
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            assert label == token
            current.append(token)
    return runs + ([tokenizer.decode(current)] if current else [])
