"""Record formats: their names, detection and field checks, what a record trains on and its generation prompt.

A plain record becomes ``(text, is_target)`` segments (``plain_segments``), a chat record OpenAI-style messages
(``conversation``); ``prompt_text``/``prompt_ids_of`` give the prompt to ``generate`` from. Tokenization is elsewhere
(``data.arrays``, ``data.chat``, ``data.prepare``); :class:`TokenizedSample` says what it makes of a record.

Formats (``format=`` of the data module; ``columns`` renames a data set's fields to these names first):

- ``text``: ``{"text": ...}``; every token is a target (pretraining-style).
- ``alpaca``: ``{"instruction", "input" (optional), "output", "system" (optional), "history" (optional)}``,
  rendered with the concise template ``"### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n###
  Response:\\n"`` (the Input block is left out when ``input`` is missing or empty) followed by ``output``. ``system``
  is put first, followed by a blank line; ``history`` is a list of earlier ``[instruction, output]`` pairs, rendered
  as earlier turns before the current one. Targets: every ``output`` (history turns included) and an eos after each.
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, joined with no separator (put one in the data if you
  want one); the target is ``completion``.
- ``messages`` (alias ``chat``): OpenAI style ``{"messages": [{"role", "content", "tool_calls" (optional)}, ...],
  "tools": [...] (optional)}``, rendered by the tokenizer's chat template (``tools`` are passed to it).
- ``sharegpt``: ``{"conversations": [{"from", "value"}, ...], "system" (optional), "tools" (optional)}`` with roles
  ``human``/``user``, ``gpt``/``assistant``, ``system``, ``function_call`` (an assistant tool call whose value is the
  JSON ``{"name", "arguments"}``) and ``observation``/``tool`` (a tool result); converted to ``messages``.
  ``tools`` may be a JSON string (as in LLaMA-Factory's data sets) or a list.
- ``preference`` (paired) and ``kto`` (unpaired) preference records: see ``gym_lightning.data.preference``.
- ``auto``: picks one of the above from the fields of the first record and says which (rank-zero info).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
from transformers import PreTrainedTokenizerBase

from gym_lightning._compat import rank_zero_info, rank_zero_warn
from gym_lightning.data.sources import Record
from gym_lightning.data.tokens import special_prefix
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX

FormatName = Literal["auto", "text", "alpaca", "sharegpt", "messages", "chat", "prompt_completion", "preference", "kto"]
FORMATS: tuple[str, ...] = get_args(FormatName)
ALIASES = {"chat": "messages"}
CHAT_FORMATS = ("messages", "sharegpt")
PREFERENCE_FORMATS = ("preference", "kto")  # tokenized by gym_lightning.data.preference, not here
KTO_LABEL_FIELDS = ("label", "kto_tag")  # TRL's and LLaMA-Factory's name of the desirable flag
# Fields a record must have to train (all of them) and to predict (only the prompt side).
TRAIN_FIELDS = {
    "text": ("text",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    # The least each needs; gym_lightning.data.preference reads the other shapes (implicit prompt, LLaMA-Factory's).
    "preference": ("chosen", "rejected"),
    "kto": ("completion", "label"),
}
PREDICT_FIELDS = {**TRAIN_FIELDS, "alpaca": ("instruction",), "prompt_completion": ("prompt",)}
OPTIONAL_TEXT_FIELDS = {"alpaca": ("input", "system")}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
EOS = None  # a segment whose text is EOS stands for the tokenizer's eos token


@dataclass
class TokenizedSample:
    """One tokenized example.

    Chat targets are exactly what the assistant says in every turn and its end-of-turn token (see
    ``gym_lightning.data.chat``). Other formats get the tokenizer's eos appended as a target, so that the model learns
    to stop; chat formats get it only when the template ends an assistant turn without a special token (no duplicate
    eos). Sequences are cut to ``max_seq_length`` tokens. With ``mask_prompt=True`` the labels of all non-target tokens
    are ``-100``; with ``False`` every token is a target. Non-chat segments are tokenized one by one (in one batched
    call) and concatenated, so that the prompt tokens seen in training are exactly the tokens of the prompt given to
    ``generate``.

    Attributes:
        input_ids: Token ids of the whole example (prompt and target, end-of-turn/eos included).
        labels: Same length as ``input_ids``; ``-100`` marks tokens that are not targets.
        position_ids: Set by packing (restart at 0 per document); ``None`` means ``0..len-1``.
        prompt_ids: Token ids of the prompt to ``generate`` from, when the format has a prompt.
        prompt: Text of that prompt.
        reference: Expected completion (for exact-match checks), when the record has one.
    """

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    prompt: str | None = None
    reference: str | None = None


# (text, is_target) pieces of an example, in order; a text of ``EOS`` is the eos token.
Segments = list[tuple[str | None, bool]]


def canonical(format: str) -> str:
    """The format name with aliases resolved (``chat`` -> ``messages``)."""
    return ALIASES.get(format, format)


def preference_format(record: Record) -> str | None:
    """``preference`` for a record with ``chosen`` and ``rejected``, ``kto`` for one with a boolean ``label`` (or
    ``kto_tag``) and an answer (``completion``, ``output`` or a conversation), else ``None``."""
    data = record.data
    if data.get("chosen") is not None and data.get("rejected") is not None:
        return "preference"
    label = next((data[key] for key in KTO_LABEL_FIELDS if data.get(key) is not None), None)
    answers = ("completion", "output", "messages", "conversations")
    return "kto" if isinstance(label, bool) and any(data.get(key) is not None for key in answers) else None


def detect_format(record: Record, for_predict: bool = False) -> str:
    """The format whose fields ``record`` has: ``preference``/``kto`` (``preference_format``; not for prediction),
    then in the order messages, sharegpt, alpaca, prompt_completion, text (a ``messages`` list of ``from``/``value``
    turns is ShareGPT)."""
    if not for_predict and (preference := preference_format(record)) is not None:
        return preference
    fields = PREDICT_FIELDS if for_predict else TRAIN_FIELDS
    for name in ("messages", "sharegpt", "alpaca", "prompt_completion", "text"):
        if all(record.data.get(key) is not None for key in fields[name]):
            turns = record.data.get("messages")
            if name == "messages" and isinstance(turns, list) and turns and "from" in (turns[0] or {}):
                return "sharegpt"
            return name
    shown = [name for name in fields if not (for_predict and name in PREFERENCE_FORMATS)]
    expected = "; ".join(f"{name}: {', '.join(fields[name])}" for name in shown)
    present = sorted(key for key, value in record.data.items() if value is not None)
    raise GymUserError(
        f"{record.origin}: cannot detect the data format from the fields {present}. Expected the fields of one "
        f"format ({expected}); rename fields with `columns` (e.g. {{question: instruction}}) or set the format."
    )


def resolve_format(format: str, records: Sequence[Record], for_predict: bool = False) -> str:
    """Check ``format`` and replace ``"auto"`` by the format detected from the first record; aliases resolved."""
    if format not in FORMATS:
        raise GymUserError(f"Unknown data format {format!r}; valid formats are: {', '.join(FORMATS)}.")
    if format != "auto":
        return canonical(format)
    detected = detect_format(records[0], for_predict)
    rank_zero_info(f"Data format 'auto': detected {detected!r} from the fields of {records[0].origin}.")
    return detected


def check_fields(record: Record, format: str, for_predict: bool = False) -> None:
    """Raise a ``GymUserError`` naming the record, the missing field and the expected ones."""
    expected = (PREDICT_FIELDS if for_predict else TRAIN_FIELDS)[format]
    missing = [key for key in expected if record.data.get(key) is None]
    if missing:
        present = sorted(key for key, value in record.data.items() if value is not None)
        raise GymUserError(
            f"{record.origin}: the {format!r} format needs the field(s) {', '.join(expected)}, but this record lacks "
            f"{', '.join(repr(m) for m in missing)} (it has {present}). Fix the record, map a field onto it with "
            "`columns`, or choose another format."
        )
    text_fields = [
        k for k in (*expected, *OPTIONAL_TEXT_FIELDS.get(format, ())) if k not in ("messages", "conversations")
    ]
    for key in text_fields:
        value = record.data.get(key)
        if value is not None and not isinstance(value, str):
            raise GymUserError(f"{record.origin}: field {key!r} must be a string, got {type(value).__name__}.")


# ------------------------------------------------------------------------------- plain formats: the segment model
def _alpaca_prompt(data: dict[str, Any]) -> str:
    if data.get("input"):
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=data["instruction"], input=data["input"])
    return ALPACA_PROMPT.format(instruction=data["instruction"])


def _alpaca_context(record: Record) -> str:
    """System text and earlier turns that precede the current instruction (empty without them)."""
    data = record.data
    parts = [f"{data['system']}\n\n"] if data.get("system") else []
    for turn in data.get("history") or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise GymUserError(f"{record.origin}: 'history' must be a list of [instruction, output] string pairs.")
        parts.append(ALPACA_PROMPT.format(instruction=turn[0]) + turn[1] + "\n\n")
    return "".join(parts)


def _alpaca_segments(record: Record) -> Segments:
    data = record.data
    segments: Segments = [(f"{data['system']}\n\n", False)] if data.get("system") else []
    for instruction, output in data.get("history") or []:
        segments += [(ALPACA_PROMPT.format(instruction=instruction), False), (output, True), ("\n\n", False)]
    _alpaca_context(record)  # validates the history
    return [*segments, (_alpaca_prompt(data), False), (data["output"], True), (EOS, True)]


# Formats whose segments are their fields as written: (field, is_target) in order, before the closing eos.
FIELD_SEGMENTS = {"text": (("text", True),), "prompt_completion": (("prompt", False), ("completion", True))}


def plain_segments(record: Record, format: str) -> tuple[Segments, str | None]:
    """The (text, is_target) segments of a non-chat record and its reference completion, if any."""
    data = record.data
    if format == "alpaca":
        return _alpaca_segments(record), data["output"]
    segments: Segments = [(data[field], is_target) for field, is_target in FIELD_SEGMENTS[format]]
    return [*segments, (EOS, True)], data["completion"] if format == "prompt_completion" else None


def segment_texts(all_segments: Sequence[Segments]) -> list[str]:
    """The texts the tokenizer sees for the records' segments, in order (``EOS`` marks a token, not text)."""
    return [text for segments in all_segments for text, _ in segments if text is not EOS]


def has_target(labels: Sequence[int]) -> bool:
    """Whether a sample trains anything (``labels[0]`` never does: token t is predicted from tokens before t)."""
    return bool(np.any(np.asarray(labels[1:]) != IGNORE_INDEX))


def _all_strings(column: list | None, optional: bool) -> bool:
    if column is None:
        return optional
    return all(type(value) is str or (optional and value is None) for value in column)


def uniform_plain_slots(batch: dict[str, list], format: str) -> tuple[list[list[str]], tuple[bool, ...]] | None:
    """A batch of plain records (column -> values) as text columns when every record has the same segments, as
    ``plain_segments`` would give them: the texts of segment j of every record, and whether segment j is a target
    (the closing ``EOS`` left out). ``None`` sends the batch through the per-record path: a field missing or not a
    string there (``check_fields`` words the error), or alpaca ``system``/``history`` (the segment count varies)."""
    if format not in ("text", "alpaca", "prompt_completion"):
        return None
    fields_ok = all(_all_strings(batch.get(key), False) for key in TRAIN_FIELDS[format]) and all(
        _all_strings(batch.get(key), True) for key in OPTIONAL_TEXT_FIELDS.get(format, ())
    )
    if not fields_ok:
        return None
    if format in FIELD_SEGMENTS:
        return [batch[field] for field, _ in FIELD_SEGMENTS[format]], tuple(t for _, t in FIELD_SEGMENTS[format])
    if any(batch.get("system") or ()) or any(batch.get("history") or ()):
        return None
    inputs = batch.get("input") or [None] * len(batch["instruction"])
    pairs = zip(batch["instruction"], inputs, strict=True)
    prompts = [_alpaca_prompt({"instruction": instruction, "input": input}) for instruction, input in pairs]
    return [prompts, batch["output"]], (False, True)


# ------------------------------------------------------------------------------------------------- chat formats
def parse_json(value: Any, what: str, origin: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise GymUserError(f"{origin}: {what} is not valid JSON ({error.msg}).") from None


def _sharegpt_turn(turn: Any, origin: str) -> dict[str, Any]:
    if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
        raise GymUserError(f'{origin}: ShareGPT turns must be {{"from": ..., "value": ...}} objects with strings.')
    role = SHAREGPT_ROLES.get(turn["from"])
    if role is None:
        raise GymUserError(
            f"{origin}: unknown ShareGPT role {turn['from']!r}; expected one of {sorted(SHAREGPT_ROLES)}."
        )
    if turn["from"] != "function_call":
        return {"role": role, "content": turn["value"]}
    calls = parse_json(turn["value"], "a function_call value", origin)
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and "name" in c for c in calls):
        raise GymUserError(f'{origin}: a function_call value must be {{"name": ..., "arguments": ...}} (JSON).')
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls
        ],
    }


def drop_nulls(value: Any) -> Any:
    """``value`` without null dict entries, recursively. Arrow stores a column of JSON objects as one struct type,
    so a record loaded through ``datasets`` gets every key any record has, ``None`` where it had none (tool call
    arguments ``{"city": "Paris"}`` beside ``{"query": "x"}`` come back as ``{"city": "Paris", "query": None}``).
    A genuine null argument is dropped too; store ``arguments``/``tools`` as JSON strings to keep one."""
    if isinstance(value, dict):
        return {key: drop_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [drop_nulls(item) for item in value]
    return value


def conversation(record: Record, format: str) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The OpenAI-style messages and the tools of a ``messages`` or ``sharegpt`` record (checked)."""
    data = record.data
    tools = drop_nulls(parse_json(data.get("tools"), "'tools'", record.origin)) or None
    if format == "sharegpt":
        turns = data["conversations"] if data.get("conversations") is not None else data.get("messages")
        if not isinstance(turns, list) or not turns:
            raise GymUserError(f"{record.origin}: 'conversations' must be a non-empty list of ShareGPT turns.")
        system = [{"role": "system", "content": data["system"]}] if data.get("system") else []
        return system + [_sharegpt_turn(turn, record.origin) for turn in turns], tools
    messages = data["messages"]
    ok = isinstance(messages, list) and messages
    ok = ok and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        raise GymUserError(
            f'{record.origin}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}} objects.'
        )
    messages = drop_nulls(messages)
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            function["arguments"] = parse_json(function.get("arguments", {}), "tool call arguments", record.origin)
    return messages, tools


def check_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise a ``GymUserError`` saying what to do when the tokenizer has no chat template to render chats with."""
    if tokenizer.chat_template is None:
        raise GymUserError(
            "The 'messages'/'sharegpt' (chat) formats render conversations with the tokenizer's chat template, but "
            "this tokenizer has none; use a tokenizer with a chat_template (the shipped one has ChatML) or another "
            "format."
        )


# ------------------------------------------------------------------------------------------------------ prompts
def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[Any] | None, generation: bool
) -> str:
    """The chat template's rendering of a conversation."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[Any] | None
) -> tuple[str, str | None]:
    """Prompt (messages before the last assistant turn, with the generation prompt) and that turn as reference."""
    if messages[-1]["role"] == "assistant":
        return render(tokenizer, messages[:-1], tools, True), messages[-1].get("content") or None
    return render(tokenizer, messages, tools, True), None


def prompt_text(record: Record, format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str | None]:
    """The generation prompt of a record and its reference completion (``None`` when the record has none)."""
    data = record.data
    if format == "text":
        return data["text"], None
    if format == "alpaca":
        return _alpaca_context(record) + _alpaca_prompt(data), data.get("output")
    if format == "prompt_completion":
        return data["prompt"], data.get("completion")
    check_template(tokenizer)
    return chat_prompt(tokenizer, *conversation(record, format))


def prompt_ids_of(tokenizer: PreTrainedTokenizerBase, prompt: str, format: str, max_seq_length: int) -> list[int]:
    """The ids ``generate`` starts from: the tokenizer's special prefix (plain formats) and the prompt's tokens."""
    prefix = [] if format in CHAT_FORMATS else special_prefix(tokenizer)
    # Keep the end of an over-long prompt: generation continues from it.
    return (prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"])[-max_seq_length:]


def tokenize_prompt(
    record: Record, format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> TokenizedSample:
    """A prediction sample: only the prompt (``input_ids == prompt_ids``, no targets) and the reference, if any."""
    format = canonical(format)
    if format in PREFERENCE_FORMATS:
        raise GymUserError(
            f"{record.origin}: prediction reads prompts, and data.format {format!r} describes preference training "
            "records; predict with data.format auto (records with a prompt, chat messages or alpaca instructions)."
        )
    check_fields(record, format, for_predict=True)
    prompt, reference = prompt_text(record, format, tokenizer)
    ids = prompt_ids_of(tokenizer, prompt, format, max_seq_length)
    return TokenizedSample(list(ids), [IGNORE_INDEX] * len(ids), prompt_ids=ids, prompt=prompt, reference=reference)


def report_dropped(total: int, kept: int, max_seq_length: int) -> None:
    """Warn about samples dropped for having no target within ``max_seq_length``; fail when none is left."""
    if not kept and total:
        raise GymUserError(f"No sample has a target token within max_seq_length={max_seq_length}; raise it.")
    if kept < total:
        rank_zero_warn(
            f"Dropped {total - kept} of {total} samples that have no target token within "
            f"max_seq_length={max_seq_length} (their prompts fill it); raise max_seq_length to keep them."
        )
