"""Preference batches, which batches a data set gives (``batch_kind``) against what an objective reads, and the
data module's settings that each kind refuses.

Batch kinds: ``lm`` (``gym_lightning.data.collate``), ``pairs`` and ``unpaired``. The last two hold ``input_ids``,
``attention_mask``, ``labels`` (``-100`` on prompt tokens and padding) and ``position_ids``, all ``[2B, T]`` int64,
right-padded:

- ``pairs`` (format ``preference``): rows ``0..B-1`` prompt + chosen, rows ``B..2B-1`` prompt + rejected of the same
  examples in the same order (TRL's ``DataCollatorForPreference``: chosen and rejected in one forward);
- ``unpaired`` (format ``kto``): rows ``0..B-1`` prompt + completion, rows ``B..2B-1`` the mismatched KL rows (prompt
  i + the completion of example i's KL partner), and ``kto_labels`` ``[B]`` bool (true: desirable).

Optional ``reference_logps`` ``[2B]`` float32 in the same row order (``gym_lightning.data.reference``).

Rows are cut as TRL's collators cut them: prompt + answer to ``max_length`` tokens, keeping the start
(``keep_start``) or the end (``keep_end``; paired rows only, KTO keeps starts). KL partners are TRL's
(``KTOTrainer._prepare_dataset``): the data set in its stored order, in chunks of the training batch size, each example
taking the completion of the one before it in its chunk (the first takes the last's). TRL fixes them at preparation
with ``per_device_train_batch_size``; here they are found on load, so the prepared data does not depend on the batch
size, and an example keeps its partner whatever batch the shuffle puts it in (as in TRL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import Dataset

from gym_lightning.data.formats import FORMATS, canonical
from gym_lightning.data.preference import TRUNCATION_MODES
from gym_lightning.loss import IGNORE_INDEX

BATCH_KINDS = ("lm", "pairs", "unpaired")
KIND_OF_FORMAT = {"preference": "pairs", "kto": "unpaired"}  # every other format gives "lm" batches
KIND_DATA = {
    "lm": "SFT or pretraining records (formats text, alpaca, prompt_completion, messages, sharegpt)",
    "pairs": "paired preference records (data.format preference: prompt/chosen/rejected, or chosen/rejected alone)",
    "unpaired": "unpaired preference records (data.format kto: prompt/completion/label; it also unpairs "
    "chosen/rejected records)",
}
REFERENCE_KEY = "reference_logps"
KTO_LABELS_KEY = "kto_labels"


def kind_of_format(format: str) -> str:
    """The batches a (resolved) record format gives."""
    return KIND_OF_FORMAT.get(canonical(format), "lm")


def kind_of_columns(columns: Sequence[str]) -> str:
    """The batches a prepared split gives, from its columns (also right after a cache hit)."""
    if "chosen_ids" in columns:
        return "pairs"
    return "unpaired" if "completion_ids" in columns else "lm"


def batch_kind_problem(objective: str, reads: str, gives: str, objectives_for: Sequence[str] = ()) -> str | None:
    """One line saying that ``objective`` (which reads ``reads`` batches) cannot train on data that gives ``gives``
    batches, and what to change; ``None`` when they match. ``objectives_for``: names of objectives that read
    ``gives`` batches, offered as the other fix. A pure function, for the command line's check of the
    ``Objective.batch_kind`` against ``CausalLMDataModule.batch_kind`` before anything is built."""
    if reads == gives:
        return None
    unknown = [kind for kind in (reads, gives) if kind not in BATCH_KINDS]
    if unknown:
        return f"unknown batch kind(s) {unknown}; the kinds are {', '.join(BATCH_KINDS)}."
    other = f", or an objective for {gives!r} batches ({', '.join(objectives_for)})" if objectives_for else ""
    return (
        f"model.objective {objective!r} trains on {reads!r} batches, from {KIND_DATA[reads]}, but the data gives "
        f"{gives!r} batches, from {KIND_DATA[gives]}: give it {reads!r} data{other}."
    )


def settings_problems(args: dict) -> list[str]:
    """The data module's problems with the preference settings (``args``: its arguments), and with the formats it
    names (not ``auto``: those are checked once detected)."""
    problems = []
    if args["truncation_mode"] not in TRUNCATION_MODES:
        problems.append(f"truncation_mode={args['truncation_mode']!r} must be one of {', '.join(TRUNCATION_MODES)}.")
    limit = args["max_prompt_length"]
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        problems.append(f"max_prompt_length={limit!r} must be an integer >= 1 (or null for the whole prompt).")
    elif limit is not None and isinstance(args["max_seq_length"], int) and limit >= args["max_seq_length"]:
        problems.append(
            f"max_prompt_length={limit} leaves no room for an answer in max_seq_length={args['max_seq_length']}."
        )
    formats = [source.format for source in args["sources"] or []] or [args["format"]]
    if args["dataset"] is not None:
        formats = ["prompt_completion"]
    if "auto" not in formats and all(canonical(f) in FORMATS for f in formats):
        problems += kind_problems({kind_of_format(f) for f in formats}, args)
    return problems


def kind_problems(kinds: set[str], settings: dict) -> list[str]:
    """Problems of the settings (the data module's) for the batches that the data's formats give."""
    if len(kinds) > 1:
        return [
            f"the training data sets give different batches ({', '.join(sorted(kinds))}); one run trains one kind: "
            "use data sets of one kind (formats preference, kto, or the SFT formats)."
        ]
    kind = next(iter(kinds), "lm")
    if kind == "lm":
        given = [f"truncation_mode={settings['truncation_mode']}"] * (settings["truncation_mode"] != "keep_start")
        given += [f"max_prompt_length={settings['max_prompt_length']}"] * (settings["max_prompt_length"] is not None)
        return [f"{' and '.join(given)} apply to preference data (formats preference, kto); unset them."] * bool(given)
    clashes = [name for name in ("packing", "streaming") if settings[name]]
    clashes += [] if settings["mask_prompt"] else ["mask_prompt: false"]
    problems = [
        f"preference data ({kind} batches) does not work with {', '.join(clashes)}: its rows are batched whole, "
        "unpacked, from prepared data, and its prompts are never targets; unset them."
    ] * bool(clashes)
    if kind == "unpaired" and settings["truncation_mode"] == "keep_end":
        problems.append("truncation_mode=keep_end applies to paired data; KTO rows keep their start (as in TRL).")
    return problems


def cut_row(prompt: Sequence[int], answer: Sequence[int], max_length: int | None, mode: str) -> tuple[list[int], int]:
    """``prompt + answer`` cut to ``max_length`` tokens (``keep_start``/``keep_end``), and how many of its first
    tokens are prompt (TRL's collator cuts the completion mask the same way)."""
    ids = [*prompt, *answer]
    if max_length is None or len(ids) <= max_length:
        return ids, len(prompt)
    if mode == "keep_start":
        return ids[:max_length], min(len(prompt), max_length)
    cut = len(ids) - max_length
    return ids[cut:], max(0, len(prompt) - cut)


def rows_batch(rows: Sequence[tuple[list[int], int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The padded ``[len(rows), T]`` tensors of ``(ids, prompt tokens)`` rows: labels are the ids after the prompt."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (ids, prompt_tokens) in enumerate(rows):
        values = torch.tensor(ids, dtype=torch.long)
        input_ids[index, : len(ids)] = values
        labels[index, prompt_tokens : len(ids)] = values[prompt_tokens:]
        attention_mask[index, : len(ids)] = 1
        position_ids[index, : len(ids)] = torch.arange(len(ids))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "position_ids": position_ids}


def _with_reference(batch: dict[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Add ``reference_logps`` ``[2B]`` (first column of every row, then the second) when the rows carry them."""
    if REFERENCE_KEY in rows[0]:
        values = np.asarray([row[REFERENCE_KEY] for row in rows], dtype=np.float32)  # [B, 2]
        batch[REFERENCE_KEY] = torch.from_numpy(np.ascontiguousarray(values.T.reshape(-1)))
    return batch


class PairCollator:
    """Rows of a ``preference`` split (``PreferenceRows``) to a ``pairs`` batch (picklable for worker processes).

    Args:
        pad_token_id: Id written into padded positions (never attended, never a target).
        max_length: Tokens per row (``None``: uncut).
        truncation_mode: ``keep_start`` or ``keep_end``.
    """

    def __init__(self, pad_token_id: int, max_length: int | None, truncation_mode: str = "keep_start") -> None:
        self.pad_token_id, self.max_length, self.truncation_mode = pad_token_id, max_length, truncation_mode

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        cut = [
            cut_row(row["prompt_ids"], row[key], self.max_length, self.truncation_mode)
            for key in ("chosen_ids", "rejected_ids")
            for row in rows
        ]
        return _with_reference(rows_batch(cut, self.pad_token_id), rows)


class UnpairedCollator:
    """Rows of a ``kto`` split (``PreferenceRows`` with KL partners) to an ``unpaired`` batch (picklable).

    Args:
        pad_token_id: Id written into padded positions.
        max_length: Tokens per row, keeping the start (``None``: uncut).
    """

    def __init__(self, pad_token_id: int, max_length: int | None) -> None:
        self.pad_token_id, self.max_length = pad_token_id, max_length

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        cut = [
            cut_row(row["prompt_ids"], row[key], self.max_length, "keep_start")
            for key in ("completion_ids", "kl_completion_ids")
            for row in rows
        ]
        batch = rows_batch(cut, self.pad_token_id)
        batch[KTO_LABELS_KEY] = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)
        return _with_reference(batch, rows)


def kl_partner(index: int, chunk: int, total: int) -> int:
    """The example whose completion makes ``index``'s KL row: the previous one in its chunk of ``chunk`` examples,
    the chunk's last for its first (TRL: ``[completions[-1]] + completions[:-1]`` per map batch)."""
    start = index // chunk * chunk
    return start + (index - start - 1) % min(chunk, total - start)


class PreferenceRows(Dataset):
    """A prepared preference split, row by row: with its KL partner's completion (``kto``) and its reference
    log-probabilities once they are attached (read at access, so a loader made before the precompute sees them).

    Args:
        rows: The prepared split (``prompt_ids`` and ``chosen_ids``/``rejected_ids``, or ``completion_ids``/``label``).
        kl_chunk: The KL partners' chunk (the training batch size) for a ``kto`` split; ``None`` for paired data.
        references: Split name -> ``[rows, 2]`` float32 reference log-probabilities (filled by the precompute).
        split: This split's name in ``references``.
    """

    def __init__(
        self,
        rows: datasets.Dataset,
        kl_chunk: int | None = None,
        references: Mapping[str, np.ndarray] | None = None,
        split: str = "train",
    ) -> None:
        self.rows, self.kl_chunk, self.references, self.split = rows, kl_chunk, references, split

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = dict(self.rows[index])
        if self.kl_chunk is not None:
            partner = kl_partner(int(index), self.kl_chunk, len(self.rows))
            row["kl_completion_ids"] = self.rows[partner]["completion_ids"]
        reference = (self.references or {}).get(self.split)
        if reference is not None:
            row[REFERENCE_KEY] = reference[index]
        return row
