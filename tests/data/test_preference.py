"""Preference data: record shapes (TRL's and LLaMA-Factory's), errors, batch kinds, batches, resume and settings.

TRL parity of the token rows is in test_preference_trl.py; the precomputed reference values in test_reference.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
import torch

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.formats import detect_format
from gym_lightning.data.loader import STEP_PAIRS_KEY, STEP_TOKENS_KEY, StepTokenDataLoader
from gym_lightning.data.pairs import (
    PairCollator,
    PreferenceRows,
    UnpairedCollator,
    batch_kind_problem,
    kl_partner,
)
from gym_lightning.data.preference import PreferenceSettings, extract_prompt, tokenize_preference_dataset
from gym_lightning.data.prepare import DataSource, Settings, fingerprint
from gym_lightning.data.sources import Record
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.tokenizer import load_tokenizer

PAIRS = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(12)]
KTO = [{"prompt": f"{i}+{i}=", "completion": str(2 * i + i % 2), "label": i % 2 == 0} for i in range(12)]


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_DATA_CACHE", str(tmp_path / "data-cache"))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def prepared(records: list[dict], format: str, tok, max_length: int = 512, **preference) -> datasets.Dataset:
    settings = Settings(max_length, True, False, 0.0, 0, None)
    options = PreferenceSettings(max_length, **preference)
    return tokenize_preference_dataset(datasets.Dataset.from_list(records), format, tok, settings, options, "set")


def row_texts(records: list[dict], format: str, tok) -> list[tuple[str, str]]:
    """(prompt, answer) texts of each prepared row (answers: chosen then rejected, or the completion)."""
    rows = prepared(records, format, tok)
    keys = ["chosen_ids", "rejected_ids"] if format == "preference" else ["completion_ids"]
    return [(tok.decode(row["prompt_ids"]), tok.decode(row[key])) for row in rows for key in keys]


# ------------------------------------------------------------------------------------------------ record shapes
def test_auto_detects_preference_and_kto_and_says_so(tmp_path, caplog):
    assert detect_format(Record(PAIRS[0], "r")) == "preference"
    assert detect_format(Record(KTO[0], "r")) == "kto"
    assert detect_format(Record({"instruction": "a", "output": "b", "kto_tag": False}, "r")) == "kto"
    assert detect_format(Record({"prompt": "a", "completion": "b"}, "r")) == "prompt_completion"
    assert detect_format(Record({"prompt": "a", "completion": "b", "label": "x"}, "r")) == "prompt_completion"
    dm = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "k.jsonl", KTO)))
    with caplog.at_level(logging.INFO):
        dm.prepare_data()
    assert "detected 'kto'" in caplog.text and dm.batch_kind == "unpaired"


def test_llama_factory_ranking_shapes_tokenize_as_the_trl_records_they_mean(tok):
    """ShareGPT ranking (conversations + from/value answers + system), OpenAI ranking (messages + role/content
    answers) and alpaca ranking (the prompt rendered as the alpaca format does) equal the TRL records."""
    trl_chat = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    sharegpt = {
        "conversations": [{"from": "human", "value": "2+2?"}],
        "system": "Be brief.",
        "chosen": {"from": "gpt", "value": "4"},
        "rejected": {"from": "gpt", "value": "5"},
    }
    openai = {"messages": trl_chat["prompt"], "chosen": trl_chat["chosen"][0], "rejected": trl_chat["rejected"][0]}
    expected = row_texts([trl_chat], "preference", tok)
    assert row_texts([sharegpt], "preference", tok) == expected == row_texts([openai], "preference", tok)
    assert expected[0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        "4<|im_end|>\n",
    )
    alpaca = {"instruction": "Add.", "input": "2+2", "chosen": "4", "rejected": "5"}
    prompt = "### Instruction:\nAdd.\n\n### Input:\n2+2\n\n### Response:\n"
    assert row_texts([alpaca], "preference", tok) == [(prompt, "4<|endoftext|>"), (prompt, "5<|endoftext|>")]


def test_kto_shapes_labels_and_unpairing(tok):
    conversation = [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]
    sharegpt = {"conversations": conversation, "kto_tag": True}
    trl = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
    assert row_texts([sharegpt], "kto", tok) == row_texts([{**trl, "label": True}], "kto", tok)
    csv_like = [{"instruction": "Add 2+2.", "output": "4", "kto_tag": text} for text in ("true", "False", "1")]
    assert prepared(csv_like, "kto", tok)["label"] == [True, False, True]
    paired = prepared([PAIRS[0], PAIRS[1]], "kto", tok)  # TRL's order: the chosen rows, then the rejected rows
    assert paired["label"] == [True, True, False, False]
    assert [tok.decode(ids) for ids in paired["completion_ids"]] == [
        "0<|endoftext|>",
        "2<|endoftext|>",
        "1<|endoftext|>",
        "3<|endoftext|>",
    ]


def test_implicit_prompt_is_trls_extract_prompt():
    assert extract_prompt("Q: sky? A: blue", "Q: sky? A: green") == ("Q: sky? A:", " blue", " green")
    assert extract_prompt("Q: 1 A: 2", "Q: 1 A: 23") == ("Q: 1 A: ", "2", "23")  # TRL stops one short of a prefix
    assert extract_prompt("abc ", "xyz") == ("", "abc ", "xyz")  # TRL would take "abc" as the prompt here
    user, blue, green = {"role": "user", "content": "sky?"}, {"role": "assistant", "content": "blue"}, {}
    assert extract_prompt([user, blue], [user, green]) == ([user], [blue], [green])


def test_max_prompt_length_keeps_the_prompt_end(tok):
    record = {"prompt": "one two three four five six seven eight", "chosen": " nine", "rejected": " ten"}
    whole = prepared([record], "preference", tok)[0]
    cut = prepared([record], "preference", tok, max_prompt_length=3)[0]
    assert cut["prompt_ids"] == whole["prompt_ids"][-3:] and cut["chosen_ids"] == whole["chosen_ids"]


# ------------------------------------------------------------------------------------------------------- errors
def test_every_bad_record_is_named_in_one_error(tmp_path, tok):
    records = [
        PAIRS[0],
        {"prompt": "a", "chosen": "b"},
        {"prompt": "a", "chosen": "same", "rejected": "same"},
        PAIRS[1],
    ]
    dm = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "bad.jsonl", records)), format="preference")
    with pytest.raises(GymUserError) as error:
        dm.prepare_data()
    lines = str(error.value).splitlines()
    assert lines[0].startswith("2 record(s) cannot be read as data.format 'preference', which takes prompt/chosen")
    assert lines[1].endswith("bad.jsonl record 2: it lacks 'rejected' (it has the fields ['chosen', 'prompt']).")
    assert "bad.jsonl record 3: its chosen equals its rejected: there is nothing to prefer" in lines[2]
    assert len(lines) == 3
    mixed = {"prompt": "text", "chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant"}]}
    with pytest.raises(GymUserError, match="set record 1: its 'chosen' is a message but its prompt is text"):
        prepared([mixed], "preference", tok)


def test_kto_record_without_label_or_completion_is_named(tok):
    with pytest.raises(GymUserError) as error:
        prepared([{"prompt": "a", "completion": "b", "label": None}, {"prompt": "a", "label": True}], "kto", tok)
    assert "set record 1: it lacks 'label' (or 'kto_tag')" in str(error.value)
    assert "set record 2: it lacks 'completion'" in str(error.value)
    with pytest.raises(GymUserError, match="set record 1: its label 'maybe' is not true or false"):
        prepared([{"prompt": "a", "completion": "b", "label": "maybe"}], "kto", tok)


def test_every_prompt_too_long_is_an_error_and_some_a_warning(tok):
    long = {"prompt": "word " * 40, "chosen": "a", "rejected": "b"}
    with pytest.raises(GymUserError, match="every example's prompt fills max_seq_length=16"):
        prepared([long], "preference", tok, max_length=16)
    with pytest.warns(UserWarning, match="dropped 1 of 2 examples whose prompt alone fills max_seq_length=16"):
        assert len(prepared([long, PAIRS[0]], "preference", tok, max_length=16)) == 1
    assert len(prepared([long, PAIRS[0]], "preference", tok, max_length=16, truncation_mode="keep_end")) == 2


# ------------------------------------------------------------------------------------------- kinds and settings
def test_batch_kind_before_and_after_preparation(tmp_path):
    pairs, kto = write_jsonl(tmp_path / "p.jsonl", PAIRS), write_jsonl(tmp_path / "k.jsonl", KTO)
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}])
    assert CausalLMDataModule(dataset="addition").batch_kind == "lm"
    assert CausalLMDataModule(train_files=str(sft)).batch_kind == "lm"
    dm = CausalLMDataModule(train_files=str(pairs))
    assert dm.batch_kind == "pairs" and dm._splits is None  # known without preparing the data
    dm.prepare_data()
    assert dm.batch_kind == "pairs"
    assert CausalLMDataModule(train_files=str(kto)).batch_kind == "unpaired"
    assert CausalLMDataModule(train_files=str(pairs), format="kto").batch_kind == "unpaired"
    mixed = CausalLMDataModule(sources=[DataSource(str(pairs)), DataSource(str(sft))])
    with pytest.raises(GymUserError, match=r"give different batches \(lm, pairs\)"):
        _ = mixed.batch_kind


def test_batch_kind_problem_is_one_line():
    assert batch_kind_problem("dpo", "pairs", "pairs") is None
    problem = batch_kind_problem("dpo", "pairs", "lm", objectives_for=["sft", "pt"])
    assert problem is not None and "\n" not in problem
    assert problem.startswith("model.objective 'dpo' trains on 'pairs' batches, from paired preference records")
    assert "but the data gives 'lm' batches" in problem and "(sft, pt)" in problem
    assert "data.format kto" in batch_kind_problem("kto", "unpaired", "pairs")
    assert "unknown batch kind" in batch_kind_problem("x", "triples", "lm")


def test_settings_that_do_not_fit_the_data_are_refused_together(tmp_path):
    with pytest.raises(GymUserError) as error:
        CausalLMDataModule(train_files="x.jsonl", format="preference", packing=True, mask_prompt=False)
    assert "does not work with packing, mask_prompt: false" in str(error.value)
    with pytest.raises(GymUserError) as error:
        CausalLMDataModule(train_files="x.jsonl", format="alpaca", truncation_mode="keep_end", max_prompt_length=600)
    message = str(error.value)
    assert "max_prompt_length=600 leaves no room" in message and "truncation_mode=keep_end" in message
    with pytest.raises(GymUserError, match="KTO rows keep their start"):
        CausalLMDataModule(train_files="x.jsonl", format="kto", truncation_mode="keep_end")
    # format auto: refused once the records say they are preference data
    auto = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "p.jsonl", PAIRS)), packing=True)
    with pytest.raises(GymUserError, match="does not work with packing"):
        auto.prepare_data()


def test_cache_key_of_other_data_is_the_former_one(tmp_path):
    """The preference settings enter the key only when set, so caches prepared before them stay valid."""
    path = str(write_jsonl(tmp_path / "s.jsonl", [{"instruction": "a", "output": "b"}]))
    dm = CausalLMDataModule(train_files=path, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    former = json.dumps({"bundled": None, "val": None, "format": "auto", "columns": None})
    assert dm._cache_entry.name == fingerprint(dm._train_sources(), dm.tokenizer, dm._settings(), former)
    pairs = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    names = set()
    for options in ({}, {"truncation_mode": "keep_end"}, {"max_prompt_length": 4}):
        other = CausalLMDataModule(train_files=pairs, cache_dir=str(tmp_path / "c"), **options)
        other.prepare_data()
        names.add(other._cache_entry.name)
    assert len(names) == 3


# ------------------------------------------------------------------------------------------------------ batches
def test_pairs_batch_layout(tok):
    rows = PreferenceRows(prepared(PAIRS[:3], "preference", tok))
    batch = PairCollator(tok.pad_token_id, 512)([{**rows[i], "reference_logps": [i, -i]} for i in range(3)])
    assert batch["input_ids"].shape[0] == 6
    for i in range(3):
        for row, key in ((i, "chosen"), (i + 3, "rejected")):
            length = int(batch["attention_mask"][row].sum())
            ids, labels = batch["input_ids"][row, :length].tolist(), batch["labels"][row].tolist()
            assert tok.decode(ids) == PAIRS[i]["prompt"] + PAIRS[i][key] + "<|endoftext|>"
            assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == PAIRS[i][key] + "<|endoftext|>"
            assert labels[length:] == [IGNORE_INDEX] * (len(labels) - length)
            assert batch["position_ids"][row, :length].tolist() == list(range(length))
    assert batch["reference_logps"].tolist() == [0, 1, 2, 0, -1, -2] and batch["reference_logps"].dtype == torch.float32


def test_unpaired_batch_has_kl_rows_of_trls_partners(tok):
    assert [kl_partner(i, 4, 10) for i in range(10)] == [3, 0, 1, 2, 7, 4, 5, 6, 9, 8]
    rows = PreferenceRows(prepared(KTO[:4], "kto", tok), kl_chunk=4)
    batch = UnpairedCollator(tok.pad_token_id, 512)([rows[i] for i in range(4)])
    assert batch["kto_labels"].tolist() == [True, False, True, False]
    kl_first = batch["input_ids"][4, : int(batch["attention_mask"][4].sum())].tolist()
    assert tok.decode(kl_first) == KTO[0]["prompt"] + KTO[3]["completion"] + "<|endoftext|>"


def test_loader_counts_pairs_and_resumes_mid_epoch(tmp_path):
    dm = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "p.jsonl", PAIRS)), batch_size=2, seed=3)
    dm.prepare_data()
    loader = dm.train_dataloader()
    loader.accumulate_grad_batches = 2
    first = list(loader)
    assert [int(b[STEP_PAIRS_KEY]) for b in first] == [4] * 6
    window = first[0]["labels"].ne(IGNORE_INDEX).sum() + first[1]["labels"].ne(IGNORE_INDEX).sum()
    assert int(first[0][STEP_TOKENS_KEY]) == int(window)
    # A fresh loader at the same epoch, interrupted after 3 batches, then resumed from its state.
    dm2 = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "p.jsonl", PAIRS)), batch_size=2, seed=3)
    interrupted = dm2.train_dataloader()
    interrupted.accumulate_grad_batches = 2
    seen = []
    for batch in interrupted:
        seen.append(batch)
        if len(seen) == 3:
            break
    state = interrupted.state_dict()
    resumed = dm2.train_dataloader()
    resumed.accumulate_grad_batches = 2
    resumed.sampler.epoch = interrupted.sampler.epoch - 1  # the interrupted pass's epoch, as Lightning restores it
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert isinstance(resumed, StepTokenDataLoader) and len(rest) == 3
    for mine, theirs in zip(seen + rest, first, strict=True):
        assert torch.equal(mine["input_ids"], theirs["input_ids"]) and int(mine[STEP_PAIRS_KEY]) == 4


def test_llama_factory_entries_map_through_columns(tmp_path):
    """What a dataset_info.json entry becomes (format + columns): ranking sharegpt with its own column names, and a
    kto_tag entry whose tag column is mapped onto label."""
    ranking = [
        {
            "conv": [{"from": "human", "value": f"{i}+{i}?"}],
            "better": {"from": "gpt", "value": str(2 * i)},
            "worse": {"from": "gpt", "value": "?"},
        }
        for i in range(6)
    ]
    columns = {"conversations": "conv", "chosen": "better", "rejected": "worse"}
    dm = CausalLMDataModule(
        train_files=str(write_jsonl(tmp_path / "r.jsonl", ranking)), format="preference", columns=columns
    )
    batch = next(iter(dm.train_dataloader()))
    assert dm.batch_kind == "pairs" and batch["input_ids"].shape[0] == 12
    kto = [{"instruction": f"{i}+{i}?", "output": str(2 * i), "feedback": i % 2 == 0} for i in range(6)]
    dm = CausalLMDataModule(
        train_files=str(write_jsonl(tmp_path / "k.jsonl", kto)), format="kto", columns={"label": "feedback"}
    )
    assert dm.batch_kind == "unpaired" and next(iter(dm.train_dataloader()))["kto_labels"].shape == (6,)
