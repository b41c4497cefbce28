"""Preference records as token rows: the ``preference`` (paired) and ``kto`` (unpaired) formats, tokenized as TRL 1.16.

Record shapes (``columns`` first renames a data set's fields to these names):

- ``preference``: TRL's ``prompt``/``chosen``/``rejected``, strings (standard) or message lists (conversational);
  ``chosen``/``rejected`` alone (implicit prompt: their longest common prefix, TRL's ``extract_prompt``); and
  LLaMA-Factory's ranking records: ``instruction``/``input`` (+ ``system``, ``history``) with string answers, the
  prompt rendered as the ``alpaca`` format renders it, or ``conversations`` (ShareGPT turns) / ``messages`` (+
  ``system``, ``tools``) with ``chosen``/``rejected`` message objects. An answer is a string, one message or a list
  of messages; a string answer to a conversational prompt is one assistant message.
- ``kto``: ``prompt``/``completion`` with a boolean ``label`` (LLaMA-Factory's ``kto_tag``; true: desirable), an
  alpaca ``output``, or the last turn of a conversation as the completion; a paired record becomes two rows (chosen
  desirable, rejected undesirable: TRL's ``unpair_preference_dataset``).

Tokenization is TRL's (``DPOTrainer._prepare_dataset``, ``KTOTrainer._prepare_dataset``): a text answer gets the eos
token appended as text (unless it ends with it) and text is tokenized with the tokenizer's special tokens; a
conversation is rendered by the chat template (the prompt with the generation prompt, prompt + answer without) and
tokenized without. The answer starts where the prompt's tokens and the whole sequence's diverge
(``common_prefix_length``: a template may render a prompt alone differently). ``max_prompt_length`` then keeps the
prompt's last tokens (older TRL, LLaMA-Factory). Examples whose prompt fills ``max_length`` are dropped (TRL: DPO with
``keep_start``, KTO always). Rows are stored uncut (``prompt_ids``, ``chosen_ids``, ``rejected_ids``; or
``prompt_ids``, ``completion_ids``, ``label``) and cut to ``max_length`` by the batches (``gym_lightning.data.pairs``),
as TRL's collators cut them. Every unreadable record of a map batch is named in one error, one line each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import datasets
import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from gym_lightning._compat import rank_zero_warn
from gym_lightning.data.formats import (
    KTO_LABEL_FIELDS,
    check_template,
    conversation,
    drop_nulls,
    parse_json,
    prompt_text,
    render,
)
from gym_lightning.data.prepare import Settings, batch_records, map_processes
from gym_lightning.data.sources import Record
from gym_lightning.data.tokens import encode_ids
from gym_lightning.errors import GymUserError

Messages = list[dict[str, Any]]
Text = str | Messages  # a standard (string) or conversational (message list) prompt or answer
TruncationMode = Literal["keep_start", "keep_end"]
TRUNCATION_MODES = ("keep_start", "keep_end")
IDS = datasets.Sequence(datasets.Value("int32"))
FEATURES = {
    "preference": datasets.Features({"prompt_ids": IDS, "chosen_ids": IDS, "rejected_ids": IDS}),
    "kto": datasets.Features({"prompt_ids": IDS, "completion_ids": IDS, "label": datasets.Value("bool")}),
}
ACCEPTED = {
    "preference": (
        "prompt/chosen/rejected (strings or message lists), chosen/rejected alone (implicit prompt), or "
        "LLaMA-Factory's ranking records (instruction/input or conversations/messages, with chosen/rejected)"
    ),
    "kto": (
        "prompt/completion/label (label true or false), alpaca instruction/output or a conversation ending with the "
        "answer, with label (or kto_tag); or paired chosen/rejected records"
    ),
}
MAX_LISTED = 20  # problem lines of one error; the rest are counted


@dataclass(frozen=True)
class PreferenceSettings:
    """How preference rows are cut (TRL's ``max_length``, ``truncation_mode``; older TRL's ``max_prompt_length``).

    Args:
        max_length: Tokens per row (prompt + answer); the data module's ``max_seq_length``.
        truncation_mode: ``keep_start`` cuts a row's end, ``keep_end`` its start (paired rows only; KTO keeps starts).
        max_prompt_length: Keep at most the last this many prompt tokens (``None``: all).
    """

    max_length: int
    truncation_mode: TruncationMode = "keep_start"
    max_prompt_length: int | None = None


class RecordProblem(Exception):
    """Why one record cannot be read in a preference format (one sentence, without the record's name)."""


# --------------------------------------------------------------------------------------------- record shapes
def extract_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
    """TRL's ``extract_prompt``: the longest common prefix of ``chosen`` and ``rejected`` (characters, or messages)
    is the prompt, less a space it ends with. Its rule for answers of which one starts the other is kept (the prefix
    then stops one item short of the shorter one); at a difference in the first item the prompt is empty (where TRL
    would take the space before index -1)."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):  # the index after the loop is the rule
        if chosen[index] != rejected[index]:
            if index > 0 and chosen[index - 1] == " ":
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def _chat(turns: Any, system: Any, tools: Any, origin: str) -> tuple[Messages, list[Any] | None]:
    """OpenAI messages and tools of a message list (role/content, or ShareGPT from/value turns), with ``system``
    put first when the list has no system message."""
    sharegpt = isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and "from" in turns[0]
    data = {"conversations" if sharegpt else "messages": turns, "tools": tools}
    messages, tools = conversation(Record(data, origin), "sharegpt" if sharegpt else "messages")
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages, tools


def prompt_side(record: Record, tokenizer: PreTrainedTokenizerBase) -> tuple[Text | None, list[Any] | None]:
    """A record's prompt and tools: ``prompt`` (TRL), else ``conversations``/``messages`` (LLaMA-Factory's ShareGPT
    or OpenAI ranking columns, with ``system``/``tools``), else alpaca ``instruction``; ``None`` when implicit."""
    data = record.data
    if data.get("prompt") is not None:
        if isinstance(data["prompt"], str):
            return data["prompt"], None
        return _chat(data["prompt"], None, data.get("tools"), record.origin)
    for key in ("conversations", "messages"):
        if data.get(key) is not None:
            return _chat(data[key], data.get("system"), data.get("tools"), record.origin)
    if data.get("instruction") is not None:
        if not isinstance(data["instruction"], str):
            raise RecordProblem(f"its 'instruction' is of type {type(data['instruction']).__name__}, not a string")
        return prompt_text(record, "alpaca", tokenizer)[0], None
    return None, None


def answer(value: Any, conversational: bool, name: str, origin: str) -> Text:
    """``chosen``/``rejected``/``completion`` as a string (standard) or as messages (conversational)."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}] if conversational else value
    items = [value] if isinstance(value, dict) else value
    if not (isinstance(items, list) and items and all(isinstance(item, dict) for item in items)):
        raise RecordProblem(
            f"its {name!r} is of type {type(value).__name__}: give a string, a message or a message list"
        )
    if not conversational:
        raise RecordProblem(f"its {name!r} is a message but its prompt is text: give both as text or both as messages")
    return _chat(items, None, None, origin)[0]


def paired_example(record: Record, tokenizer: PreTrainedTokenizerBase) -> tuple[Text, Text, Text, list | None]:
    """``(prompt, chosen, rejected, tools)`` of a paired record, as TRL's tokenization takes them."""
    data = record.data
    missing = [key for key in ("chosen", "rejected") if data.get(key) is None]
    if missing:
        raise RecordProblem(f"it lacks {' and '.join(repr(key) for key in missing)}")
    if data["chosen"] == data["rejected"]:
        raise RecordProblem("its chosen equals its rejected: there is nothing to prefer")
    prompt, tools = prompt_side(record, tokenizer)
    if prompt is not None:
        chat = isinstance(prompt, list)
        chosen, rejected = (answer(data[key], chat, key, record.origin) for key in ("chosen", "rejected"))
        return prompt, chosen, rejected, tools
    chosen, rejected = (answer(data[k], not isinstance(data[k], str), k, record.origin) for k in ("chosen", "rejected"))
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise RecordProblem("its chosen and rejected must both be text or both messages (implicit prompt)")
    prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if isinstance(prompt, list) and not prompt:
        raise RecordProblem("its chosen and rejected share no first message, so the implicit prompt is empty")
    tools = drop_nulls(parse_json(data.get("tools"), "'tools'", record.origin)) or None
    return prompt, chosen, rejected, tools


def kto_label(data: dict[str, Any]) -> bool:
    """The desirable flag: a boolean ``label``/``kto_tag`` (or its text or 0/1 form, as CSV files hold it)."""
    value = next((data[key] for key in KTO_LABEL_FIELDS if data.get(key) is not None), None)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in ("true", "1", "false", "0"):
        return text in ("true", "1")
    if value is None:
        raise RecordProblem("it lacks 'label' (or 'kto_tag'): true for a desirable completion, false otherwise")
    raise RecordProblem(f"its label {value!r} is not true or false")


def unpaired_examples(record: Record, tokenizer: PreTrainedTokenizerBase) -> list[tuple[Text, Text, bool, Any]]:
    """``(prompt, completion, label, tools)`` rows of a KTO record (two for a paired record)."""
    data = record.data
    if data.get("chosen") is not None or data.get("rejected") is not None:
        prompt, chosen, rejected, tools = paired_example(record, tokenizer)
        return [(prompt, chosen, True, tools), (prompt, rejected, False, tools)]
    label = kto_label(data)
    if data.get("completion") is not None or data.get("prompt") is not None:
        prompt, tools = prompt_side(record, tokenizer)
        if prompt is None or data.get("completion") is None:
            raise RecordProblem(f"it lacks {'prompt' if prompt is None else 'completion'!r}")
        return [
            (prompt, answer(data["completion"], isinstance(prompt, list), "completion", record.origin), label, tools)
        ]
    if data.get("instruction") is not None and isinstance(data.get("output"), str):
        return [(prompt_side(record, tokenizer)[0], data["output"], label, None)]
    messages, tools = prompt_side(record, tokenizer)
    if not isinstance(messages, list) or len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise RecordProblem("it has no completion: give 'completion', or a conversation ending with the answer")
    return [(messages[:-1], messages[-1:], label, tools)]


# ----------------------------------------------------------------------------------------------- tokenization
def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading tokens ``ids`` and ``other`` share (TRL's ``common_prefix_length``)."""
    length = min(len(ids), len(other))
    differ = np.nonzero(np.asarray(ids[:length]) != np.asarray(other[:length]))[0]
    return int(differ[0]) if len(differ) else length


def tokenize_examples(
    examples: Sequence[tuple[Text, Sequence[Text], list | None]], tokenizer: PreTrainedTokenizerBase
) -> list[tuple[list[int], list[list[int]], bool]]:
    """``(prompt_ids, [answer_ids, ...], diverged)`` of ``(prompt, answers, tools)`` examples (``diverged``: the
    prompt's tokens are not a prefix of a whole sequence's). Text and conversations go through one tokenizer call
    each; a conversation is rendered first (``apply_chat_template(tokenize=True)`` tokenizes its rendering without
    special tokens, as here)."""
    eos = tokenizer.eos_token
    texts: dict[bool, list[str]] = {True: [], False: []}  # is text -> strings to tokenize
    slots = []
    for prompt, answers, tools in examples:
        plain = isinstance(prompt, str)
        if plain:
            ends = [a if eos is None or a.endswith(eos) else a + eos for a in answers]
            rendered = [prompt, *(prompt + end for end in ends)]
        else:
            check_template(tokenizer)
            rendered = [
                render(tokenizer, prompt, tools, True),
                *(render(tokenizer, prompt + a, tools, False) for a in answers),
            ]
        slots.append((plain, len(texts[plain]), len(rendered)))
        texts[plain] += rendered
    ids = {plain: encode_ids(tokenizer, texts[plain], add_special_tokens=plain) for plain in (True, False)}
    out = []
    for plain, start, count in slots:
        prompt_ids, *wholes = ids[plain][start : start + count]
        cut = min(common_prefix_length(prompt_ids, whole) for whole in wholes)
        out.append((list(prompt_ids[:cut]), [list(whole[cut:]) for whole in wholes], cut < len(prompt_ids)))
    return out


def keeps(prompt_length: int, format: str, settings: PreferenceSettings) -> bool:
    """Whether an example stays: not when its prompt alone fills ``max_length`` and the cut keeps starts (TRL)."""
    cuts_end = format == "kto" or settings.truncation_mode == "keep_start"
    return not (cuts_end and prompt_length >= settings.max_length)


class PreferenceTokenize:
    """The batched ``Dataset.map`` function of the preference formats: records to uncut token rows (picklable).

    Args:
        format: ``preference`` or ``kto``.
        tokenizer: The tokenizer.
        settings: Cut settings (``max_prompt_length``, and ``max_length`` for the drop rule).
        label: Names the data set in error messages (records are numbered from 1).
    """

    def __init__(self, format: str, tokenizer: PreTrainedTokenizerBase, settings: PreferenceSettings, label: str):
        self.format, self.tokenizer, self.settings, self.label = format, tokenizer, settings, label
        self._warned = False

    def __call__(self, batch: dict[str, list], indices: list[int]) -> pa.Table:
        examples, labels = self._examples(batch_records(batch, indices, self.label))
        rows = tokenize_examples(examples, self.tokenizer)
        if any(diverged for _, _, diverged in rows) and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"{self.label}: the tokenized prompt of some examples is not a prefix of prompt + answer (the chat "
                "template renders a prompt alone differently, or tokens merge across the boundary); their answer "
                "starts where the two diverge, as in TRL."
            )
        limit = self.settings.max_prompt_length
        columns: dict[str, list] = {
            "prompt_ids": [],
            **{name: [] for name in FEATURES[self.format] if name != "prompt_ids"},
        }
        for (prompt_ids, answers, _), label in zip(rows, labels, strict=True):
            prompt_ids = prompt_ids[-limit:] if limit is not None else prompt_ids
            if not keeps(len(prompt_ids), self.format, self.settings):
                continue
            columns["prompt_ids"].append(prompt_ids)
            if self.format == "preference":
                columns["chosen_ids"].append(answers[0])
                columns["rejected_ids"].append(answers[1])
            else:
                columns["completion_ids"].append(answers[0])
                columns["label"].append(label)
        return pa.table(
            {name: pa.array(values, type=FEATURES[self.format][name].pa_type) for name, values in columns.items()}
        )

    def _examples(self, records: Sequence[Record]) -> tuple[list[tuple[Text, list[Text], Any]], list[bool | None]]:
        """The records' ``(prompt, answers, tools)`` examples and KTO labels; every problem in one error. The
        rejected rows of paired records follow the batch's other rows: TRL's ``unpair_preference_dataset`` orders a
        map batch all chosen, then all rejected, and the order decides the KL partners."""
        examples, labels, problems, later = [], [], [], []
        for record in records:
            try:
                if self.format == "preference":
                    prompt, chosen, rejected, tools = paired_example(record, self.tokenizer)
                    examples.append((prompt, [chosen, rejected], tools))
                    labels.append(None)
                    continue
                first, *second = unpaired_examples(record, self.tokenizer)
                examples.append((first[0], [first[1]], first[3]))
                labels.append(first[2])
                later += second
            except RecordProblem as problem:
                fields = sorted(key for key, value in record.data.items() if value is not None)
                problems.append(f"{record.origin}: {problem} (it has the fields {fields}).")
            except GymUserError as error:  # a malformed message, named by formats.conversation
                problems.append(str(error))
        if problems:
            raise GymUserError(records_problem(problems, self.format))
        examples += [(prompt, [completion], tools) for prompt, completion, _, tools in later]
        return examples, labels + [label for _, _, label, _ in later]


def records_problem(problems: Sequence[str], format: str) -> str:
    """One message naming every unreadable record (one line each, the first ``MAX_LISTED``) and what is accepted."""
    listed = [f"  - {line}" for line in problems[:MAX_LISTED]]
    more = [f"  - ... and {len(problems) - MAX_LISTED} more."] if len(problems) > MAX_LISTED else []
    return "\n".join(
        [
            f"{len(problems)} record(s) cannot be read as data.format {format!r}, which takes {ACCEPTED[format]}; "
            "fix them, map fields onto these names with `columns`, or choose another format:",
            *listed,
            *more,
        ]
    )


def expected_rows(dataset: datasets.Dataset, format: str) -> int:
    """Rows the records make before the drop rule: one per record, two per paired record of the ``kto`` format."""
    if format != "kto" or "chosen" not in (dataset.column_names or []):
        return len(dataset)
    return len(dataset) + len(dataset) - dataset.with_format("arrow")["chosen"].null_count


def tokenize_preference_dataset(
    dataset: datasets.Dataset,
    format: str,
    tokenizer: PreTrainedTokenizerBase,
    settings: Settings,
    preference: PreferenceSettings,
    label: str,
    cache_file: str | None = None,
) -> datasets.Dataset:
    """Batched, multi-process tokenization of preference records (``PreferenceTokenize``); the examples dropped for
    a prompt that fills ``max_length`` are reported, and none left is an error."""
    tokenized = dataset.map(
        PreferenceTokenize(format, tokenizer, preference, label),
        batched=True,
        batch_size=1000,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=FEATURES[format],
        num_proc=map_processes(settings, len(dataset)),
        cache_file_name=cache_file,
        desc=f"Tokenizing {label}",
    )
    total = expected_rows(dataset, format)
    fix = "raise max_seq_length or set max_prompt_length" + (
        ", or truncation_mode: keep_end" if format == "preference" else ""
    )
    if total and not len(tokenized):
        raise GymUserError(f"{label}: every example's prompt fills max_seq_length={preference.max_length}; {fix}.")
    if len(tokenized) < total:
        rank_zero_warn(
            f"{label}: dropped {total - len(tokenized)} of {total} examples whose prompt alone fills "
            f"max_seq_length={preference.max_length} (as TRL drops them); {fix} to keep them."
        )
    return tokenized
