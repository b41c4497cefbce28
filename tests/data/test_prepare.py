"""The datasets pipeline: file kinds, formats, column mapping, mixing, the cache, and tokenizing once per node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from helpers.data_samples import tokenize_record
from helpers.dist import TESTS

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.prepare import DataSource, mix
from gym_lightning.data.sources import Record
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.tokenizer import load_tokenizer

ALPACA = [{"instruction": f"Echo {i}.", "output": str(i)} for i in range(12)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_alpaca_system_and_history_are_rendered_and_every_output_trained():
    tok = load_tokenizer(None)
    record = Record(
        {"system": "Be terse.", "history": [["Say a.", "a"]], "instruction": "Say b.", "output": "b"}, "r:1"
    )
    sample = tokenize_record(record, "alpaca", tok, 256)
    assert (
        sample.prompt
        == "Be terse.\n\n### Instruction:\nSay a.\n\n### Response:\na\n\n### Instruction:\nSay b.\n\n### Response:\n"
    )
    targets = tok.decode([label for label in sample.labels if label != IGNORE_INDEX])
    assert targets == "ab<|endoftext|>"
    assert tok.decode(sample.input_ids) == sample.prompt + "b<|endoftext|>"


def test_file_kinds_column_mapping_and_cache_hit(tmp_path, caplog):
    renamed = [{"question": r["instruction"], "answer": r["output"]} for r in ALPACA]
    datasets.Dataset.from_list(renamed).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(renamed).to_csv(str(tmp_path / "b.csv"), index=False)
    rows = {}
    for name in ("a.parquet", "b.csv"):
        dm = CausalLMDataModule(
            train_files=str(tmp_path / name),
            columns={"instruction": "question", "output": "answer"},
            cache_dir=str(tmp_path / "cache"),
        )
        dm.prepare_data()
        rows[name] = dm.train_dataloader().dataset
    assert rows["a.parquet"]["input_ids"] == rows["b.csv"]["input_ids"] and len(rows["b.csv"]) == 12
    assert rows["a.parquet"].features["input_ids"].feature.dtype == "int32"
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name != "hf"]
    assert len(entries) == 2  # one per file (different fingerprints)
    again = CausalLMDataModule(
        train_files=str(tmp_path / "a.parquet"),
        columns={"instruction": "question", "output": "answer"},
        cache_dir=str(tmp_path / "cache"),
    )
    stamp = {p: (p / "done.json").stat().st_mtime_ns for p in entries}
    assert again.train_dataloader().dataset["input_ids"] == rows["a.parquet"]["input_ids"]
    assert {p: (p / "done.json").stat().st_mtime_ns for p in entries} == stamp  # reused, not rebuilt
    with pytest.raises(ValueError, match="columns maps onto \\['nope'\\]"):
        CausalLMDataModule(
            train_files=str(tmp_path / "a.parquet"), columns={"output": "nope"}, cache_dir=str(tmp_path / "cache")
        ).prepare_data()


def test_mix_with_weights_and_caps(tmp_path):
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(30)])
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}=", "completion": str(i)} for i in range(30)])
    dm = CausalLMDataModule(
        sources=[DataSource(str(texts), max_samples=4), DataSource(str(pairs), weight=1.0, max_samples=4)],
        cache_dir=str(tmp_path / "cache"),
    )
    train = dm.train_dataloader().dataset
    tok = dm.tokenizer
    decoded = [tok.decode(ids) for ids in train["input_ids"]]
    docs = {d for d in decoded if d.startswith("doc")}
    assert docs == {f"doc {i}<|endoftext|>" for i in range(4)}  # capped at 4, every one drawn
    assert {d for d in decoded if "=" in d} == {f"{i}={i}<|endoftext|>" for i in range(4)}
    with pytest.raises(ValueError, match=r"sources\[0\].weight=0"):
        CausalLMDataModule(sources=[DataSource(str(texts), weight=0)])


def entry_of(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and p.name != "hf"]
    return entry


def test_the_cache_entry_holds_the_tokenized_rows_once(tmp_path):
    """Dataset.map writes into the cache entry (2 num_proc workers: 2 files), and those files are the entry: no copy
    by save_to_disk, nothing left in datasets' own cache folder; a mix is written out in the mix's order."""
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(40)])
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}=", "completion": str(i)} for i in range(40)])
    dm = CausalLMDataModule(train_files=str(texts), val_split=0.25, num_proc=2, cache_dir=str(tmp_path / "one"))
    dm.prepare_data()
    entry = entry_of(tmp_path / "one")
    done = json.loads((entry / "done.json").read_text())
    assert done["train"] == {"rows": 30, "files": ["train-0_00000_of_00002.arrow", "train-0_00001_of_00002.arrow"]}
    assert done["val"]["rows"] == 10 and len(done["val"]["files"]) == 2
    assert sorted(p.name for p in entry.iterdir()) == sorted(
        ["done.json", *done["train"]["files"], *done["val"]["files"]]
    )
    assert not list((tmp_path / "one" / "hf").rglob("cache-*.arrow"))  # datasets' map cache: not written
    decoded = [dm.tokenizer.decode(ids) for ids in dm.train_dataloader().dataset["input_ids"]]
    assert len(set(decoded)) == 30 and all(d.startswith("doc ") for d in decoded)

    parts = []
    for path in (texts, pairs):
        single = CausalLMDataModule(train_files=str(path), cache_dir=str(tmp_path / "parts"))
        parts.append(single.train_dataloader().dataset)
    mixed = CausalLMDataModule(sources=[DataSource(str(texts)), DataSource(str(pairs))], cache_dir=str(tmp_path / "m"))
    train = mixed.train_dataloader().dataset
    expected = mix(parts, [1.0, 1.0], mixed.seed)
    assert train["input_ids"] == expected["input_ids"]
    assert train["input_ids"][:40] != parts[0]["input_ids"]  # mixed, not one set after the other
    assert json.loads((entry_of(tmp_path / "m") / "done.json").read_text())["train"]["files"] == ["train.arrow"]

    packed = CausalLMDataModule(train_files=str(texts), packing=True, cache_dir=str(tmp_path / "packed"))
    packed.prepare_data()
    entry = entry_of(tmp_path / "packed")
    assert sorted(p.name for p in entry.iterdir()) == ["done.json", "packed.arrow"]  # the tokenized rows: removed
    assert sum(len(row) for row in packed.train_dataloader().dataset["seq_lens"]) == 40


def test_hub_name_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    dm = CausalLMDataModule(train_files="someone/no-such-dataset", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="could not be fetched from the Hugging Face Hub"):
        dm.prepare_data()


TOKENIZE_ONCE = """
import sys, time
from filelock import FileLock
from gym_lightning.data.datamodule import CausalLMDataModule
dm = CausalLMDataModule(train_files=sys.argv[1], cache_dir=sys.argv[2])
dm.prepare_data()
print(len(dm.train_dataloader().dataset))
"""


@pytest.mark.slow
def test_two_processes_tokenize_once(tmp_path):
    """Two processes started together (as two local ranks before any process group): one builds, one waits."""
    train = write_jsonl(tmp_path / "t.jsonl", ALPACA)
    script = tmp_path / "run.py"
    script.write_text(TOKENIZE_ONCE)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(train), str(tmp_path / "cache")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == ["12", "12"]
    logs = "".join(err + out for out, err in outputs)
    assert logs.count("Tokenizing the data into the cache") == 1 and logs.count("Using the tokenized data cached") == 1


def test_streaming_resumes_exactly_where_the_checkpoint_was_taken(tmp_path):
    records = [{"prompt": f"{i}+0=", "completion": str(i)} for i in range(40)]
    train = write_jsonl(tmp_path / "t.jsonl", records)
    dm = CausalLMDataModule(train_files=str(train), streaming=True, batch_size=3, cache_dir=str(tmp_path / "c"))
    loader = dm.train_dataloader()
    everything = [batch["input_ids"].tolist() for batch in loader]
    assert sum(len(b) for b in everything) == 40 and dm.val_dataloader() == []
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    state = loader.state_dict()  # as Lightning saves it in a checkpoint, after the 4th batch
    resumed = CausalLMDataModule(train_files=str(train), streaming=True, batch_size=3, cache_dir=str(tmp_path / "c"))
    fresh = resumed.train_dataloader()
    fresh.load_state_dict(state)
    assert [batch["input_ids"].tolist() for batch in fresh] == everything[4:]
    with pytest.raises(ValueError, match="streaming: true does not work with packing"):
        CausalLMDataModule(train_files=str(train), streaming=True, packing=True)
