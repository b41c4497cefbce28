"""Tokenizer helpers shared by the data preparation: fast calls straight to the Rust backend and special tokens.

Nothing here knows about records or formats. ``encode`` and ``encode_ids`` are ``tokenizer(texts,
add_special_tokens=False)`` without transformers' conversion of every encoding into Python lists (the preparation of a
large set spends most of its time there otherwise); ``special_prefix`` and ``special_token_ids`` say which ids the
tokenizer adds on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
from tokenizers import Encoding, Tokenizer
from transformers import PreTrainedTokenizerBase


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The fast tokenizer's Rust backend set up as transformers' ``__call__`` sets it when nothing is asked."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend


def encode(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[Encoding]:
    """The Rust encodings of ``tokenizer(texts, add_special_tokens=False)`` for a fast tokenizer: transformers'
    ``__call__`` sets the same two backend options (no truncation or padding, since none is asked;
    ``encode_special_tokens`` from ``split_special_tokens``) and calls the same ``encode_batch``, then converts each
    encoding into a ``BatchEncoding`` entry (15-25 % of the call on 20k alpaca records here), which is skipped.
    :func:`encode_ids` calls ``encode_batch_fast`` instead (same ids, no character offsets)."""
    backend = plain_backend(tokenizer)
    return backend.encode_batch(list(texts), add_special_tokens=False)


# Texts per call of the Rust tokenizer when only ids are wanted. Short calls keep a call's encodings in the CPU caches:
# on the 40k segments of 20k generated alpaca records (benchmarks/data_prep.py's), 32-128 texts per call took
# 3.8-4.1 CPU-s against 4.5 for the 2,000 of one map batch in one call (medians of 5 interleaved repeats, idle
# machine, 2 Dec 2026); 1,000-record map batches were already 1.3x faster than 10,000 (30 Nov,
# docs/benchmarks-history.md).
ENCODE_CHUNK = 64


def encode_ids(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], add_special_tokens: bool = False
) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=...)["input_ids"]`` (straight from the Rust backend when fast; its
    post-processor adds the special tokens as transformers' call does)."""
    if not tokenizer.is_fast:
        return tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"] if texts else []
    # No offsets: the plain formats label whole segments. encode_batch_fast skips computing them: 8.2-10.0 vs
    # 10.5-11.1 CPU-s for the 80k segments of 40k generated alpaca records, interleaved, idle machine (30 Nov 2026);
    # an earlier single measurement at load ~8 had it slower, which three interleaved repeats did not confirm.
    backend = plain_backend(tokenizer)
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21
    texts = list(texts)
    return [
        encoding.ids
        for start in range(0, len(texts), ENCODE_CHUNK)
        for encoding in encode_batch(texts[start : start + ENCODE_CHUNK], add_special_tokens=add_special_tokens)
    ]


def offsets_array(encoding: Encoding) -> np.ndarray:
    """An encoding's ``(start, end)`` character offsets as an ``[n, 2]`` int64 array. ``np.asarray`` of the list of
    tuples took 1.6 of 17.5 s in a profile of 3k ShareGPT conversations; a flat ``fromiter`` is ~1.5x faster (3000
    lists of 300 offsets: 0.58 s vs 0.91 s here, loaded machine)."""
    offsets = encoding.offsets
    flat = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    return flat.reshape(-1, 2)


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids the tokenizer puts before a text (a bos for Llama, nothing for Qwen); chat templates add their own."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return [i for i in ids if i != tokenizer.eos_token_id]


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of the tokenizer's special tokens (named ones and added tokens flagged special), bos excluded."""
    added = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    return (added | set(tokenizer.all_special_ids)) - {tokenizer.bos_token_id}
