"""The vectorised preparation path (gym_lightning/data/arrays.py) gives exactly the reference tokenization
(tests/helpers/data_samples.py: per record, with Python lists)."""

from __future__ import annotations

import copy
import random

import pytest
from helpers.data_samples import reference_pairs
from tokenizers import processors

from gym_lightning.data.formats import has_target, uniform_plain_slots
from gym_lightning.data.prepare import Tokenize
from gym_lightning.data.sources import Record
from gym_lightning.errors import GymUserError
from gym_lightning.tokenizer import load_tokenizer

# Words that stress segment boundaries: digits (split one by one), accents, an emoji, a special token written in the
# text, runs of spaces and newlines at the start or end of a segment.
WORDS = ["the", "of", "2024", "x7", "café", "🙂", "<|im_end|>", " ", "  ", "\n", "\n\n", "a-b", "it's", "ÆØ", "."]


def text(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", ""]) for _ in range(rng.randint(low, high)))


def records(format: str, count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if format == "text":
            out.append({"text": text(rng, 1, 40)})
        elif format == "prompt_completion":
            out.append({"prompt": text(rng, 0, 30), "completion": text(rng, 0, 12)})
        elif format == "sharegpt":
            turns = [{"from": f, "value": text(rng, 1, 10)} for f in ("human", "gpt", "human", "gpt")]
            out.append({"system": text(rng, 0, 4), "conversations": turns})
        else:
            history = [[text(rng, 1, 6), text(rng, 1, 6)] for _ in range(rng.randint(0, 2))]
            out.append(
                {
                    "instruction": text(rng, 1, 20),
                    "input": rng.choice(["", text(rng, 1, 10)]),
                    "output": text(rng, 0, 15),
                    "system": rng.choice(["", text(rng, 1, 5)]),
                    "history": history,
                }
            )
    return out


def with_bos(tokenizer):
    """The shipped tokenizer putting a bos before every text (as Llama's does), so records get a special prefix."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    bos = tokenizer.convert_tokens_to_ids("<bos>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return tokenizer


def reference(rows: list[dict], format: str, tokenizer, max_seq_length: int, mask_prompt: bool):
    origin = [Record(row, f"t record {i + 1}") for i, row in enumerate(rows)]
    pairs = reference_pairs(origin, format, tokenizer, max_seq_length, mask_prompt)
    return [[ids for ids, labels in pairs if has_target(labels)], [labels for _, labels in pairs if has_target(labels)]]


def plain_alpaca(count: int) -> list[dict]:
    """Alpaca records without ``system`` or ``history`` (the common case), half of them without an ``input``."""
    return [{key: row[key] for key in ("instruction", "input", "output")} for row in records("alpaca", count)]


@pytest.mark.parametrize("format", ["alpaca", "plain alpaca", "prompt_completion", "text", "sharegpt"])
def test_fast_path_equals_the_reference(format: str):
    shipped = load_tokenizer(None)
    rows = plain_alpaca(300) if format == "plain alpaca" else records(format, 300)
    format = format.removeprefix("plain ")
    batch = {key: [row.get(key) for row in rows] for key in rows[0]}
    # The slot path (no Python object per record) takes every plain batch but those with system/history.
    assert (uniform_plain_slots(batch, format) is None) == (format == "sharegpt" or "history" in batch)
    for tokenizer, mask_prompt, max_seq_length in ((shipped, True, 48), (with_bos(shipped), False, 1024)):
        tokenize = Tokenize(format, tokenizer, max_seq_length, mask_prompt, format != "text", "t")
        got = tokenize(batch, list(range(len(rows))))
        ids, labels = reference(rows, format, tokenizer, max_seq_length, mask_prompt)
        assert got.column("input_ids").to_pylist() == ids
        assert got.column("labels").to_pylist() == labels
        assert got.column("input_ids").type.value_type.bit_width == 32
        if mask_prompt:  # the cut to 48 tokens cuts some records and drops others (prompts filling them)
            assert max(map(len, ids)) == max_seq_length
            assert 0 < len(ids) < len(rows) or format == "text"
        if format != "text":
            assert len(got.column("prompt_ids")) == len(ids)


def test_fast_path_ignores_a_truncation_left_on_the_backend():
    """transformers' __call__ switches truncation off when none is asked; the direct backend call must too."""
    tokenizer = copy.deepcopy(load_tokenizer(None))
    rows = records("alpaca", 20)
    tokenizer.backend_tokenizer.enable_truncation(4)
    batch = {key: [row[key] for row in rows] for key in rows[0]}
    got = Tokenize("alpaca", tokenizer, 1024, True, False, "t")(batch, list(range(20)))
    assert got.column("input_ids").to_pylist() == reference(rows, "alpaca", tokenizer, 1024, True)[0]
    assert min(len(ids) for ids in got.column("input_ids").to_pylist()) > 4


@pytest.mark.parametrize(
    ("bad", "message"),
    [(None, "lacks 'output'"), (7, "field 'output' must be a string, got int")],
)
def test_a_bad_field_in_a_plain_batch_is_named_with_its_record(bad, message: str):
    rows = plain_alpaca(5)
    rows[3]["output"] = bad
    batch = {key: [row[key] for row in rows] for key in rows[0]}
    assert uniform_plain_slots(batch, "alpaca") is None
    with pytest.raises(GymUserError, match=f"t record 4: .*{message}"):
        Tokenize("alpaca", load_tokenizer(None), 1024, True, False, "t")(batch, list(range(5)))
