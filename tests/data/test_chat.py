"""Chat masking on template fixtures written from each family's documented turn format (tests/fixtures)."""

from __future__ import annotations

import copy

import datasets
import pytest
from helpers.data_samples import tokenize_record
from helpers.dist import TESTS
from helpers.targets import target_runs

from gym_lightning.data.chat import chat_labels
from gym_lightning.data.formats import conversation
from gym_lightning.data.sources import Record
from gym_lightning.tokenizer import load_tokenizer

TEMPLATES = TESTS / "fixtures" / "chat_templates"
SPECIAL = {
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen25": [],
    "qwen3": [],
    "mistral": [
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
    ],
    "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "chatml_generation": [],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"city": {"type": "string"}}}}]
CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
EXPECTED = {
    "llama3": [
        '{"name": "weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is sunny.<|eot_id|>",
        "You are welcome.<|eot_id|>",
    ],
    "qwen25": [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny.<|im_end|>",
        "You are welcome.<|im_end|>",
    ],
    "qwen3": [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny.<|im_end|>",  # the reasoning of a turn before the last query is dropped by the template
        "<think>\nbe polite\n</think>\n\nYou are welcome.<|im_end|>",
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]</s>',
        # The space the template puts before a reply is trained when it is part of the first word's token (" I" is
        # one token of the shipped tokenizer, " You" is two: " " and "You").
        " It is sunny.</s>",
        "You are welcome.</s>",
    ],
    "gemma": [
        '```tool_code\nweather(**{"city": "Paris"})\n```<end_of_turn>',
        "It is sunny.<end_of_turn>",
        "You are welcome.<end_of_turn>",
    ],
}


def family_tokenizer(name: str):
    tokenizer = load_tokenizer(None)
    if SPECIAL[name]:
        tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[name]})
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def messages_for(name: str) -> list[dict]:
    messages = copy.deepcopy(MESSAGES)
    if name == "qwen3":
        messages[4]["content"] = "<think>\nlook it up\n</think>\n\nIt is sunny."
        messages[6]["content"] = "<think>\nbe polite\n</think>\n\nYou are welcome."
    return messages


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_targets_are_every_assistant_turn_and_its_end_of_turn_token(name):
    tokenizer = family_tokenizer(name)
    messages = messages_for(name)
    ((ids, labels),) = chat_labels([(messages, TOOLS)], tokenizer, ["r:1"])
    # Exactly the template's rendering: no eos appended after the end-of-turn token.
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert target_runs(ids, labels, tokenizer) == EXPECTED[name]


def test_sharegpt_record_renders_like_the_same_openai_messages():
    tokenizer = family_tokenizer("qwen25")
    sharegpt = {
        "system": "Be brief.",
        "tools": '[{"type": "function", "function": {"name": "weather", "parameters": {"city": {"type": "string"}}}}]',
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "It is sunny."},
            {"from": "human", "value": "Thanks!"},
            {"from": "gpt", "value": "You are welcome."},
        ],
    }
    messages, tools = conversation(Record(sharegpt, "r:1"), "sharegpt")
    assert tools == TOOLS and messages[2]["tool_calls"] == [CALL]
    sample = tokenize_record(Record(sharegpt, "r:1"), "sharegpt", tokenizer, 4096)
    expected = tokenize_record(Record({"messages": MESSAGES, "tools": TOOLS}, "r:2"), "messages", tokenizer, 4096)
    assert (sample.input_ids, sample.labels) == (expected.input_ids, expected.labels)
    assert target_runs(sample.input_ids, sample.labels, tokenizer) == EXPECTED["qwen25"]
    assert sample.reference == "You are welcome." and sample.prompt.endswith(
        "Thanks!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_markers_are_the_template_own_mask():
    tokenizer = family_tokenizer("chatml_generation")
    messages = [m for m in MESSAGES if "tool_calls" not in m and m["role"] != "tool"]
    ((ids, labels),) = chat_labels([(messages, None)], tokenizer, ["r:1"])
    assert target_runs(ids, labels, tokenizer) == ["It is sunny.<|im_end|>", "You are welcome.<|im_end|>"]


def test_template_without_end_of_turn_token_gets_one_eos():
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ((ids, labels),) = chat_labels([(messages, None)], tokenizer, ["r:1"])
    assert ids[-1] == tokenizer.eos_token_id and ids.count(tokenizer.eos_token_id) == 1
    assert target_runs(ids, labels, tokenizer) == [" hello", "<|endoftext|>"]  # the newline after it is template text


def test_arrow_null_filled_tool_arguments_render_as_written(tmp_path):
    """A column of JSON objects becomes one Arrow struct: other records' keys come back as None and are dropped."""
    first = {"messages": MESSAGES, "tools": TOOLS}
    other_call = {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
    second = {"messages": [{"role": "user", "content": "Find x"}, {"role": "assistant", "tool_calls": [other_call]}]}
    rows = datasets.Dataset.from_list([first, second])
    assert rows[0]["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "query": None}
    messages, tools = conversation(Record(rows[0], "r:1"), "messages")
    assert messages[2]["tool_calls"] == [CALL] and tools == TOOLS
