"""Batching: dynamic right padding, left-padded generation prompts, and sequence packing.

Batches follow the shared contract: ``input_ids``, ``attention_mask`` (1 = real token), ``labels`` (``-100`` = not a
target) and ``position_ids``, all ``[B, T]`` int64 and right-padded to the longest row of the batch. When every
sample has a prompt, the batch also carries ``prompt_input_ids`` / ``prompt_attention_mask`` LEFT-padded (so that
``generate`` appends new tokens right after each prompt), ``prompts`` and, when every sample has one, ``references``.

Packing (``pack_samples``) concatenates whole tokenized samples greedily, in order, into rows of at most
``max_seq_length`` tokens, so fewer pad tokens are computed. In a packed row ``position_ids`` restart at 0 for
every document and the label of each document's first token is ``-100``, so no document is trained to predict
the first token of the next one. Attention isolation is NOT complete: with ``sdpa`` or ``eager`` attention the
causal mask lets a token attend to earlier documents in the same row; only ``flash_attention_2`` in transformers
reads the restarting ``position_ids`` as document boundaries (variable-length attention) and isolates documents.
Padding-free packing changes what a token sees, so keep packing off where this matters (e.g. validation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gym_lightning.data.formats import TokenizedSample
from gym_lightning.loss import IGNORE_INDEX


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool = False) -> torch.Tensor:
    """A ``[len(rows), longest]`` int64 tensor of ``rows`` padded with ``value`` on the right (or left)."""
    width = max(len(row) for row in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if not row:
            continue
        values = torch.tensor(list(row), dtype=torch.long)
        if left:
            out[i, width - len(row) :] = values
        else:
            out[i, : len(row)] = values
    return out


class Collator:
    """Turns a list of ``TokenizedSample`` into a batch dict (picklable, so it works with worker processes).

    Args:
        pad_token_id: Id written into padded positions of ``input_ids`` (they are masked and never targets).
        with_prompts: Add the generation fields when every sample has a prompt (validation and prediction).
    """

    def __init__(self, pad_token_id: int, with_prompts: bool = False) -> None:
        self.pad_token_id = pad_token_id
        self.with_prompts = with_prompts

    def __call__(self, samples: list[TokenizedSample]) -> dict[str, Any]:
        batch: dict[str, Any] = {
            "input_ids": _pad([s.input_ids for s in samples], self.pad_token_id),
            "attention_mask": _pad([[1] * len(s.input_ids) for s in samples], 0),
            "labels": _pad([s.labels for s in samples], IGNORE_INDEX),
            "position_ids": _pad([s.position_ids or range(len(s.input_ids)) for s in samples], 0),
        }
        if self.with_prompts and all(s.prompt_ids is not None for s in samples):
            batch["prompt_input_ids"] = _pad([s.prompt_ids for s in samples], self.pad_token_id, left=True)
            batch["prompt_attention_mask"] = _pad([[1] * len(s.prompt_ids) for s in samples], 0, left=True)
            batch["prompts"] = [s.prompt for s in samples]
            if all(s.reference is not None for s in samples):
                batch["references"] = [s.reference for s in samples]
        return batch


def pack_samples(samples: Sequence[TokenizedSample], max_seq_length: int) -> list[TokenizedSample]:
    """Greedily concatenate samples (in order) into rows of at most ``max_seq_length`` tokens; none is dropped.

    Samples must already be truncated to ``max_seq_length``. Packed rows carry no prompt (they are for training).
    """
    rows: list[TokenizedSample] = []
    current = TokenizedSample([], [], position_ids=[])
    for sample in samples:
        if len(sample.input_ids) > max_seq_length:
            raise ValueError(f"Cannot pack a sample of {len(sample.input_ids)} tokens into rows of {max_seq_length}.")
        if current.input_ids and len(current.input_ids) + len(sample.input_ids) > max_seq_length:
            rows.append(current)
            current = TokenizedSample([], [], position_ids=[])
        current.input_ids += sample.input_ids
        # The first token of a document is never a target: it would be predicted from the previous document.
        current.labels += [IGNORE_INDEX, *sample.labels[1:]]
        current.position_ids += range(len(sample.input_ids))
    if current.input_ids:
        rows.append(current)
    return rows
