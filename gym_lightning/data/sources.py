"""Reading records (one JSON object each) from JSONL, JSON and plain-text files given as paths or glob patterns.

- ``.jsonl``: one JSON object per line; blank lines are skipped.
- ``.json``: a list of JSON objects.
- ``.txt``: one record ``{"text": ...}`` per paragraph, paragraphs being separated by one or more blank lines.
  Paragraphs (rather than whole files) keep documents near the sequence length of a finetuning run; join the file
  into a single paragraph if it must stay one document.

Every record remembers where it came from (``file:line``) so that later errors can name it.
"""

from __future__ import annotations

import codecs
import glob
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import datasets

from gym_lightning.errors import GymUserError

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".txt", ".csv", ".parquet", ".arrow")
# The ``datasets`` builder of each suffix (``text`` reads one record per paragraph, as ``_read_text`` does).
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
# How several training sets become one (LLaMA-Factory's mix_strategy names): ``interleave_over`` draws from each set in
# proportion to its weight until every set is drawn completely (smaller shares repeat), ``interleave_under`` until the
# first set runs out, ``concat`` puts them one after the other (each record once; the sampler shuffles every epoch).
MixStrategy = Literal["interleave_over", "interleave_under", "concat"]
MIX_STRATEGIES: tuple[str, ...] = get_args(MixStrategy)


@dataclass(frozen=True)
class Record:
    """One training example: its fields and its origin (``file:line``) for error messages."""

    data: dict[str, Any] = field(hash=False)
    origin: str


def expand_paths(patterns: str | Iterable[str]) -> list[Path]:
    """Resolve paths and glob patterns (``**`` allowed) to a sorted, de-duplicated list of files, in pattern order.

    Raises:
        ValueError: A pattern matches nothing, or a file has an unsupported suffix.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(pattern), recursive=True)) if glob.has_magic(str(pattern)) else [str(pattern)]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise GymUserError(f"No data file matches {pattern!r} (working directory: {Path.cwd()}); check the path.")
        files += [Path(m) for m in matches if Path(m) not in files]
    for path in files:
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise GymUserError(
                f"Unsupported data file {str(path)!r}: expected one of {', '.join(SUPPORTED_SUFFIXES)} "
                "(JSON lines, a JSON list of objects, or plain text)."
            )
    return files


def read_records(patterns: str | Iterable[str]) -> list[Record]:
    """Read every record of the files matched by ``patterns``.

    Raises:
        ValueError: A pattern matches nothing, a file is malformed (the message names file and line), or there are
            no records at all.
    """
    records: list[Record] = []
    for path in expand_paths(patterns):
        reader = {".jsonl": _read_jsonl, ".json": _read_json, ".txt": _read_text}.get(path.suffix, _read_table)
        try:
            records += reader(path)
        except UnicodeDecodeError as err:
            raise _not_utf8(path) from err
    if not records:
        raise GymUserError(f"The data set {patterns!r} is empty: its files hold no records.")
    return records


def _not_utf8(path: Path) -> GymUserError:
    """The error for a file that is not UTF-8, with the line and byte where it stops being UTF-8 (the decoder's own
    error counts from the start of a read buffer, not of the file)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
        where = ""
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        where = f":{line} (byte 0x{data[err.start]:02x} at offset {err.start})"
    return GymUserError(
        f"{path}{where}: the file is not UTF-8 text. Data files must be UTF-8; convert it, e.g. "
        f"`iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}` (latin1 being the encoding it was written in)."
    )


TEXT_BUILDERS = ("json", "csv", "text")


def raise_unless_utf8(path: Path) -> None:
    """Refuse a text file that is not UTF-8 before ``datasets`` reads it: pyarrow's JSON/CSV readers accept invalid
    bytes into string columns, and the failure comes later, mid-tokenization, as a bare ``UnicodeDecodeError`` with
    neither file nor line. Decoding is incremental, 16 MiB at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as file:
            while chunk := file.read(1 << 24):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise _not_utf8(path) from err


def _check_object(value: Any, origin: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GymUserError(f'{origin}: expected a JSON object (e.g. {{"text": ...}}), got {type(value).__name__}.')
    return value


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            origin = f"{path}:{number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise GymUserError(
                    f"{origin}: invalid JSON ({error.msg}, column {error.colno}). Each line of a .jsonl file must be "
                    "one complete JSON object."
                ) from None
            records.append(Record(_check_object(value, origin), origin))
    return records


def _read_json(path: Path) -> list[Record]:
    text = path.read_text(encoding="utf-8")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise GymUserError(
            f"{path}:{error.lineno}: invalid JSON ({error.msg}, column {error.colno}). A .json data file must hold "
            "a list of JSON objects."
        ) from None
    if not isinstance(value, list):
        raise GymUserError(f"{path}: a .json data file must hold a list of JSON objects, got {type(value).__name__}.")
    # json does not report element positions; the index is the next best way to point at a record.
    return [Record(_check_object(item, f"{path}[{index}]"), f"{path}[{index}]") for index, item in enumerate(value)]


def _read_table(path: Path) -> list[Record]:
    """Rows of a CSV, Parquet or Arrow file (through its ``datasets`` builder)."""
    rows = datasets.load_dataset(BUILDERS[path.suffix], data_files=[str(path)], split="train")
    return [Record(row, f"{path} record {index + 1}") for index, row in enumerate(rows)]


def _read_text(path: Path) -> list[Record]:
    text = path.read_text(encoding="utf-8")
    records = []
    for match in re.finditer(r"\S(?:.|\n(?![ \t]*\n))*", text):
        line = text.count("\n", 0, match.start()) + 1
        records.append(Record({"text": match.group().rstrip()}, f"{path}:{line}"))
    return records


def _is_files(path: str | Iterable[str]) -> bool:
    """Whether ``path`` names files (an existing path, a glob, or several) rather than a Hub data set."""
    if not isinstance(path, str):
        return True
    return glob.has_magic(path) or Path(path).exists() or Path(path).suffix in SUPPORTED_SUFFIXES


def source_fingerprint(path: str | list[str], split: str, subset: str | None) -> list[Any]:
    """What identifies a source's content: each file's path, size and mtime, or a Hub name, split and subset."""
    if not _is_files(path):
        return [path, split, subset]
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in expand_paths(path)]


def load_source(
    path: str | list[str], split: str, subset: str | None, cache_dir: Path, streaming: bool = False
) -> tuple[datasets.Dataset | datasets.IterableDataset, str]:
    """Load files (through ``datasets.load_dataset``'s builder for their suffix) or a Hub data set; with a label.

    Raises:
        GymUserError: no file matches, suffixes are mixed or unsupported, a file is malformed (for JSON/JSONL the
            message names file and line), or a Hub data set cannot be fetched (offline, typo, gated).
    """
    if not _is_files(path):
        return _load_hub(path, split, subset, cache_dir, streaming), path
    files = expand_paths(path)
    builders = {BUILDERS[f.suffix] for f in files}
    label = str(files[0]) if len(files) == 1 else f"{files[0]} (+{len(files) - 1} files)"
    if len(builders) > 1:
        raise GymUserError(
            f"{label}: one data set must be files of one kind, got {sorted(builders)}; use one source each."
        )
    (builder,) = builders
    if builder in TEXT_BUILDERS and not streaming:
        for file in files:
            raise_unless_utf8(file)
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        dataset = datasets.load_dataset(
            builder,
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=str(cache_dir),
            streaming=streaming,
            **options,
        )
    except Exception as error:  # the builders raise many kinds (DatasetGenerationError, ArrowInvalid, ...)
        if builder == "json":
            read_records(files)  # raises the precise file:line error for malformed JSON
        raise GymUserError(f"{label}: could not read the data ({type(error).__name__}: {error}).") from error
    if builder == "csv" and dataset.column_names:  # CSV cells are text: undo the builder's guess that "12" is an int
        dataset = dataset.cast(datasets.Features({name: datasets.Value("string") for name in dataset.column_names}))
    if builder == "text":  # paragraphs keep their trailing newline in the builder; the former reader stripped it
        dataset = dataset.map(lambda row: {"text": row["text"].strip()}).filter(lambda row: bool(row["text"]))
    return dataset, label


def _load_hub(
    name: str, split: str, subset: str | None, cache_dir: Path, streaming: bool
) -> datasets.Dataset | datasets.IterableDataset:
    try:
        return datasets.load_dataset(name, subset, split=split, cache_dir=str(cache_dir), streaming=streaming)
    except Exception as error:  # ConnectionError, DatasetNotFoundError, FileNotFoundError, ... by hub state
        raise GymUserError(
            f"The data set {name!r} is not a local file and could not be fetched from the Hugging Face Hub (no "
            f"network, a typo, or a gated repository: {type(error).__name__}). Pass local files or globs (.jsonl, "
            ".json, .csv, .parquet, .txt, .arrow), or run where the Hub is reachable (or the data set is cached)."
        ) from error
