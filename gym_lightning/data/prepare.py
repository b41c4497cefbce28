"""Tokenized data sets built once per node with Hugging Face ``datasets`` and cached under a fingerprint.

``build_or_load`` is called by every process: the first to take the cache entry's file lock (the local rank 0 in
``prepare_data``, which Lightning calls before any other rank's ``setup``) reads the sources with
``datasets.load_dataset``, tokenizes them with ``Dataset.map(batched=True, num_proc=...)`` (all segments of a batch in
one fast-tokenizer call), packs if asked, and keeps the result in a staging folder that is renamed into place. The
others wait on the lock (a file lock works before the process group exists) and then open the Arrow files
memory-mapped, so a rank's memory does not grow with the data size. Token ids and labels are stored as int32.

``Tokenize`` (the ``map`` function) hands a batch of plain records that all have the same segments to
``arrays.slot_columns``, any other batch to ``example_columns``: chat records to ``chat.chat_labels`` (then
``arrays.pair_columns``), plain ones to ``arrays.plain_columns``.

``Dataset.map`` writes its output straight into the staging folder (``cache_file_name``), and those files are the
cache entry (``done.json`` lists them per split): no second copy with ``save_to_disk`` (a single-core pass that the
other rank waits for) and no copy left behind in ``datasets``' own cache folder (docs/benchmarks-history.md, "Data
preparation: the tokenizer calls"). Only a split whose files lie elsewhere is copied in with ``save_to_disk``.

The cache entry's name is a fingerprint of everything that changes its content: each file's path, size and mtime
(or a Hub name, split and config), the tokenizer (its vocabulary and special tokens), the chat template, the formats,
column mappings, weights and caps, ``max_seq_length``, ``mask_prompt``, ``packing``, ``val_split`` and the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from filelock import FileLock
from transformers import PreTrainedTokenizerBase

from gym_lightning._compat import rank_zero_info
from gym_lightning.atomic import atomic_directory
from gym_lightning.data.arrays import Columns, pair_columns, plain_columns, slot_columns
from gym_lightning.data.chat import chat_labels
from gym_lightning.data.formats import (
    CHAT_FORMATS,
    TRAIN_FIELDS,
    canonical,
    check_fields,
    check_template,
    conversation,
    detect_format,
    prompt_ids_of,
    prompt_text,
    report_dropped,
    uniform_plain_slots,
)
from gym_lightning.data.sources import Record, load_source, source_fingerprint
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX

CACHE_VERSION = 2  # bump when the stored layout or the tokenization rules change
TOKEN_FEATURES = {
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    "labels": datasets.Sequence(datasets.Value("int32")),
}
PROMPT_FEATURES = {
    "prompt_ids": datasets.Sequence(datasets.Value("int32")),
    "prompt": datasets.Value("string"),
    "reference": datasets.Value("string"),
}


@dataclass
class DataSource:
    """One data set of a training mix.

    Args:
        path: Files or glob patterns (``.jsonl``, ``.json``, ``.csv``, ``.parquet``, ``.txt``, ``.arrow``), or the
            name of a Hugging Face Hub data set.
        format: Its record format (``"auto"`` detects it), see ``gym_lightning.data.formats``.
        columns: Renames its fields to the format's names, ``{format field: column}`` (e.g. ``{instruction:
            question, output: answer}``).
        weight: Relative sampling weight in the mix (the mix stops when every set has been drawn from completely,
            so a set with a larger share than its size is repeated).
        max_samples: Keep at most the first ``max_samples`` records of this set (``None``: all).
        split: Split of a Hub data set.
        subset: Configuration (subset) name of a Hub data set.
    """

    path: str | list[str]
    format: str = "auto"
    columns: dict[str, str] | None = None
    weight: float = 1.0
    max_samples: int | None = None
    split: str = "train"
    subset: str | None = None


@dataclass(frozen=True)
class Settings:
    """What tokenization depends on, besides the sources (part of the fingerprint)."""

    max_seq_length: int
    mask_prompt: bool
    packing: bool
    val_split: float
    seed: int
    num_proc: int | None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the vocabulary, merges, special tokens and chat template."""
    backend = (
        tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    parts = [
        backend,
        str(tokenizer.chat_template),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def fingerprint(
    sources: Sequence[DataSource], tokenizer: PreTrainedTokenizerBase, settings: Settings, extra: str
) -> str:
    """The cache key (see the module docstring); ``extra`` names bundled or validation data."""
    payload = {
        "version": CACHE_VERSION,
        "sources": [{**asdict(s), "files": source_fingerprint(s.path, s.split, s.subset)} for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": {k: v for k, v in asdict(settings).items() if k != "num_proc"},
        "extra": extra,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def batch_records(batch: dict[str, list], indices: Sequence[int], label: str) -> list[Record]:
    """The rows of a batched ``map`` call (column -> values) as records named for errors (numbered from 1)."""
    keys = list(batch)
    return [
        Record(dict(zip(keys, values, strict=True)), f"{label} record {index + 1}")
        for index, values in zip(indices, zip(*batch.values(), strict=True), strict=True)
    ]


def example_columns(
    records: Sequence[Record], format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, mask_prompt: bool
) -> Columns:
    """Ids and labels of training records of one format (fields checked), each cut to ``max_seq_length``; records
    left without a target are dropped (``Columns.kept`` names the others). Chat records get their targets from the
    template's rendering (``gym_lightning.data.chat``), the others from their segments (``plain_columns``)."""
    for record in records:
        check_fields(record, format)
    if format not in CHAT_FORMATS:
        return plain_columns(records, format, tokenizer, max_seq_length, mask_prompt)
    check_template(tokenizer)
    pairs = chat_labels([conversation(r, format) for r in records], tokenizer, [r.origin for r in records])
    if not mask_prompt:
        pairs = [(ids, list(ids)) for ids, _ in pairs]
    return pair_columns([(ids[:max_seq_length], labels[:max_seq_length]) for ids, labels in pairs])


class Tokenize:
    """The batched ``Dataset.map`` function: rows of one format to int32 ids and labels (picklable for ``num_proc``).

    Args:
        format: The rows' format (resolved, not ``auto``).
        tokenizer: The tokenizer.
        max_seq_length: Cut length.
        mask_prompt: Train only on targets.
        with_prompts: Also store the generation prompt, its ids and the reference (validation).
        label: Names the data set in error messages (records are numbered from 1).
        arrow: Return an Arrow table (``Dataset.map``) rather than a dict of Python lists (a stream's ``map``).
    """

    def __init__(
        self,
        format: str,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_length: int,
        mask_prompt: bool,
        with_prompts: bool,
        label: str,
        arrow: bool = True,
    ) -> None:
        self.format, self.tokenizer, self.max_seq_length = format, tokenizer, max_seq_length
        self.mask_prompt, self.with_prompts, self.label, self.arrow = mask_prompt, with_prompts, label, arrow

    def __call__(self, batch: dict[str, list], indices: list[int]) -> pa.Table | dict[str, list]:
        slots = None if self.format in CHAT_FORMATS else uniform_plain_slots(batch, self.format)
        records = batch_records(batch, indices, self.label) if slots is None or self.with_prompts else []
        if slots is not None:  # the common case, without a Python object per record
            columns = slot_columns(*slots, self.tokenizer, self.max_seq_length, self.mask_prompt)
        else:
            columns = example_columns(records, self.format, self.tokenizer, self.max_seq_length, self.mask_prompt)
        out: dict[str, pa.Array] = columns.arrow()
        if self.with_prompts:
            prompts = [prompt_text(records[i], self.format, self.tokenizer) for i in columns.kept.tolist()]
            out["prompt"] = pa.array([p for p, _ in prompts], type=pa.string())
            out["reference"] = pa.array([r for _, r in prompts], type=pa.string())
            prompt_ids = [prompt_ids_of(self.tokenizer, p, self.format, self.max_seq_length) for p, _ in prompts]
            out["prompt_ids"] = pa.array(prompt_ids, type=pa.list_(pa.int32()))
        # Dataset.map writes a returned Arrow table as is; a stream's map wants Python values.
        return pa.table(out) if self.arrow else pa.table(out).to_pydict()


def resolve_source_format(source: DataSource, dataset: datasets.Dataset, label: str) -> str:
    """The source's format, ``auto`` detected from its first row."""
    if source.format != "auto":
        return canonical(source.format)
    if len(dataset) == 0:
        raise GymUserError(f"The data set {label} is empty: it holds no records.")
    detected = detect_format(Record(dataset[0], f"{label} record 1"))
    rank_zero_info(f"Data format 'auto': detected {detected!r} from the fields of {label}.")
    return detected


def peek_format(source: DataSource, cache_dir: Path) -> str:
    """A source's format before it is prepared: as given, or detected from its first record, read as a stream (a
    Hub set that cannot be streamed now is read from ``datasets``' cache)."""
    if source.format != "auto":
        return canonical(source.format)
    try:
        rows, label = load_source(source.path, source.split, source.subset, cache_dir / "hf", streaming=True)
        first = next(iter(rename_columns(rows, source.columns, label)), None)
    except Exception:  # a stream raises its builder's own error (ArrowInvalid, ...) only when read;
        # the full load below turns it into the one-line error (file:line for JSON), or re-raises what is a real bug
        rows, label = load_records_dataset(source, cache_dir)
        first = rows[0] if len(rows) else None
    if first is None:
        raise GymUserError(f"The data set {label} is empty: it holds no records.")
    return detect_format(Record(first, f"{label} record 1"))


def rename_columns(dataset: datasets.Dataset, columns: dict[str, str] | None, label: str) -> datasets.Dataset:
    """Apply a ``{format field: column}`` mapping."""
    if not columns:
        return dataset
    names = dataset.column_names or list(next(iter(dataset)))  # a stream may not know its columns before reading
    missing = [column for column in columns.values() if column not in names]
    if missing:
        raise GymUserError(
            f"{label}: columns maps onto {missing}, which the data set lacks (it has {names}); fix "
            "the column names in `columns` ({format field: column of the data set})."
        )
    return dataset.rename_columns({column: field for field, column in columns.items() if column != field})


def map_processes(settings: Settings, num_records: int) -> int | None:
    """Worker processes of a tokenizing ``map`` (``None``: in this process). Each costs seconds to start: only
    worth it for large sets, unless ``num_proc`` says otherwise."""
    num_proc = settings.num_proc if settings.num_proc is not None else (min(os.cpu_count() or 1, 8))
    if settings.num_proc is None and num_records <= 50_000:
        return None
    return num_proc if num_proc > 1 else None


def tokenize_dataset(
    dataset: datasets.Dataset,
    format: str,
    tokenizer: PreTrainedTokenizerBase,
    settings: Settings,
    with_prompts: bool,
    label: str,
    cache_file: Path | None = None,
) -> datasets.Dataset:
    """Batched, multi-process tokenization; rows left without a target by truncation are dropped (and reported).
    ``cache_file``: where the tokenized rows are written (``num_proc`` workers add ``_0000k_of_0000n`` to the name);
    ``None``: ``datasets``' cache next to the source (or memory)."""
    features = datasets.Features({**TOKEN_FEATURES, **(PROMPT_FEATURES if with_prompts else {})})
    tokenized = dataset.map(
        Tokenize(format, tokenizer, settings.max_seq_length, settings.mask_prompt, with_prompts, label),
        batched=True,
        batch_size=1000,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=features,
        num_proc=map_processes(settings, len(dataset)),
        cache_file_name=None if cache_file is None else str(cache_file),
        desc=f"Tokenizing {label}",
    )
    report_dropped(len(dataset), len(tokenized), settings.max_seq_length)
    return tokenized


def greedy_row_bounds(lengths: np.ndarray, max_seq_length: int) -> np.ndarray:
    """Start index of each packed row, and the number of samples at the end: samples go, in order, into the current
    row while it has room (the former ``pack_samples`` rule), so each row is a contiguous range of samples."""
    bounds, used = [0], 0
    for index, length in enumerate(lengths.tolist()):
        if used and used + length > max_seq_length:
            bounds.append(index)
            used = 0
        used += length
    return np.asarray([*bounds, len(lengths)], dtype=np.int64)


def _pack_chunk(table: pa.Table, local_bounds: np.ndarray) -> pa.RecordBatch:
    """Packed rows of a contiguous range of samples (``table``), by re-slicing the flat Arrow buffers: no Python
    loop over tokens. The first label of each document becomes -100 (it would be predicted from the previous one)."""
    ids = table.column("input_ids").combine_chunks()
    labels = table.column("labels").combine_chunks()
    offsets = ids.offsets.to_numpy() - ids.offsets[0].as_py()
    flat_labels = labels.flatten().to_numpy().copy()
    flat_labels[offsets[:-1][np.diff(offsets) > 0]] = IGNORE_INDEX
    row_offsets = pa.array(offsets[local_bounds].astype(np.int32))
    lengths = pa.array(np.diff(offsets).astype(np.int32))
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(row_offsets, ids.flatten()),
            pa.ListArray.from_arrays(row_offsets, pa.array(flat_labels)),
            pa.ListArray.from_arrays(pa.array(local_bounds.astype(np.int32)), lengths),
        ],
        names=["input_ids", "labels", "seq_lens"],
    )


def pack_dataset(
    dataset: datasets.Dataset, max_seq_length: int, folder: Path, rows_per_chunk: int = 20_000
) -> datasets.Dataset:
    """Pack a tokenized data set into rows of at most ``max_seq_length`` tokens, chunk by chunk (bounded memory),
    into an Arrow file in ``folder``; rows carry ``seq_lens`` (document lengths) for restarting position ids."""
    lengths = np.asarray(dataset.with_format("arrow")["input_ids"].combine_chunks().value_lengths(), dtype=np.int64)
    bounds = greedy_row_bounds(lengths, max_seq_length)
    schema = pa.schema(
        [("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())), ("seq_lens", pa.list_(pa.int32()))]
    )
    path = folder / "packed.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for first in range(0, len(bounds) - 1, rows_per_chunk):
            chunk = bounds[first : first + rows_per_chunk + 1]
            table = dataset.with_format("arrow")[int(chunk[0]) : int(chunk[-1])]
            writer.write_batch(_pack_chunk(table.select(["input_ids", "labels"]), chunk - chunk[0]))
    return datasets.Dataset.from_file(str(path))


def build_or_load(
    cache_dir: Path, key: str, build: Callable[[Path], dict[str, datasets.Dataset]]
) -> dict[str, datasets.Dataset]:
    """The cached splits under ``cache_dir/key``, built by the first process to take the lock (see the docstring).
    ``build(staging)`` returns the splits, written into ``staging`` where it can (``tokenize_dataset``'s
    ``cache_file``, packing, ``flatten_indices``) and never with an indices mapping over files in ``staging``."""
    target = Path(cache_dir).expanduser().resolve() / key
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "done.json").exists():
            rank_zero_info(f"Tokenizing the data into the cache {target} (once per node; later runs reuse it).")
            with atomic_directory(target) as staging:
                splits = build(staging)
                entries = {name: keep_split(split, staging, name) for name, split in splits.items()}
                kept = {file for entry in entries.values() for file in entry["files"]}
                for stray in staging.glob("*.arrow"):  # intermediates: the tokenized rows that packing read
                    if stray.name not in kept:
                        stray.unlink()
                (staging / "done.json").write_text(json.dumps(entries))
        else:
            rank_zero_info(f"Using the tokenized data cached in {target}.")
    entries = json.loads((target / "done.json").read_text())
    return {name: load_split(target, name, entry) for name, entry in entries.items()}


def keep_split(split: datasets.Dataset, staging: Path, name: str) -> dict[str, Any]:
    """Keep a split in the cache entry: the Arrow files backing it when they are all in ``staging`` (as written by
    ``map``, packing or ``flatten_indices``), listed by name; otherwise (files elsewhere, or in memory) a copy in
    ``staging/name`` with ``save_to_disk``. Returns its ``done.json`` entry."""
    files = [Path(cache["filename"]).resolve() for cache in split.cache_files]
    own = bool(files) and all(file.parent == staging.resolve() for file in files)
    if own and split.num_rows == split.data.num_rows:  # the second test: no indices mapping over the files
        return {"rows": split.num_rows, "files": [file.name for file in files]}
    split.save_to_disk(str(staging / name))
    return {"rows": split.num_rows, "files": []}


def load_split(folder: Path, name: str, entry: dict[str, Any]) -> datasets.Dataset:
    """A split of a cache entry, memory-mapped (``keep_split`` wrote it)."""
    if not entry["files"]:
        return datasets.load_from_disk(str(folder / name))
    parts = [datasets.Dataset.from_file(str(folder / file)) for file in entry["files"]]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_records_dataset(source: DataSource, cache_dir: Path) -> tuple[datasets.Dataset, str]:
    """The source's rows (columns renamed, capped) and a label for messages."""
    dataset, label = load_source(source.path, source.split, source.subset, cache_dir / "hf")
    dataset = rename_columns(dataset, source.columns, label)
    if source.max_samples is not None:
        dataset = dataset.select(range(min(source.max_samples, len(dataset))))
    return dataset, label


def check_sources(sources: Sequence[DataSource]) -> list[str]:
    """Problems of a list of sources (for the data module's single error message)."""
    problems = []
    for index, source in enumerate(sources):
        if source.format != "auto" and canonical(source.format) not in TRAIN_FIELDS:
            problems.append(f"sources[{index}].format={source.format!r} is unknown.")
        if not source.weight > 0:
            problems.append(f"sources[{index}].weight={source.weight} must be > 0.")
        if source.max_samples is not None and source.max_samples < 1:
            problems.append(f"sources[{index}].max_samples={source.max_samples} must be >= 1 (or null for all).")
    return problems


def mix(
    parts: Sequence[datasets.Dataset], weights: Sequence[float], seed: int, strategy: str = "interleave_over"
) -> datasets.Dataset:
    """Tokenized sets as one (``sources.MIX_STRATEGIES``): interleaved with probabilities proportional to ``weights``
    (``datasets.interleave_datasets``) until every set, or the first, is drawn completely; or concatenated."""
    if len(parts) == 1:
        return parts[0]
    if strategy == "concat":
        return datasets.concatenate_datasets(list(parts))
    total = sum(weights)
    stopping = "first_exhausted" if strategy == "interleave_under" else "all_exhausted"
    return datasets.interleave_datasets(
        list(parts), probabilities=[w / total for w in weights], seed=seed, stopping_strategy=stopping
    )


def split_indices(num_records: int, val_split: float, seed: int) -> tuple[list[int], list[int]]:
    """Training and validation row indices: a seeded permutation, as before the ``datasets`` pipeline."""
    order = list(range(num_records))
    random.Random(seed).shuffle(order)
    num_val = max(1, round(num_records * val_split))
    if num_val >= num_records:
        raise GymUserError(f"val_split={val_split} leaves no training record out of {num_records}; lower it.")
    return sorted(order[num_val:]), sorted(order[:num_val])


def records_to_dataset(records: Sequence[Record]) -> datasets.Dataset:
    """A ``Dataset`` of in-memory records (bundled data)."""
    return datasets.Dataset.from_list([record.data for record in records])


def stream_dataset(
    source: DataSource, tokenizer: PreTrainedTokenizerBase, settings: Settings, cache_dir: Path
) -> datasets.IterableDataset:
    """A source read and tokenized on the fly (``streaming: true``): nothing is cached, rows come in file order."""
    rows, label = load_source(source.path, source.split, source.subset, cache_dir / "hf", streaming=True)
    rows = rename_columns(rows, source.columns, label)
    if source.max_samples is not None:
        rows = rows.take(source.max_samples)
    first = next(iter(rows), None)
    if first is None:
        raise GymUserError(f"The data set {label} is empty: it holds no records.")
    format = canonical(source.format) if source.format != "auto" else detect_format(Record(first, f"{label} record 1"))
    tokenize = Tokenize(format, tokenizer, settings.max_seq_length, settings.mask_prompt, False, label, arrow=False)
    return rows.map(tokenize, batched=True, batch_size=1000, with_indices=True, remove_columns=list(first))
