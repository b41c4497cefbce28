"""Where ``gym train``'s training and validation data come from, as ``gym fit``'s data settings.

Three front doors name the training data, one at a time:

- HF's ``--train_file`` (files or globs, ``data.train_files``) and ``--validation_file`` (``data.val_files``).
- TRL's ``--dataset_name``: a local file or glob, a local folder (its files split by name as ``datasets`` splits a
  folder: ``train*.jsonl``, ``test*.jsonl``, ...; no split names: all files are ``train``) or a Hub data set (read
  through the data module's Hub path, ``data.sources`` with ``--dataset_config`` as its subset and
  ``--dataset_train_split`` as its split). With evaluation on, ``--dataset_test_split`` of a folder is the
  validation data; a file has no test split and the data module reads validation data from files only, so there
  (and for a Hub set) ``--validation_file`` or a validation fraction is asked for. With evaluation off it is not
  read, as in TRL.
- ``--dataset``: a bundled set (``addition``), or LLaMA-Factory's ``dataset``: a comma list of data files or folders,
  or of names in ``<dataset_dir>/dataset_info.json`` (its ``file_name``/``hf_hub_url``, ``formatting``, ``columns``
  and ``tags``; ``dataset_dir: ONLINE`` makes every name a Hub data set).

One list of local files with one format becomes ``data.train_files`` (concatenated, as LLaMA-Factory's default
``mix_strategy: concat``); anything else (a Hub set, a subset or split, ``--max_samples``, sets of different formats,
an interleave mix) ``data.sources`` with ``data.mix``, LLaMA-Factory's ``mix_strategy`` (``interleave_probs`` the
weights). A validation fraction (``--validation_split_percentage``, LLaMA-Factory's ``val_size``, TRL's
``test_split_size``) is ``data.val_split``. A stage that reads raw text (``pt``) reads a ``dataset_info.json`` entry's
``prompt`` column as the text, as LLaMA-Factory's ``stage: pt`` does (``c4_demo``); its ranking entries (``ranking:
true``, chosen/rejected columns) are ``preference`` records and its ``kto_tag`` entries ``kto`` records, read by the
preference stages (``kto`` unpairs a ranking entry's pairs, as TRL's KTO does).
"""

from __future__ import annotations

import argparse
import glob
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gym_lightning.commands.train.llama_factory import interleave_weights, mix_problems
from gym_lightning.commands.train.stages import resolved_data
from gym_lightning.data.sources import SUPPORTED_SUFFIXES
from gym_lightning.data.synthetic import BUNDLED_DATASETS

DATASET_INFO = "dataset_info.json"
# LLaMA-Factory's alpaca columns (dataset_info.json "columns") -> gym_lightning's alpaca fields.
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}
ALPACA_COLUMNS |= {"history": "history"}
# Its sharegpt/openai columns -> the fields of gym_lightning's sharegpt (``conversations``) or messages format.
CHAT_COLUMNS = {"system": "system", "tools": "tools"}
# Its preference columns: a ranking entry's answers, a kto_tag entry's desirable flag (gym_lightning's label).
RANKING_COLUMNS = {"chosen": "chosen", "rejected": "rejected"}
KTO_COLUMNS = {"kto_tag": "label"}
# What its ranking/kto_tag entries are (the preference formats of gym_lightning.data.preference) and who reads them.
ENTRY_KINDS = {"preference": "ranking: true", "kto": "a kto_tag column"}
PREFERENCE_STAGES = "--stage dpo, orpo or simpo (ranking entries) or kto"
# The turn keys and role names gym_lightning's chat formats read: sharegpt from/value, messages role/content.
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
# dataset_info.json keys gym_lightning reads; the others are refused when set (e.g. ms_hub_url, folder).
INFO_KEYS = frozenset(["file_name", "hf_hub_url", "formatting", "columns", "tags", "subset", "split", "ranking"])
# The flags that name the training data -> their argument names.
TRAIN_DATA_FLAGS = {"--dataset": "dataset", "--train_file": "train_file", "--dataset_name": "dataset_name"}
TRAIN_DATA_FLAGS |= {"--datasets": "datasets"}


@dataclass(frozen=True)
class Source:
    """One training data set as the data module reads it (``data.sources`` entry)."""

    path: str | list[str]
    format: str = "auto"
    columns: dict[str, str] | None = None
    split: str = "train"
    subset: str | None = None
    hub: bool = False

    def entry(self, max_samples: int | None) -> dict[str, Any]:
        """The ``data.sources`` entry (settings at their default left out)."""
        entry = {"path": self.path, "format": self.format, "columns": self.columns, "split": self.split}
        entry |= {"subset": self.subset, "max_samples": max_samples}
        defaults = {"format": "auto", "columns": None, "split": "train", "subset": None, "max_samples": None}
        return {key: value for key, value in entry.items() if key not in defaults or value != defaults[key]}


@dataclass
class DataPlan:
    """The ``data.*`` settings of the training/validation data, the problems in the way and info lines."""

    values: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_data(args: argparse.Namespace, eval_on: bool) -> DataPlan:
    """The data settings of the parsed ``gym train`` flags (``eval_on``: validation runs)."""
    plan = DataPlan()
    given = [flag for flag, name in TRAIN_DATA_FLAGS.items() if getattr(args, name)]
    if len(given) > 1:
        plan.problems.append(f"{' and '.join(given)} each choose the training data; pass one.")
        return plan
    if not given:
        plan.problems.append(
            "no training data: pass --train_file data.jsonl, --dataset_name (a file, folder or Hub data set) or "
            "--dataset (addition, or LLaMA-Factory's data files/names)."
        )
        return plan
    fraction = _val_fraction(args, plan)
    val_files = list(_as_list(args.validation_file)) or None
    if args.dataset in BUNDLED_DATASETS:
        plan.values |= {"data.dataset": args.dataset, "data.train_files": None}
        if (wanted := _stage_format(args)) in ENTRY_KINDS:
            plan.problems.append(f"--dataset {args.dataset} holds SFT records; the stage reads {wanted} records.")
        if fraction:
            plan.problems.append("a validation fraction splits training files; the bundled data set has its own.")
    else:
        need_test = eval_on and not (val_files or fraction or args.eval_dataset)
        sources, test_files = _training_sources(args, plan, need_test)
        val_files = val_files or test_files or None
        _add_sources(sources, args, plan)
    val_files = _eval_dataset(args, plan, val_files)
    if val_files and fraction:
        plan.problems.append("validation files and a validation fraction both choose the validation data; pass one.")
    plan.values |= {"data.val_files": val_files, "data.val_split": fraction or 0.0}
    return plan


def _as_list(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _val_fraction(args: argparse.Namespace, plan: DataPlan) -> float | None:
    """The fraction of the training records held out: HF's percentage, LLaMA-Factory's ``val_size`` or TRL's
    ``test_split_size`` (both a fraction, or a count the data module cannot hold out before it reads the data)."""
    percent = args.validation_split_percentage or 0
    given = {"--validation_split_percentage": (percent, percent / 100)}
    given |= {"--val_size": (args.val_size, args.val_size), "--test_split_size": (args.test_split_size,) * 2}
    given = {flag: pair for flag, pair in given.items() if pair[0]}
    if len(given) > 1:
        plan.problems.append(f"{' and '.join(given)} each set the validation fraction; pass one.")
    for flag, (shown, fraction) in given.items():
        if not 0 < fraction < 1:
            plan.problems.append(f"{flag} {shown:g}: give a fraction of the training records in (0, 1), not a count.")
            return None
    return next((fraction for _, fraction in given.values()), None)


def _training_sources(args: argparse.Namespace, plan: DataPlan, need_test: bool) -> tuple[list[Source], list[str]]:
    """The training sources of ``--train_file``, ``--dataset_name`` or LLaMA-Factory's ``--dataset``, and the test
    split's files of a ``--dataset_name`` folder when validation needs them."""
    if args.train_file:
        return [Source(_as_list(args.train_file))], []
    if args.dataset_name:
        return _trl_sources(args, plan, need_test)
    if args.datasets:
        plan.problems.append(
            "--datasets (TRL's mixture) is not read: pass one set with --dataset_name, or mix sets with gym fit's "
            "data.sources (path, split, subset, weight)."
        )
        return [], []
    return _lf_sources(args.dataset, args.dataset_dir, plan, "--dataset", _stage_format(args)), []


def _stage_format(args: argparse.Namespace) -> str:
    """The record format the stage reads (``text`` for pt: a dataset_info.json entry's prompt column is the text;
    ``preference``/``kto`` for the preference stages; ``auto`` for sft)."""
    return str(resolved_data(args)["format"])


def _is_local(path: str) -> bool:
    return glob.has_magic(path) or Path(path).exists() or Path(path).suffix in SUPPORTED_SUFFIXES


def _trl_sources(args: argparse.Namespace, plan: DataPlan, need_test: bool) -> tuple[list[Source], list[str]]:
    """TRL's ``load_dataset(dataset_name, name=dataset_config)[dataset_train_split]`` as a source."""
    name, train, test = args.dataset_name, args.dataset_train_split, args.dataset_test_split
    if not _is_local(name):
        if need_test:
            plan.problems.append(
                f"--dataset_test_split {test}: gym_lightning reads validation data from files; pass "
                "--validation_file, a validation fraction (--validation_split_percentage) or --eval_strategy no."
            )
        return [Source(name, split=train, subset=args.dataset_config, hub=True)], []
    if args.dataset_config:
        plan.problems.append(f"--dataset_config names a subset of a Hub data set; {name} is local: drop it.")
    if not glob.has_magic(name) and not Path(name).exists():
        plan.problems.append(f"--dataset_name {name}: no such file or folder (working directory: {Path.cwd()}).")
        return [], []
    if not Path(name).is_dir():
        if train != "train":
            plan.problems.append(f"--dataset_train_split {train}: a data file holds one split, train; drop it.")
        if need_test:
            plan.problems.append(
                f"--dataset_name {name} is one file, without a {test} split for evaluation: pass --validation_file, a "
                "validation fraction (--validation_split_percentage), a folder with test files or --eval_strategy no."
            )
        return [Source(name)], []
    splits = folder_splits(name)
    for wanted in [train, test] if need_test else [train]:
        if wanted not in splits:
            plan.problems.append(
                f"--dataset_name {name}: no {wanted} split among its data files (splits found: "
                f"{', '.join(splits) or 'none'}); name the files {wanted}*.jsonl (or .json, .csv, .parquet, ...)."
            )
    if not need_test and test != "test":
        plan.notes.append(f"--dataset_test_split {test} is not read: evaluation is off (as in TRL).")
    return ([Source(splits[train])] if train in splits else []), splits.get(test, []) if need_test else []


def folder_splits(folder: str) -> dict[str, list[str]]:
    """The data files of a local folder by split, as ``datasets.load_dataset(folder)`` splits them (by name: train,
    test/eval, validation; no split names: every file is train), with the suffixes the data module reads."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        patterns = get_data_patterns(str(Path(folder).resolve()))
    except EmptyDatasetError:  # no data file at all: the caller names the split it lacks
        return {}
    found = DataFilesDict.from_patterns(patterns, base_path=str(Path(folder).resolve()))
    splits = {str(split): [f for f in files if Path(f).suffix in SUPPORTED_SUFFIXES] for split, files in found.items()}
    return {split: sorted(files) for split, files in splits.items() if files}


def _lf_sources(names: str, dataset_dir: str, plan: DataPlan, flag: str, wanted: str = "auto") -> list[Source]:
    """LLaMA-Factory's comma list of data sets: paths, or names of ``<dataset_dir>/dataset_info.json``."""
    info = _dataset_info(dataset_dir, plan)
    sources = []
    for name in [part.strip() for part in str(names).split(",") if part.strip()]:
        if dataset_dir == "ONLINE":
            sources.append(Source(name, hub=True))
        elif info is not None and name in info:
            sources += _info_source(name, info[name], dataset_dir, plan, wanted)
        elif glob.has_magic(name) or Path(name).exists():
            sources.append(Source(_folder_files(name) or name))
        else:
            bundled = ", ".join(BUNDLED_DATASETS)
            plan.problems.append(
                f"{flag} {name}: not a bundled data set ({bundled}), a data file or folder, or a name in "
                f"{Path(dataset_dir) / DATASET_INFO}; give the data file's path (or set --dataset_dir)."
            )
    return sources


def _folder_files(path: str) -> list[str] | None:
    """The data files directly in a folder (LLaMA-Factory reads a folder's files as one set); ``None`` for a file."""
    if not Path(path).is_dir():
        return None
    return sorted(str(f) for f in Path(path).iterdir() if f.is_file() and f.suffix in SUPPORTED_SUFFIXES) or [path]


def _dataset_info(dataset_dir: str, plan: DataPlan) -> dict[str, Any] | None:
    path = Path(dataset_dir) / DATASET_INFO
    if dataset_dir == "ONLINE" or not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        plan.problems.append(f"{path}: not readable JSON ({err}); fix the file.")
        return None
    return info if isinstance(info, dict) else None


def _info_source(name: str, entry: dict[str, Any], dataset_dir: str, plan: DataPlan, wanted: str) -> list[Source]:
    """A dataset_info.json entry as a source: its file (under ``dataset_dir``) or Hub set, format and columns, for a
    stage that reads ``wanted`` records (``text``: raw text, the entry's prompt column)."""
    where = f"{Path(dataset_dir) / DATASET_INFO} {name}"
    if unread := sorted(key for key, value in entry.items() if key not in INFO_KEYS and value not in (None, False)):
        plan.problems.append(f"{where}: {', '.join(unread)} not read by gym_lightning (files or Hub sets).")
        return []
    format, columns, problem = _text_format(entry) if wanted == "text" else _info_format(entry)
    problem = _kind_problem(entry, wanted) or problem
    if format == "preference" and wanted == "kto":  # its pairs become a desirable and an undesirable example (TRL)
        format = "kto"
    if problem:
        plan.problems.append(f"{where}: {problem}")
        return []
    if "hf_hub_url" in entry:
        source = Source(entry["hf_hub_url"], split=entry.get("split") or "train", subset=entry.get("subset"), hub=True)
    elif "file_name" in entry:
        path = str(Path(dataset_dir) / entry["file_name"])
        source = Source(_folder_files(path) or path)
    else:
        plan.problems.append(f"{where}: has neither file_name nor hf_hub_url.")
        return []
    return [replace(source, format=format, columns=columns or None)]


def _text_format(entry: dict[str, Any]) -> tuple[str, dict[str, str], str | None]:
    """``(text, columns, problem)`` of an entry read as raw text: LLaMA-Factory's ``stage: pt`` trains on an alpaca
    entry's prompt column (``c4_demo``: ``columns: {prompt: text}``); other columns would be joined to it there."""
    formatting, columns = entry.get("formatting", "alpaca"), entry.get("columns") or {}
    if formatting != "alpaca" or set(columns) - {"prompt"}:
        shown = {"formatting": formatting, "columns": columns}
        return "text", {}, f"{shown}: raw text is one column here (alpaca formatting, columns: {{prompt: COLUMN}})."
    column = columns.get("prompt", "instruction")
    return "text", ({"text": column} if column != "text" else {}), None


def _entry_kind(entry: dict[str, Any]) -> str | None:
    """``preference`` for a ranking entry, ``kto`` for one with a kto_tag column, ``None`` for SFT data."""
    if entry.get("ranking"):
        return "preference"
    return "kto" if "kto_tag" in (entry.get("columns") or {}) else None


def _kind_problem(entry: dict[str, Any], wanted: str) -> str | None:
    """Why an entry's records are not what the stage reads (``wanted``: its record format); ``None`` if they are."""
    kind = _entry_kind(entry)
    if entry.get("ranking") and "kto_tag" in (entry.get("columns") or {}):
        return "both ranking: true and a kto_tag column; keep the one its records are."
    if kind is not None and wanted not in ENTRY_KINDS:
        return f"preference data ({ENTRY_KINDS[kind]}): train it with {PREFERENCE_STAGES}."
    if kind is None and wanted in ENTRY_KINDS:
        return f"SFT data (neither ranking: true nor a kto_tag column): the stage reads {wanted} records."
    if kind == "kto" and wanted == "preference":
        return "unpaired feedback (a kto_tag column): train it with --stage kto, or give it as ranking pairs."
    return None


def _info_format(entry: dict[str, Any]) -> tuple[str, dict[str, str], str | None]:
    """``(format, columns, problem)`` of an entry's ``formatting``, ``columns``, ``tags`` and ``ranking``."""
    formatting, columns, tags = entry.get("formatting", "alpaca"), entry.get("columns") or {}, entry.get("tags") or {}
    kind = _entry_kind(entry)
    extra = RANKING_COLUMNS if kind == "preference" else KTO_COLUMNS if kind == "kto" else {}
    if formatting == "alpaca":
        known = {key: name for key, name in ALPACA_COLUMNS.items() if not (kind == "preference" and key == "response")}
        known |= extra
        unread = sorted(set(columns) - set(known))
        mapped = {known[key]: value for key, value in columns.items() if key in known}
        problem = f"columns {', '.join(unread)} are not alpaca columns gym_lightning reads" if unread else None
        return kind or "alpaca", {k: v for k, v in mapped.items() if k != v}, problem
    if formatting not in ("sharegpt", "openai"):
        return "auto", {}, f"formatting {formatting!r}: gym_lightning reads alpaca, sharegpt and openai."
    defaults = OPENAI_TAGS if formatting == "openai" else SHAREGPT_TAGS
    tags = {key: tags.get(key, value) for key, value in defaults.items()}
    format = "messages" if tags == OPENAI_TAGS else "sharegpt" if tags == SHAREGPT_TAGS else None
    if format is None:
        return "auto", {}, f"tags {tags}: gym_lightning reads turns as from/value (human/gpt) or role/content."
    known = CHAT_COLUMNS | extra
    unread = sorted(set(columns) - {"messages", *known})
    mapped = {"conversations" if format == "sharegpt" else "messages": columns.get("messages", "conversations")}
    mapped |= {known[key]: value for key, value in columns.items() if key in known}
    problem = f"columns {', '.join(unread)} are not chat columns gym_lightning reads" if unread else None
    return kind or format, {k: v for k, v in mapped.items() if k != v}, problem


def _add_sources(sources: list[Source], args: argparse.Namespace, plan: DataPlan) -> None:
    """``data.train_files`` for local files of one format (their concatenation), else ``data.sources``."""
    if not sources:
        return
    # PEFT's script renders each chat with the template into its --dataset_text_field ("content") itself: there the
    # field names no column of the data, and the chats are rendered here as every chat is.
    rendered = str(getattr(args, "chat_template_format", "none")).lower() != "none"
    text = {"text": args.dataset_text_field} if args.dataset_text_field != "text" and not rendered else None
    data_format = resolved_data(args)["format"]
    default = "text" if text and data_format == "auto" else data_format
    sources = [
        replace(s, format=default if s.format == "auto" else s.format, columns=s.columns or text) for s in sources
    ]
    kinds = {(s.format, json.dumps(s.columns, sort_keys=True)) for s in sources}
    plain = all(not s.hub and s.split == "train" and s.subset is None for s in sources)
    # LLaMA-Factory's mix of its data sets: concat (its default) is the files' concatenation, as data.train_files.
    mixed = len(sources) > 1
    problems = mix_problems(args, len(sources)) if mixed else []
    plan.problems += problems
    if plain and len(kinds) == 1 and args.max_samples is None and not (mixed and args.mix_strategy != "concat"):
        files = [path for s in sources for path in _as_list(s.path)]
        plan.values |= {"data.train_files": files, "data.format": sources[0].format, "data.columns": sources[0].columns}
        return
    entries = [s.entry(args.max_samples) for s in sources]
    if mixed and not problems and args.interleave_probs is not None:
        weights = interleave_weights(args.interleave_probs)  # one per set: mix_problems checked
        entries = [entry | {"weight": weight} for entry, weight in zip(entries, weights, strict=True)]
    if mixed:
        plan.values["data.mix"] = args.mix_strategy
    plan.values |= {"data.train_files": None, "data.sources": entries}
    plan.values |= {"data.format": default, "data.columns": text}


def _eval_dataset(args: argparse.Namespace, plan: DataPlan, val_files: list[str] | None) -> list[str] | None:
    """LLaMA-Factory's ``eval_dataset`` (paths or dataset_info.json names of files) as validation files."""
    if not args.eval_dataset:
        return val_files
    if val_files:
        plan.problems.append("--eval_dataset and --validation_file both choose the validation data; pass one.")
    sources = _lf_sources(args.eval_dataset, args.dataset_dir, plan, "--eval_dataset", _stage_format(args))
    if any(s.hub for s in sources):
        plan.problems.append("--eval_dataset: gym_lightning reads validation data from files, not the Hub.")
    return [path for s in sources if not s.hub for path in _as_list(s.path)] or None


__all__ = ["DataPlan", "Source", "folder_splits", "plan_data"]
