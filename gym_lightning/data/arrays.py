"""Tokenized examples of a batch as flat int32 columns (values + offsets), assembled with numpy, for Arrow.

The preparation of a large set spends most of its time outside the Rust tokenizer when each example is built as a
Python list of Python ints: transformers converts every encoding into a ``BatchEncoding`` entry, each record's
segments are concatenated and masked token by token, and ``datasets`` converts the lists back into Arrow. Here the
segments of a whole batch go straight through the Rust tokenizer (``tokens.encode_ids``), the ids are laid out in one
flat int32 array, labels come from a per-segment target flag repeated over the segment's length, truncation and the
"has a target" test are array operations, and the result is handed to ``datasets`` as Arrow list arrays.

Plain (non-chat) records come in two ways, both ending in ``from_pieces`` with the same pieces and target rule
(``piece_targets``): ``plain_columns`` takes any batch, record by record; ``slot_columns`` takes a batch whose records
all have the same segments (``formats.uniform_plain_slots``) without Python work per record. Either gives each
record's segments (``formats.plain_segments``), each tokenized on its own (so nothing merges across a segment
boundary), in order, after the tokenizer's special prefix; tests/data/test_arrays.py compares both with a per-record
reference written with Python lists. ``pair_columns`` takes the chat path's ``(ids, labels)`` pairs
(``gym_lightning.data.chat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from gym_lightning.data.formats import EOS, has_target, plain_segments, segment_texts
from gym_lightning.data.sources import Record
from gym_lightning.data.tokens import encode_ids, special_prefix
from gym_lightning.loss import IGNORE_INDEX


@dataclass
class Columns:
    """Examples of a batch, flat.

    Attributes:
        ids: All examples' token ids, one after the other (int32).
        labels: Their labels (int32, ``-100`` for non-targets).
        offsets: ``len(kept) + 1`` start positions of each example in ``ids`` (int32, Arrow's list offsets).
        kept: Index in the batch of each example (those left without a target by truncation are dropped).
    """

    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    kept: np.ndarray

    def arrow(self) -> dict[str, pa.Array]:
        """``input_ids`` and ``labels`` as Arrow ``list<int32>`` arrays sharing the offsets (no copy per row)."""
        offsets = pa.array(self.offsets, type=pa.int32())
        return {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(self.ids, type=pa.int32())),
            "labels": pa.ListArray.from_arrays(offsets, pa.array(self.labels, type=pa.int32())),
        }


def from_pieces(
    pieces: list[list[int]], targets: np.ndarray, piece_record: np.ndarray, num_records: int, max_seq_length: int
) -> Columns:
    """Concatenate each record's pieces (token id lists, in order), label its target pieces, cut each record to
    ``max_seq_length`` tokens and drop those with no target after their first token (``formats.has_target``).
    The cut and the target test work on pieces (a few per record); token-length arrays are built only when some
    record is cut or dropped (every full-length int64 array costs time in proportion to the tokens)."""
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    ids = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=int(lengths.sum()))
    labels = np.where(np.repeat(targets, lengths), ids, np.int32(IGNORE_INDEX)).astype(np.int32, copy=False)
    record_lengths = np.bincount(piece_record, weights=lengths, minlength=num_records).astype(np.int64)
    record_starts = np.cumsum(record_lengths) - record_lengths
    start = np.cumsum(lengths) - lengths - record_starts[piece_record]  # each piece's first position in its record
    # A piece trains a token when it is a target overlapping positions [1, max_seq_length) of its record.
    trains = targets & (np.minimum(start + lengths, max_seq_length) > np.maximum(start, 1))
    has_target = np.bincount(piece_record[trains], minlength=num_records) > 0
    kept = np.nonzero(has_target)[0]
    cut = np.minimum(record_lengths[kept], max_seq_length)
    offsets = np.concatenate([[0], np.cumsum(cut)]).astype(np.int32)
    if len(kept) < num_records or bool((record_lengths > max_seq_length).any()):
        position = np.arange(len(ids)) - np.repeat(record_starts, record_lengths)
        keep = (position < max_seq_length) & np.repeat(has_target, record_lengths)
        ids, labels = ids[keep], labels[keep]
    return Columns(ids, labels, offsets, kept)


def piece_targets(flags: Sequence[bool], mask_prompt: bool) -> list[bool]:
    """Whether each piece of a plain record is a target: the special prefix never (a bos is not predicted from
    anything, whatever ``mask_prompt`` says), then each segment (``flags``, the closing eos's included: it always is
    one) when it is a target or when ``mask_prompt`` is off."""
    return [False, *(flag or not mask_prompt for flag in flags)]


def plain_columns(
    records: Sequence[Record], format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, mask_prompt: bool
) -> Columns:
    """Columns of non-chat records (fields already checked), cut to ``max_seq_length``; those left without a target
    dropped. All segments of all records go through one ``encode_ids`` call."""
    all_segments = [plain_segments(record, format)[0] for record in records]
    encoded = iter(encode_ids(tokenizer, segment_texts(all_segments)))
    prefix, eos = special_prefix(tokenizer), [tokenizer.eos_token_id]
    pieces: list[list[int]] = []
    targets: list[bool] = []
    piece_record: list[int] = []
    for index, segments in enumerate(all_segments):
        pieces += [prefix, *(eos if text is EOS else next(encoded) for text, _ in segments)]
        targets += piece_targets([is_target for _, is_target in segments], mask_prompt)
        piece_record += [index] * (len(segments) + 1)
    return from_pieces(
        pieces, np.asarray(targets, dtype=bool), np.asarray(piece_record, dtype=np.int64), len(records), max_seq_length
    )


def pair_columns(pairs: Sequence[tuple[list[int], list[int]]]) -> Columns:
    """Columns of already cut ``(ids, labels)`` pairs (the chat path), dropping those without a target."""
    kept = np.asarray([i for i, (_, labels) in enumerate(pairs) if has_target(labels)], dtype=np.int64)
    lengths = np.fromiter((len(pairs[i][0]) for i in kept), dtype=np.int64, count=len(kept))
    total = int(lengths.sum())
    ids = np.fromiter(chain.from_iterable(pairs[i][0] for i in kept), dtype=np.int32, count=total)
    labels = np.fromiter(chain.from_iterable(pairs[i][1] for i in kept), dtype=np.int32, count=total)
    return Columns(ids, labels, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), kept)


def slot_columns(
    slots: Sequence[Sequence[str]],
    flags: Sequence[bool],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    mask_prompt: bool,
) -> Columns:
    """``plain_columns`` of records laid out as ``formats.uniform_plain_slots`` gives them (segment j of every
    record in ``slots[j]``, a target when ``flags[j]``; then the eos), without Python work per record or segment.
    Outside the tokenizer, 50k generated alpaca records took 2.7 CPU-s through ``plain_columns`` and 1.3 here (one
    process, cProfile, 2 Dec 2026)."""
    count = len(slots[0])
    encoded = [encode_ids(tokenizer, texts) for texts in slots]
    prefix, eos = special_prefix(tokenizer), [tokenizer.eos_token_id]
    pieces = [piece for row in zip(repeat(prefix, count), *encoded, repeat(eos, count), strict=True) for piece in row]
    targets = np.tile(np.asarray(piece_targets([*flags, True], mask_prompt)), count)  # True: the closing eos
    piece_record = np.repeat(np.arange(count, dtype=np.int64), len(flags) + 2)
    return from_pieces(pieces, targets, piece_record, count, max_seq_length)
