"""Tokenized samples of in-memory records for the data tests, and a reference tokenization to check the fast path.

``tokenize_record``/``tokenize_records`` go through what the data module runs (``prepare.example_columns``, then the
prompts as ``prepare.Tokenize`` stores them for validation), but keep each record's own origin in error messages
(``Tokenize`` names rows by data set and number). ``reference_pairs`` is an independent oracle for plain records:
per record, with Python lists, what ``gym_lightning.data.arrays`` computes with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from transformers import PreTrainedTokenizerBase

from gym_lightning.data.arrays import Columns
from gym_lightning.data.chat import chat_labels
from gym_lightning.data.formats import (
    CHAT_FORMATS,
    EOS,
    TokenizedSample,
    check_fields,
    conversation,
    plain_segments,
    prompt_ids_of,
    prompt_text,
    report_dropped,
    resolve_format,
)
from gym_lightning.data.prepare import example_columns
from gym_lightning.data.sources import Record
from gym_lightning.data.tokens import special_prefix
from gym_lightning.loss import IGNORE_INDEX

Pairs = list[tuple[list[int], list[int]]]


def column_pairs(columns: Columns) -> Pairs:
    """The ``(ids, labels)`` lists of each kept example of ``columns``."""
    bounds = columns.offsets.tolist()
    return [(columns.ids[start:end].tolist(), columns.labels[start:end].tolist()) for start, end in pairwise(bounds)]


def tokenize_records(
    records: Sequence[Record],
    format: str,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    mask_prompt: bool = True,
) -> list[TokenizedSample]:
    """Training/validation samples of records, with their prompt and reference (none for ``text``); those left
    without any target by truncation are dropped and reported."""
    format = resolve_format(format, records)
    columns = example_columns(records, format, tokenizer, max_seq_length, mask_prompt)
    report_dropped(len(records), len(columns.kept), max_seq_length)
    samples = []
    for index, (ids, labels) in zip(columns.kept.tolist(), column_pairs(columns), strict=True):
        sample = TokenizedSample(ids, labels)
        if format != "text":
            sample.prompt, sample.reference = prompt_text(records[index], format, tokenizer)
            sample.prompt_ids = prompt_ids_of(tokenizer, sample.prompt, format, max_seq_length)
        samples.append(sample)
    return samples


def tokenize_record(
    record: Record, format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, mask_prompt: bool = True
) -> TokenizedSample:
    """The sample of one record (``tokenize_records`` of it alone: a record left without a target is an error)."""
    (sample,) = tokenize_records([record], format, tokenizer, max_seq_length, mask_prompt)
    return sample


def _reference_plain(
    records: Sequence[Record], format: str, tokenizer: PreTrainedTokenizerBase, mask_prompt: bool
) -> Pairs:
    """The tokenizer's special prefix (never a target), then each segment tokenized on its own through the
    tokenizer's ``__call__``, labelled as a whole; one call for all segments of all records."""
    all_segments = [plain_segments(record, format)[0] for record in records]
    texts = [text for segments in all_segments for text, _ in segments if text is not EOS]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    prefix = special_prefix(tokenizer)
    out = []
    for segments in all_segments:
        input_ids, labels = list(prefix), [IGNORE_INDEX] * len(prefix)
        for text, is_target in segments:
            ids = [tokenizer.eos_token_id] if text is EOS else next(encoded)
            input_ids += ids
            labels += ids if (is_target or not mask_prompt) else [IGNORE_INDEX] * len(ids)
        out.append((input_ids, labels))
    return out


def reference_pairs(
    records: Sequence[Record], format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, mask_prompt: bool
) -> Pairs:
    """Ids and labels of every record (fields checked), cut to ``max_seq_length`` (none dropped). Chat records take
    ``chat_labels`` as they are, so the comparison checks what the production path does with its pairs."""
    for record in records:
        check_fields(record, format)
    if format in CHAT_FORMATS:
        pairs = chat_labels([conversation(r, format) for r in records], tokenizer, [r.origin for r in records])
        pairs = pairs if mask_prompt else [(ids, list(ids)) for ids, _ in pairs]
    else:
        pairs = _reference_plain(records, format, tokenizer, mask_prompt)
    return [(ids[:max_seq_length], labels[:max_seq_length]) for ids, labels in pairs]
