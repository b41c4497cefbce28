"""Which tokens of a chat-template rendering are targets: the assistant's turns and their end-of-turn token.

Two methods, chosen per tokenizer:

1. The template's own mask. A template that wraps assistant output in ``{% generation %}...{% endgeneration %}``
   tells exactly what to train; ``apply_chat_template(return_assistant_tokens_mask=True)`` returns it.
2. Otherwise, one rendering of the whole conversation and character offsets. Rendering growing prefixes and diffing
   them (the former method) assumes that a conversation renders as an extension of its first turns, which fails for
   templates that rewrite history: Qwen3 drops the ``<think>`` reasoning of earlier assistant turns. Here the
   conversation is rendered once; each message is located in order in that text, an assistant turn's target starting
   right after the template's assistant header (what ``add_generation_prompt`` appends; or at its content for
   templates without one, such as Mistral's) and ending at its content's end, extended to the first special token
   after it (the end-of-turn token: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``). Text between the
   header and the content (reasoning, tool-call JSON) is a target too: the model generates it after the header. A
   fast tokenizer's ``offset_mapping`` maps the character spans to tokens (a token overlapping a span is a target,
   so a word merged with the space before it still counts). When the last assistant turn has no special token after
   it, the tokenizer's eos is appended as its end. Batched: one tokenizer call for a batch of conversations.

The transformers chat-template machinery and fast tokenizers do the rendering and offsets; only the span search is
written here, because no library locates assistant turns in a template without generation markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from gym_lightning.data.tokens import encode, offsets_array, special_token_ids
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX

Conversation = tuple[list[dict[str, Any]], list[Any] | None]


def has_generation_mask(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template marks assistant output with ``{% generation %}``."""
    template = tokenizer.chat_template
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def assistant_header(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the template puts before an assistant reply: the text ``add_generation_prompt`` appends ("" if none)."""
    probe = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(probe, tokenize=False)
    prompted = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    return prompted[len(plain) :] if prompted.startswith(plain) else ""


def _content_variants(content: str) -> list[str]:
    """Forms a template may render a content in: as is, stripped, or without earlier reasoning (Qwen3)."""
    variants = [content, content.strip()]
    if "</think>" in content:
        variants.append(content.split("</think>")[-1].strip())
    return [v for v in variants if v]


def _find(text: str, content: str, cursor: int) -> tuple[int, int]:
    """Start and end of the first rendering of ``content`` at or after ``cursor``; ``(-1, -1)`` if absent."""
    for variant in _content_variants(content):
        position = text.find(variant, cursor)
        if position >= 0:
            return position, position + len(variant)
    return -1, -1


def assistant_spans(
    text: str, messages: list[dict[str, Any]], header: str, special_ends: Sequence[int], origin: str
) -> list[tuple[int, int]]:
    """``(start, content_end)`` character spans of the assistant turns of ``messages`` in their rendering ``text``.

    Without an assistant header, a turn starts at its content or, when it has none (a tool call), after the first
    special token following the previous message (the prompt's end, e.g. Mistral's ``[/INST]``); ``special_ends``
    are the character ends of the rendering's special tokens.
    """
    spans, cursor = [], 0
    for message in messages:
        content = message.get("content") if isinstance(message.get("content"), str) else ""
        if message["role"] == "system":
            continue  # templates move the system prompt (Mistral: into the last user turn), so it marks no position
        if message["role"] != "assistant":
            found = _find(text, content, cursor)[1] if content else -1
            cursor = max(cursor, found)
            continue
        start = text.find(header, cursor) if header else -1
        start = start + len(header) if start >= 0 else -1
        content_start, content_end = _find(text, content, max(start, cursor)) if content else (-1, -1)
        start = start if start >= 0 else content_start
        if start < 0 and message.get("tool_calls"):
            start = next((end for end in special_ends if end > cursor), -1)
            # Its first token is the template's tool-call marker; the end-of-turn token is the next one after that.
            content_end = next((end for end in special_ends if end > start), start)
        if start < 0:
            raise GymUserError(
                f"{origin}: cannot locate an assistant turn in the chat template's rendering (its content does not "
                "appear in it and the template has no assistant header); use a template with {% generation %} "
                "markers, or the prompt_completion format."
            )
        spans.append((start, max(content_end, start)))
        cursor = spans[-1][1]
    return spans


def _span_labels(
    ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int]], special: np.ndarray, header_starts: list[int]
) -> tuple[np.ndarray, bool]:
    """Labels of one rendering, and whether its last assistant turn lacks an end-of-turn token."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    missing_end = False
    for index, (start, content_end) in enumerate(spans):
        limit = spans[index + 1][0] if index + 1 < len(spans) else int(offsets[-1, 1]) if len(ids) else 0
        limit = min([limit, *[h for h in header_starts if h >= content_end]])
        after = np.nonzero(special & (offsets[:, 0] >= content_end) & (offsets[:, 0] < limit))[0]
        end = int(offsets[after[0], 1]) if len(after) else content_end
        missing_end = not len(after)
        selected = (offsets[:, 1] > start) & (offsets[:, 0] < end)
        labels[selected] = ids[selected]
    return labels, missing_end


def _generation_mask_labels(
    conversations: Sequence[Conversation], tokenizer: PreTrainedTokenizerBase
) -> list[tuple[list[int], list[int]]]:
    out = []
    for messages, tools in conversations:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(encoded["input_ids"]), encoded["assistant_masks"]
        out.append((ids, [i if m else IGNORE_INDEX for i, m in zip(ids, mask, strict=True)]))
    return out


def chat_labels(
    conversations: Sequence[Conversation], tokenizer: PreTrainedTokenizerBase, origins: Sequence[str]
) -> list[tuple[list[int], list[int]]]:
    """Ids and labels of each conversation's rendering (see the module docstring)."""
    if has_generation_mask(tokenizer):
        return _generation_mask_labels(conversations, tokenizer)
    if not tokenizer.is_fast:
        raise GymUserError(
            "Locating assistant turns in a chat template without {% generation %} markers needs a fast tokenizer "
            "(offset mapping); this one is a slow (Python) tokenizer. Use its tokenizer.json version."
        )
    header = assistant_header(tokenizer)
    texts = [tokenizer.apply_chat_template(m, tools=t, tokenize=False) for m, t in conversations]
    encodings = encode(tokenizer, texts)  # = tokenizer(texts, ..., return_offsets_mapping=True), without conversion
    special_ids = sorted(special_token_ids(tokenizer))
    # A lookup table instead of np.isin per conversation (docs/benchmarks-history.md, "Data preparation: the
    # tokenizer calls").
    is_special = np.zeros(max(len(tokenizer), special_ids[-1] + 1 if special_ids else 0), dtype=bool)
    is_special[special_ids] = True
    out = []
    for i, text in enumerate(texts):
        ids = np.asarray(encodings[i].ids, dtype=np.int64)
        offsets = offsets_array(encodings[i])
        special = is_special[ids]
        spans = assistant_spans(text, conversations[i][0], header, offsets[special, 1].tolist(), origins[i])
        labels, missing_end = _span_labels(ids, offsets, spans, special, _occurrences(text, header))
        ids_list, labels_list = ids.tolist(), labels.tolist()
        if missing_end and spans and conversations[i][0][-1]["role"] == "assistant":
            ids_list.append(tokenizer.eos_token_id)
            labels_list.append(tokenizer.eos_token_id)
        out.append((ids_list, labels_list))
    return out


def _occurrences(text: str, header: str) -> list[int]:
    if not header:
        return []
    found, position = [], text.find(header)
    while position >= 0:
        found.append(position)
        position = text.find(header, position + 1)
    return found
