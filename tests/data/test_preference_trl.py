"""TRL parity of the preference data: our rows equal TRL 1.16's ``_prepare_dataset`` + collator, token for token.

For each case the same records and tokenizer go through ``DPOTrainer._prepare_dataset`` and
``DataCollatorForPreference`` (or ``KTOTrainer._prepare_dataset`` and ``DataCollatorForUnpairedPreference``) and through
``data.preference`` + ``data.pairs``; the input ids and labels (TRL's ``completion_mask == 0`` -> -100) of every row
must be equal, for standard, conversational and implicit-prompt data and KTO data, cut and uncut. TRL is a test-only
dependency; its methods are called on a stand-in ``self`` (they read only the tokenizer and the KL settings).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import datasets
import pytest
import torch
from helpers.dist import TESTS

from gym_lightning.data.pairs import PairCollator, PreferenceRows, UnpairedCollator
from gym_lightning.data.preference import PreferenceSettings, tokenize_preference_dataset
from gym_lightning.data.prepare import Settings
from gym_lightning.tokenizer import load_tokenizer

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_kto = pytest.importorskip("trl.trainer.kto_trainer")

TEMPLATES = TESTS / "fixtures" / "chat_templates"
SPECIAL = {"llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hi " * 6, "Count to three.", "Spell cat."]
GOOD = ["4", "Blue, like the sky on a clear day.", "hi", "one two three", "c a t"]
BAD = ["5", "Loud.", "bye bye", "three two one, and then some more words", "dog"]


def tokenizer(template: str | None = None):
    """The shipped tokenizer with a fixture's template (and its special tokens), or a template given as text."""
    tok = load_tokenizer(None)
    if template in SPECIAL:
        tok.add_special_tokens({"additional_special_tokens": SPECIAL[template]})
        tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    elif template is not None:
        tok.chat_template = template
    return tok


def standard() -> list[dict]:
    # A prompt ending with a space (its last token merges with the answer's first: the common prefix rule), and a
    # chosen that already ends with the eos text (not appended twice).
    records = [{"prompt": q + " ", "chosen": g, "rejected": b} for q, g, b in zip(QUESTIONS, GOOD, BAD, strict=True)]
    records[1]["prompt"] = "Name a colour:"
    records[3]["chosen"] += "<|endoftext|>"
    return records


def conversational() -> list[dict]:
    user = [[{"role": "user", "content": q}] for q in QUESTIONS]
    user[2] = [{"role": "system", "content": "Be brief."}, *user[2]]
    return [
        {
            "prompt": u,
            "chosen": [{"role": "assistant", "content": g}],
            "rejected": [{"role": "assistant", "content": b}],
        }
        for u, g, b in zip(user, GOOD, BAD, strict=True)
    ]


def implicit(records: list[dict]) -> list[dict]:
    """The same pairs with the prompt inside chosen and rejected (TRL's implicit prompt)."""
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in records]


def unpaired(records: list[dict]) -> list[dict]:
    """KTO records: chosen answers desirable, rejected undesirable, alternating."""
    return [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        for i, r in enumerate(records)
    ]


def rows(input_ids: torch.Tensor, attention: torch.Tensor, labels: torch.Tensor) -> list[tuple[list, list]]:
    """Each row's (ids, labels) without its padding."""
    lengths = attention.sum(1).tolist()
    return [(input_ids[i, :n].tolist(), labels[i, :n].tolist()) for i, n in enumerate(lengths)]


def trl_rows(records: list[dict], tok, max_length: int, mode: str, kto: bool, batch: int) -> tuple[list, list]:
    """TRL's rows (chosen then rejected; or completions then KL rows) and KTO labels."""
    data = datasets.Dataset.from_list(copy.deepcopy(records))
    args = SimpleNamespace(
        dataset_num_proc=None, max_length=max_length, truncation_mode=mode, per_device_train_batch_size=batch
    )
    if not kto:
        prepared = trl_dpo.DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), data, tok, args, "train")
        collate = trl_dpo.DataCollatorForPreference(tok.pad_token_id, max_length=max_length, truncation_mode=mode)
        out = collate([prepared[i] for i in range(len(prepared))])
        labels = out["input_ids"].masked_fill(out["completion_mask"] == 0, -100)
        return rows(out["input_ids"], out["attention_mask"], labels), []
    stand_in = SimpleNamespace(_tokenizer=tok, calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0)
    prepared = trl_kto.KTOTrainer._prepare_dataset(stand_in, data, tok, args, "train")
    out = trl_kto.DataCollatorForUnpairedPreference(tok.pad_token_id, max_length=max_length)(
        [prepared[i] for i in range(len(prepared))]
    )
    found = []
    for prefix in ("", "KL_"):
        labels = out[f"{prefix}input_ids"].masked_fill(out[f"{prefix}completion_mask"] == 0, -100)
        found += rows(out[f"{prefix}input_ids"], out[f"{prefix}attention_mask"], labels)
    return found, out["label"].tolist()


def our_rows(records: list[dict], tok, max_length: int, mode: str, kto: bool, batch: int) -> tuple[list, list]:
    format = "kto" if kto else "preference"
    settings = Settings(max_length, True, False, 0.0, 0, None)
    prepared = tokenize_preference_dataset(
        datasets.Dataset.from_list(copy.deepcopy(records)),
        format,
        tok,
        settings,
        PreferenceSettings(max_length, mode),
        "t",
    )
    split = PreferenceRows(prepared, kl_chunk=batch if kto else None)
    collate = (
        UnpairedCollator(tok.pad_token_id, max_length) if kto else PairCollator(tok.pad_token_id, max_length, mode)
    )
    out = collate([split[i] for i in range(len(split))])
    assert out["input_ids"].shape[0] == 2 * len(split)
    return rows(out["input_ids"], out["attention_mask"], out["labels"]), out.get("kto_labels", torch.zeros(0)).tolist()


def implicit_conversational() -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in conversational()]


# A ChatML variant whose generation prompt holds an empty think block that a rendered answer lacks (as Gemma 4's
# does): the tokenized prompt is not a prefix of prompt + answer, and the answer starts where they diverge.
DIVERGING = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)
# name -> (records, chat template (None: the shipped ChatML), a cut length that drops the long-prompt example with
# keep_start and cuts some others)
CASES = {
    "standard": (standard, None, 20),
    "conversational-chatml": (conversational, None, 30),
    "conversational-llama3": (conversational, "llama3", 40),
    "conversational-diverging": (conversational, DIVERGING, 30),
    "implicit-standard": (lambda: implicit(standard()), None, 20),
    "implicit-conversational": (implicit_conversational, "llama3", 40),
}


@pytest.mark.parametrize("mode", ["uncut", "keep_start", "keep_end"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paired_rows_equal_trl(case, mode):
    make, template, cut = CASES[case]
    tok, records = tokenizer(template), make()
    length = 4096 if mode == "uncut" else cut
    truncation = "keep_start" if mode == "uncut" else mode
    theirs, _ = trl_rows(records, tok, length, truncation, kto=False, batch=2)
    ours, _ = our_rows(records, tok, length, truncation, kto=False, batch=2)
    assert ours == theirs
    if mode != "uncut":  # the case really cuts rows (and with keep_start drops the example whose prompt fills it)
        assert any(len(ids) == length for ids, _ in theirs)
        assert (len(theirs) < 2 * len(records)) == (mode == "keep_start")


KTO_CASES = ["standard", "conversational-chatml", "conversational-llama3", "paired-standard", "paired-conversational"]


@pytest.mark.parametrize("mode", ["uncut", "cut"])
@pytest.mark.parametrize("case", KTO_CASES)
def test_kto_rows_and_kl_rows_equal_trl(case, mode):
    """Completion rows, the KL rows of TRL's cycling (chunks of the per-device batch: 3 of 5 examples here, so that
    the direction shows) and the labels; paired records are unpaired as TRL unpairs them (chosen desirable, rejected
    undesirable)."""
    template = "llama3" if case.endswith("llama3") else None
    tok = tokenizer(template)
    base = standard() if case.endswith("standard") else conversational()
    records = base if case.startswith("paired") else unpaired(base)
    length = 4096 if mode == "uncut" else 20 if case.endswith("standard") else 40 if template else 30
    theirs, their_labels = trl_rows(records, tok, length, "keep_start", kto=True, batch=3)
    ours, our_labels = our_rows(records, tok, length, "keep_start", kto=True, batch=3)
    assert ours == theirs and our_labels == their_labels
    half = len(ours) // 2
    assert ours[half:] != ours[:half]  # the KL rows are mismatched pairs, not the completion rows again
    if mode == "cut":  # the case really cuts rows and drops the example whose prompt fills max_length
        assert any(len(ids) == length for ids, _ in theirs) and half < len(records) * (1 + case.startswith("paired"))
