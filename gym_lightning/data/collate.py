"""Batching: dynamic right padding, left-padded generation prompts, and padding-free packed rows.

Batches follow the shared contract: ``input_ids``, ``attention_mask`` (1 = real token), ``labels`` (``-100`` = not a
target) and ``position_ids``, all ``[B, T]`` int64 and right-padded to the longest row of the batch. When every
sample has a prompt, the batch also carries ``prompt_input_ids`` / ``prompt_attention_mask`` LEFT-padded (so that
``generate`` appends new tokens right after each prompt), ``prompts`` and, when every sample has one, ``references``.

Packed rows (``gym_lightning.data.prepare.pack_dataset``: whole samples concatenated in order, each row's document
lengths in ``seq_lens``) are padding-free: ``position_ids`` restart at 0 at every document, the label of each
document's first token is ``-100``, the padding at the end of a shorter row is one more position-restarting segment
with no targets, and the batch has NO ``attention_mask`` but ``cu_seq_lens`` (int32 cumulative document lengths of
the flattened batch, flash-attention's varlen boundaries). transformers 5 then keeps documents apart by itself
(``masking_utils._preprocess_mask_arguments``: with ``attention_mask=None`` and ``position_ids`` given, it calls
``find_packed_sequence_indices`` and ANDs a same-document mask into the causal mask): ``sdpa``, ``eager`` and
``flex_attention`` get a block-diagonal causal mask and ``flash_attention_2``/``3`` run variable-length attention from
the position ids, at any batch size. A model whose attention does not go through ``masking_utils`` would let a
token attend to earlier documents of its row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

    def __call__(self, rows: list[TokenizedSample | Mapping[str, Any]]) -> dict[str, Any]:
        samples = [_as_sample(row) for row in rows]
        if rows and isinstance(rows[0], Mapping) and "seq_lens" in rows[0]:
            return packed_batch(samples, [row["seq_lens"] for row in rows], self.pad_token_id)
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


def _as_sample(row: TokenizedSample | Mapping[str, Any]) -> TokenizedSample:
    """A ``datasets`` row (dict) as a ``TokenizedSample``."""
    if isinstance(row, TokenizedSample):
        return row
    return TokenizedSample(
        row["input_ids"],
        row["labels"],
        prompt_ids=row.get("prompt_ids"),
        prompt=row.get("prompt"),
        reference=row.get("reference"),
    )


def packed_positions(seq_lens: Sequence[int], width: int) -> list[int]:
    """Position ids of a packed row padded to ``width``: 0..n-1 per document, then 0.. over the padding."""
    positions = [p for length in seq_lens for p in range(length)]
    return positions + list(range(width - len(positions)))


def packed_batch(
    samples: Sequence[TokenizedSample], seq_lens: Sequence[Sequence[int]], pad_token_id: int
) -> dict[str, Any]:
    """A padding-free batch of packed rows (see the module docstring)."""
    width = max(len(s.input_ids) for s in samples)
    lengths = []
    for row_lens in seq_lens:
        pad = width - sum(row_lens)
        lengths += [*row_lens, *([pad] if pad else [])]
    return {
        "input_ids": _pad([s.input_ids for s in samples], pad_token_id),
        "labels": _pad([s.labels for s in samples], IGNORE_INDEX),
        "position_ids": torch.tensor([packed_positions(lens, width) for lens in seq_lens], dtype=torch.long),
        "cu_seq_lens": torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32),
    }


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
