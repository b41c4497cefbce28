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
    encoding into a ``BatchEncoding`` entry (a large share of the call: docs/benchmarks-history.md, "Data
    preparation: the tokenizer calls"), which is skipped.
    :func:`encode_ids` calls ``encode_batch_fast`` instead (same ids, no character offsets)."""
    backend = plain_backend(tokenizer)
    return backend.encode_batch(list(texts), add_special_tokens=False)


# Texts per call of the Rust tokenizer when only ids are wanted. Short calls keep a call's encodings in the CPU caches
# (benchmarks/data_prep.py; docs/benchmarks-history.md, "Data preparation: the tokenizer calls").
ENCODE_CHUNK = 64


def encode_ids(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], add_special_tokens: bool = False
) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=...)["input_ids"]`` (straight from the Rust backend when fast; its
    post-processor adds the special tokens as transformers' call does)."""
    if not tokenizer.is_fast:
        return tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"] if texts else []
    # No offsets: the plain formats label whole segments, and encode_batch_fast skips computing them (faster:
    # docs/benchmarks-history.md, "Data preparation: the tokenizer calls").
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
    tuples is slow; a flat ``fromiter`` is faster (docs/benchmarks-history.md, "Data preparation: the tokenizer
    calls")."""
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
