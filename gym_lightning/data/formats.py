"""Record formats: how a JSON record becomes token ids, labels and (where there is one) a prompt for generation.

Formats (``format=`` of the data module):

- ``text``: ``{"text": ...}``; every token is a target (pretraining-style).
- ``alpaca``: ``{"instruction": ..., "input": ... (optional), "output": ...}``, rendered with the concise template
  ``"### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n### Response:\\n"`` (the Input block is left out
  when ``input`` is missing or empty) followed by ``output``; the target is ``output``.
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, joined with no separator (put one in the data if
  you want one); the target is ``completion``.
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered by the tokenizer's chat template; the
  targets are the assistant turns (their content and the template's end-of-turn text). Assistant spans are found by
  rendering growing prefixes of the conversation and diffing them, which works with any template whose rendering
  of a conversation starts with the rendering of its prefixes.
- ``auto``: picks one of the above from the fields of the first record and says which (rank-zero info).

In every format the tokenizer's eos token is appended as a target, so that the model learns to stop, and the
sequence is cut to ``max_seq_length`` tokens. With ``mask_prompt=True`` the labels of all non-target tokens are
``-100``; with ``False`` every token is a target. Segments are tokenized one by one and concatenated, so that the
prompt tokens seen in training are exactly the tokens of the prompt given to ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from transformers import PreTrainedTokenizerBase

from gym_lightning._compat import rank_zero_info, rank_zero_warn
from gym_lightning.data.sources import Record
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX

FormatName = Literal["auto", "text", "alpaca", "chat", "prompt_completion"]
FORMATS: tuple[str, ...] = get_args(FormatName)
# Fields a record must have to train (all of them) and to predict (only the prompt side).
TRAIN_FIELDS = {
    "text": ("text",),
    "alpaca": ("instruction", "output"),
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
}
PREDICT_FIELDS = {
    "text": ("text",),
    "alpaca": ("instruction",),
    "chat": ("messages",),
    "prompt_completion": ("prompt",),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class TokenizedSample:
    """One tokenized example.

    Attributes:
        input_ids: Token ids of the whole example (prompt and target, eos included).
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


# (text, is_target) pieces of an example, in order.
Segments = list[tuple[str, bool]]


def detect_format(record: Record, for_predict: bool = False) -> str:
    """The format whose fields ``record`` has, checked in the order chat, alpaca, prompt_completion, text."""
    fields = PREDICT_FIELDS if for_predict else TRAIN_FIELDS
    for name in ("chat", "alpaca", "prompt_completion", "text"):
        if all(key in record.data for key in fields[name]):
            return name
    expected = "; ".join(f"{name}: {', '.join(keys)}" for name, keys in fields.items())
    raise GymUserError(
        f"{record.origin}: cannot detect the data format from the fields {sorted(record.data)}. Expected the "
        f"fields of one format ({expected}), or set the format explicitly."
    )


def resolve_format(format: str, records: Sequence[Record], for_predict: bool = False) -> str:
    """Check ``format`` and replace ``"auto"`` by the format detected from the first record."""
    if format not in FORMATS:
        raise GymUserError(f"Unknown data format {format!r}; valid formats are: {', '.join(FORMATS)}.")
    if format != "auto":
        return format
    detected = detect_format(records[0], for_predict)
    rank_zero_info(f"Data format 'auto': detected {detected!r} from the fields of {records[0].origin}.")
    return detected


def check_fields(record: Record, format: str, for_predict: bool = False) -> None:
    """Raise a ``ValueError`` naming the record, the missing field and the expected ones."""
    expected = (PREDICT_FIELDS if for_predict else TRAIN_FIELDS)[format]
    missing = [key for key in expected if key not in record.data]
    if missing:
        raise GymUserError(
            f"{record.origin}: the {format!r} format needs the field(s) {', '.join(expected)}, but this record lacks "
            f"{', '.join(repr(m) for m in missing)} (it has {sorted(record.data)}). Fix the record or choose another "
            "format."
        )
    optional = ("input",) if format == "alpaca" else ()
    text_fields = [key for key in (*expected, *optional) if key in record.data and key != "messages"]
    for key in text_fields:
        if not isinstance(record.data[key], str):
            raise GymUserError(
                f"{record.origin}: field {key!r} must be a string, got {type(record.data[key]).__name__}."
            )


def _alpaca_prompt(data: dict[str, Any]) -> str:
    if data.get("input"):
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=data["instruction"], input=data["input"])
    return ALPACA_PROMPT.format(instruction=data["instruction"])


def _check_messages(record: Record) -> list[dict[str, str]]:
    messages = record.data["messages"]
    ok = isinstance(messages, list) and messages
    ok = ok and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)
    if not ok:
        raise GymUserError(
            f'{record.origin}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}} objects.'
        )
    return messages


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def chat_segments(record: Record, tokenizer: PreTrainedTokenizerBase) -> Segments:
    """Split a rendered conversation into non-target text and assistant-turn targets by diffing prefix renderings."""
    messages = _check_messages(record)
    segments: Segments = []
    done = ""  # rendering of the messages handled so far
    for i, message in enumerate(messages):
        boundaries = [_render(tokenizer, messages[: i + 1], False)]
        if message["role"] == "assistant":
            boundaries.insert(0, _render(tokenizer, messages[:i], True))  # prompt header of this turn
        for is_target, text in zip((False, message["role"] == "assistant"), boundaries, strict=False):
            if not text.startswith(done):
                raise GymUserError(
                    f"{record.origin}: the chat template does not render this conversation as an extension of its "
                    "first turns, so assistant turns cannot be located; use a template without history rewriting, "
                    "or the prompt_completion format."
                )
            segments.append((text[len(done) :], is_target))
            done = text
    return [(text, is_target) for text, is_target in segments if text]


def chat_prompt(record: Record, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str | None]:
    """Prompt (messages before the last assistant turn, with the generation prompt) and that turn as reference."""
    messages = _check_messages(record)
    if messages[-1]["role"] == "assistant":
        return _render(tokenizer, messages[:-1], True), messages[-1]["content"]
    return _render(tokenizer, messages, True), None


def record_segments(record: Record, format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[Segments, str | None]:
    """The (text, is_target) segments of a training record and its reference completion, if any."""
    data = record.data
    if format == "text":
        return [(data["text"], True)], None
    if format == "alpaca":
        return [(_alpaca_prompt(data), False), (data["output"], True)], data["output"]
    if format == "prompt_completion":
        return [(data["prompt"], False), (data["completion"], True)], data["completion"]
    if tokenizer.chat_template is None:
        raise GymUserError(
            "The 'chat' format renders conversations with the tokenizer's chat template, but this tokenizer has none; "
            "use a tokenizer with a chat_template (the shipped one has ChatML) or another format."
        )
    return chat_segments(record, tokenizer), chat_prompt(record, tokenizer)[1]


def prompt_text(record: Record, format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str | None]:
    """The generation prompt of a record and its reference completion (``None`` when the record has none)."""
    data = record.data
    if format == "text":
        return data["text"], None
    if format == "alpaca":
        return _alpaca_prompt(data), data.get("output")
    if format == "prompt_completion":
        return data["prompt"], data.get("completion")
    return chat_prompt(record, tokenizer)


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids the tokenizer puts before a text (a bos for Llama, nothing for Qwen); chat templates add their own."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return [i for i in ids if i != tokenizer.eos_token_id]


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_record(
    record: Record, format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, mask_prompt: bool = True
) -> TokenizedSample:
    """Token ids and labels of a training/validation record (see the module docstring)."""
    check_fields(record, format)
    segments, reference = record_segments(record, format, tokenizer)
    prefix = [] if format == "chat" else special_prefix(tokenizer)
    input_ids, labels = list(prefix), [IGNORE_INDEX] * len(prefix)
    for text, is_target in segments:
        ids = _encode(tokenizer, text)
        input_ids += ids
        labels += ids if (is_target or not mask_prompt) else [IGNORE_INDEX] * len(ids)
    input_ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    sample = TokenizedSample(input_ids[:max_seq_length], labels[:max_seq_length], reference=reference)
    if reference is not None:
        sample.prompt, _ = prompt_text(record, format, tokenizer)
        sample.prompt_ids = _prompt_ids(tokenizer, sample.prompt, format, max_seq_length)
    return sample


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, format: str, max_seq_length: int) -> list[int]:
    prefix = [] if format == "chat" else special_prefix(tokenizer)
    # Keep the end of an over-long prompt: generation continues from it.
    return (prefix + _encode(tokenizer, prompt))[-max_seq_length:]


def tokenize_prompt(
    record: Record, format: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> TokenizedSample:
    """A prediction sample: only the prompt (``input_ids == prompt_ids``, no targets) and the reference, if any."""
    check_fields(record, format, for_predict=True)
    prompt, reference = prompt_text(record, format, tokenizer)
    ids = _prompt_ids(tokenizer, prompt, format, max_seq_length)
    return TokenizedSample(list(ids), [IGNORE_INDEX] * len(ids), prompt_ids=ids, prompt=prompt, reference=reference)


def tokenize_records(
    records: Sequence[Record],
    format: str,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    mask_prompt: bool = True,
) -> list[TokenizedSample]:
    """Tokenize training/validation records; drop (and report) those left without any target by truncation."""
    format = resolve_format(format, records)
    samples = [tokenize_record(r, format, tokenizer, max_seq_length, mask_prompt) for r in records]
    # labels[0] is never a target: the model predicts token t from tokens before t.
    kept = [s for s in samples if any(label != IGNORE_INDEX for label in s.labels[1:])]
    if not kept:
        raise GymUserError(f"No sample has a target token within max_seq_length={max_seq_length}; raise it.")
    if len(kept) < len(samples):
        rank_zero_warn(
            f"Dropped {len(samples) - len(kept)} of {len(samples)} samples that have no target token within "
            f"max_seq_length={max_seq_length} (their prompts fill it); raise max_seq_length to keep them."
        )
    return kept
