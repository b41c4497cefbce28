"""Tokenized examples of a batch as flat int32 columns (values + offsets), assembled with numpy, for Arrow.

The preparation of a large set spends most of its time outside the Rust tokenizer when each example is built as a
Python list of Python ints: transformers converts every encoding into a ``BatchEncoding`` entry, each record's
segments are concatenated and masked token by token, and ``datasets`` converts the lists back into Arrow. Here the
segments of a whole batch go through one ``encode_batch`` of the Rust tokenizer, the ids are laid out in one flat
int32 array, labels come from a per-segment target flag repeated over the segment's length, truncation and the
"has a target" test are array operations, and the result is handed to ``datasets`` as Arrow list arrays.

The result is exactly that of ``formats.tokenize_examples`` (tests/test_data_fast.py compares them): the same
segments (``formats.plain_segments``), each tokenized on its own as there (so nothing merges across a segment
boundary in either), in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import pyarrow as pa
from tokenizers import Encoding, Tokenizer
from transformers import PreTrainedTokenizerBase

from gym_lightning.data.formats import EOS, Segments, has_target, plain_segments, special_prefix
from gym_lightning.data.sources import Record
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


def encode(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[Encoding]:
    """The Rust encodings of ``tokenizer(texts, add_special_tokens=False)`` for a fast tokenizer: transformers'
    ``__call__`` sets the same two backend options (no truncation or padding, since none is asked;
    ``encode_special_tokens`` from ``split_special_tokens``) and calls the same ``encode_batch``, then converts each
    encoding into a ``BatchEncoding`` entry (15-25 % of the call on 20k alpaca records here), which is skipped.
    :func:`encode_ids` calls ``encode_batch_fast`` instead (same ids, no character offsets)."""
    backend = plain_backend(tokenizer)
    return backend.encode_batch(list(texts), add_special_tokens=False)


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The fast tokenizer's Rust backend set up as transformers' ``__call__`` sets it when nothing is asked."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend


# Texts per call of the Rust tokenizer when only ids are wanted. Short calls keep a call's encodings in the CPU caches:
# on the 40k segments of 20k generated alpaca records (benchmarks/data_prep.py's), 32-128 texts per call took
# 3.8-4.1 CPU-s against 4.5 for the 2,000 of one map batch in one call (medians of 5 interleaved repeats, idle
# machine, 2 Dec 2026); 1,000-record map batches were already 1.3x faster than 10,000 (30 Nov, docs/benchmarks.md).
ENCODE_CHUNK = 64


def encode_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=False)["input_ids"]`` (straight from the Rust backend when fast)."""
    if not tokenizer.is_fast:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    # No offsets: the plain formats label whole segments. encode_batch_fast skips computing them: 8.2-10.0 vs
    # 10.5-11.1 CPU-s for the 80k segments of 40k generated alpaca records, interleaved, idle machine (30 Nov 2026);
    # an earlier single measurement at load ~8 had it slower, which three interleaved repeats did not confirm.
    backend = plain_backend(tokenizer)
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21
    texts = list(texts)
    return [
        encoding.ids
        for start in range(0, len(texts), ENCODE_CHUNK)
        for encoding in encode_batch(texts[start : start + ENCODE_CHUNK], add_special_tokens=False)
    ]


def offsets_array(encoding: Encoding) -> np.ndarray:
    """An encoding's ``(start, end)`` character offsets as an ``[n, 2]`` int64 array. ``np.asarray`` of the list of
    tuples took 1.6 of 17.5 s in a profile of 3k ShareGPT conversations; a flat ``fromiter`` is ~1.5x faster (3000
    lists of 300 offsets: 0.58 s vs 0.91 s here, loaded machine)."""
    offsets = encoding.offsets
    flat = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    return flat.reshape(-1, 2)


def from_pieces(
    pieces: list[list[int]], targets: np.ndarray, piece_record: np.ndarray, num_records: int, max_seq_length: int
) -> Columns:
    """Concatenate each record's pieces (token id lists, in order), label its target pieces, cut each record to
    ``max_seq_length`` tokens and drop those with no target after their first token (``formats.has_target``).
    The cut and the target test work on pieces (a few per record); token-length arrays are built only when some
    record is cut or dropped (every full-length int64 array costs ~1 s per 100M tokens here)."""
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


def segment_texts(all_segments: Sequence[Segments]) -> list[str]:
    """The texts the tokenizer sees for the records' segments, in order (``EOS`` marks a token, not text)."""
    return [text for segments in all_segments for text, _ in segments if text is not EOS]


def plain_columns(
    records: Sequence[Record], format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, mask_prompt: bool
) -> Columns:
    """Columns of non-chat records (fields already checked): ``formats.tokenize_plain`` + cut + drop, vectorised."""
    all_segments = [plain_segments(record, format)[0] for record in records]
    encoded = iter(encode_ids(tokenizer, segment_texts(all_segments)))
    prefix, eos = special_prefix(tokenizer), [tokenizer.eos_token_id]
    pieces: list[list[int]] = []
    targets: list[bool] = []
    piece_record: list[int] = []
    for index, segments in enumerate(all_segments):
        pieces.append(prefix)
        targets.append(False)  # a bos is never a target, whatever mask_prompt says (as in tokenize_plain)
        for text, is_target in segments:
            pieces.append(eos if text is EOS else next(encoded))
            targets.append(is_target or not mask_prompt)
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
    # The bos is never a target and the eos always is (as in plain_columns).
    targets = np.tile(np.asarray([False, *(flag or not mask_prompt for flag in flags), True]), count)
    piece_record = np.repeat(np.arange(count, dtype=np.int64), len(flags) + 2)
    return from_pieces(pieces, targets, piece_record, count, max_seq_length)
