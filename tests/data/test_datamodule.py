"""Data side: sources, formats, collation, packing, bundled data set and the data module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.data_samples import tokenize_record, tokenize_records
from helpers.targets import target_runs

from gym_lightning.data.collate import Collator, pack_samples
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.formats import FORMATS, TokenizedSample, detect_format, resolve_format, tokenize_prompt
from gym_lightning.data.loader import STEP_TOKENS_KEY
from gym_lightning.data.sources import Record, read_records
from gym_lightning.data.synthetic import BUNDLED_DATASETS, addition, addition_preference
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.tokenizer import load_tokenizer


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    """Tokenized data goes to a per-test cache (the data module's default is ~/.cache/gym_lightning/data)."""
    monkeypatch.setenv("GYM_DATA_CACHE", str(tmp_path / "data-cache"))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def targets(sample: TokenizedSample) -> list[int]:
    return [label for label in sample.labels if label != IGNORE_INDEX]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
}


# ----------------------------------------------------------------------------------------------------- sources


def test_read_jsonl_json_and_text(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    (tmp_path / "b.json").write_text(json.dumps([{"text": "three"}]))
    (tmp_path / "c.txt").write_text("para one\nstill one\n\n\n  para two \n")
    records = read_records(str(tmp_path / "*"))
    assert [r.data["text"] for r in records] == ["one", "two", "three", "para one\nstill one", "para two"]
    assert records[1].origin.endswith("a.jsonl:2")
    assert records[4].origin.endswith("c.txt:5")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        read_records(str(path))


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"text": "ok"},\n  {"text": }\n]')
    with pytest.raises(ValueError, match=r"bad\.json:3: invalid JSON"):
        read_records(str(path))


def test_non_object_record_is_rejected(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"list\.jsonl:2: expected a JSON object"):
        read_records(str(path))


def test_glob_matching_nothing_and_empty_data_set(tmp_path):
    with pytest.raises(ValueError, match="No data file matches"):
        read_records(str(tmp_path / "*.jsonl"))
    with pytest.raises(ValueError, match="No data file matches"):
        read_records(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        read_records(str(tmp_path / "empty.jsonl"))
    (tmp_path / "data.xml").write_text("<a/>\n")
    with pytest.raises(ValueError, match="Unsupported data file"):
        read_records(str(tmp_path / "data.xml"))


# ----------------------------------------------------------------------------------------------------- formats


def test_prompt_completion_masks_exactly_the_prompt(tok):
    record = Record({"prompt": "23+45=", "completion": "68"}, "r:1")
    sample = tokenize_record(record, "prompt_completion", tok, 64)
    prompt_ids = encode(tok, "23+45=")
    assert sample.input_ids == [*prompt_ids, *encode(tok, "68"), tok.eos_token_id]
    assert sample.labels == [IGNORE_INDEX] * len(prompt_ids) + [*encode(tok, "68"), tok.eos_token_id]
    assert sample.prompt_ids == prompt_ids
    assert (sample.prompt, sample.reference) == ("23+45=", "68")
    unmasked = tokenize_record(record, "prompt_completion", tok, 64, mask_prompt=False)
    assert unmasked.labels == unmasked.input_ids


def test_alpaca_template_and_masking(tok):
    with_input = Record({"instruction": "Add.", "input": "1 and 2", "output": "3"}, "r:1")
    sample = tokenize_record(with_input, "alpaca", tok, 256)
    assert sample.prompt == "### Instruction:\nAdd.\n\n### Input:\n1 and 2\n\n### Response:\n"
    assert targets(sample) == [*encode(tok, "3"), tok.eos_token_id]
    assert tok.decode(sample.input_ids) == sample.prompt + "3<|endoftext|>"
    no_input = tokenize_record(
        Record({"instruction": "Say hi.", "input": "", "output": "hi"}, "r:2"), "alpaca", tok, 256
    )
    assert no_input.prompt == "### Instruction:\nSay hi.\n\n### Response:\n"
    assert no_input.reference == "hi"


def test_text_format_trains_on_every_token(tok):
    sample = tokenize_record(Record({"text": "hello world"}, "r:1"), "text", tok, 64)
    assert sample.input_ids == [*encode(tok, "hello world"), tok.eos_token_id]
    assert sample.labels == sample.input_ids
    assert sample.prompt_ids is None and sample.reference is None


def test_chat_targets_are_the_assistant_turns(tok):
    sample = tokenize_record(Record(CHAT, "r:1"), "chat", tok, 256)
    rendered = tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tok.decode(sample.input_ids) == rendered  # no eos after the template's end-of-turn token
    # Contiguous runs of targets: each assistant turn (content + its end-of-turn token).
    assert target_runs(sample.input_ids, sample.labels, tok) == ["4<|im_end|>", "6<|im_end|>"]
    # The reference is the last assistant turn; the prompt is everything before it plus the generation prompt.
    assert sample.reference == "6"
    assert sample.prompt == tok.apply_chat_template(CHAT["messages"][:-1], tokenize=False, add_generation_prompt=True)
    assert sample.input_ids[: len(sample.prompt_ids)] == sample.prompt_ids


def test_chat_without_template_is_a_clear_error(tok):
    template = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(ValueError, match="chat template"):
            tokenize_record(Record(CHAT, "r:1"), "chat", tok, 256)
    finally:
        tok.chat_template = template


def test_bad_messages_name_the_record(tok):
    with pytest.raises(ValueError, match=r"f\.jsonl:7: 'messages' must be"):
        tokenize_record(Record({"messages": "hi"}, "f.jsonl:7"), "chat", tok, 256)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"messages": [{"role": "user", "content": "a"}]}, "messages"),
        ({"messages": [{"from": "human", "value": "a"}]}, "sharegpt"),
        ({"conversations": [{"from": "human", "value": "a"}]}, "sharegpt"),
        ({"instruction": "a", "input": "", "output": "b"}, "alpaca"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"text": "a", "meta": 1}, "text"),
    ],
)
def test_auto_detection(fields, expected):
    assert detect_format(Record(fields, "r:1")) == expected
    assert resolve_format("auto", [Record(fields, "r:1")]) == expected


def test_auto_detection_failure_lists_expected_fields():
    with pytest.raises(ValueError, match=r"r:1: cannot detect.*\['question'\].*prompt_completion: prompt, completion"):
        detect_format(Record({"question": "a"}, "r:1"))


def test_unknown_format_lists_valid_ones():
    valid = "auto, text, alpaca, sharegpt, messages, chat, prompt_completion, preference, kto"
    with pytest.raises(ValueError, match=f"valid formats are: {valid}"):
        resolve_format("oasst", [Record({"text": "a"}, "r:1")])
    assert tuple(valid.split(", ")) == FORMATS
    assert resolve_format("chat", [Record({"text": "a"}, "r:1")]) == "messages"  # the former name is an alias


def test_missing_field_names_record_field_and_expected(tok):
    with pytest.raises(ValueError) as info:
        tokenize_record(Record({"prompt": "a", "answer": "b"}, "data.jsonl:12"), "prompt_completion", tok, 64)
    message = str(info.value)
    assert "data.jsonl:12" in message and "'completion'" in message and "prompt, completion" in message


def test_non_string_field_is_rejected(tok):
    with pytest.raises(ValueError, match=r"r:1: field 'completion' must be a string, got int"):
        tokenize_record(Record({"prompt": "1+1=", "completion": 2}, "r:1"), "prompt_completion", tok, 64)


def test_truncation_and_dropping_samples_without_targets(tok):
    long_text = Record({"text": "word " * 100}, "r:1")
    assert len(tokenize_record(long_text, "text", tok, 16).input_ids) == 16
    records = [
        Record({"prompt": "x" * 50, "completion": "y"}, "r:1"),  # prompt fills max_seq_length: no target left
        Record({"prompt": "1+1=", "completion": "2"}, "r:2"),
    ]
    with pytest.warns(UserWarning, match="Dropped 1 of 2 samples"):
        kept = tokenize_records(records, "prompt_completion", tok, 8)
    assert len(kept) == 1 and kept[0].reference == "2"
    with pytest.raises(ValueError, match="No sample has a target"):
        tokenize_records(records[:1], "prompt_completion", tok, 8)


def test_predict_prompts(tok):
    sample = tokenize_prompt(Record({"instruction": "Add.", "input": "1 and 2"}, "r:1"), "alpaca", tok, 64)
    assert sample.prompt.endswith("### Response:\n") and sample.reference is None
    assert sample.input_ids == sample.prompt_ids and set(sample.labels) == {IGNORE_INDEX}
    chat = tokenize_prompt(Record({"messages": CHAT["messages"][:2]}, "r:2"), "chat", tok, 64)
    assert tok.decode(chat.prompt_ids).endswith("<|im_start|>assistant\n")
    assert detect_format(Record({"prompt": "1+1="}, "r:3"), for_predict=True) == "prompt_completion"


# ------------------------------------------------------------------------------------------- collate and packing


def sample(ids: list[int], prompt_len: int = 0) -> TokenizedSample:
    labels = [IGNORE_INDEX] * prompt_len + ids[prompt_len:]
    return TokenizedSample(ids, labels, prompt_ids=ids[:prompt_len] or None, prompt="p", reference="r")


def test_collate_right_pads_and_left_pads_prompts():
    batch = Collator(pad_token_id=0, with_prompts=True)([sample([5, 6, 7, 8], 2), sample([9, 10, 11], 1)])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, 11, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert batch["prompt_input_ids"].tolist() == [[5, 6], [0, 9]]
    assert batch["prompt_attention_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["references"] == ["r", "r"] and batch["prompts"] == ["p", "p"]
    assert all(batch[k].dtype == torch.long for k in ("input_ids", "attention_mask", "labels", "position_ids"))
    plain = Collator(pad_token_id=0)([sample([5, 6, 7, 8], 2)])
    assert set(plain) == {"input_ids", "attention_mask", "labels", "position_ids"}


def test_packing_restarts_positions_masks_first_tokens_and_loses_nothing():
    samples = [
        TokenizedSample(list(range(10 * i, 10 * i + n)), list(range(10 * i, 10 * i + n)))
        for i, n in enumerate([3, 4, 2, 5, 1])
    ]
    rows = pack_samples(samples, max_seq_length=7)
    assert [len(r.input_ids) for r in rows] == [7, 7, 1]
    assert [t for r in rows for t in r.input_ids] == [t for s in samples for t in s.input_ids]
    assert rows[0].position_ids == [0, 1, 2, 0, 1, 2, 3]
    assert rows[0].labels == [-100, 1, 2, -100, 11, 12, 13]
    assert rows[1].position_ids == [0, 1, 0, 1, 2, 3, 4]
    assert rows[1].labels == [-100, 21, -100, 31, 32, 33, 34]
    batch = Collator(pad_token_id=0)(rows)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert batch["attention_mask"][2].tolist() == [1, 0, 0, 0, 0, 0, 0]


# ------------------------------------------------------------------------------------------------ bundled data


def test_addition_split_is_fixed_disjoint_and_complete():
    first, second = addition(), addition()
    assert [r.data for r in first.train] == [r.data for r in second.train]
    assert [r.data for r in first.val] == [r.data for r in second.val]
    train = {r.data["prompt"] for r in first.train}
    val = {r.data["prompt"] for r in first.val}
    assert len(train) == 9000 and len(val) == 1000 and not train & val
    assert len(train | val) == 10_000
    assert {"prompt": "23+45=", "completion": "068"} in [r.data for r in first.train + first.val]
    assert set(BUNDLED_DATASETS) == {"addition", "addition_preference"}
    # The held-out pairs are a spread sample, not a block.
    assert len({r.data["prompt"].split("+")[0] for r in first.val}) > 90


def test_addition_preference_pairs_the_right_sum_against_a_near_miss(tmp_path):
    sums, pairs = addition(), addition_preference()
    assert pairs.format == "preference" and addition_preference().train == pairs.train  # seeded, fixed
    for plain, pair in zip(sums.train + sums.val, pairs.train + pairs.val, strict=True):
        record = pair.data
        assert record["prompt"] == plain.data["prompt"] and record["chosen"] == plain.data["completion"]
        assert len(record["rejected"]) == 3 and abs(int(record["rejected"]) - int(record["chosen"])) in (1, 10)
    assert len({int(p.data["rejected"]) - int(p.data["chosen"]) for p in pairs.train}) == 4  # all four near misses
    dm = CausalLMDataModule(dataset="addition_preference", batch_size=4, eval_batch_size=3, cache_dir=str(tmp_path))
    assert dm.batch_kind == "pairs"  # known before preparing: the command line checks it against the objective
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and dm.batch_kind == "pairs"  # chosen rows, then rejected rows


# ------------------------------------------------------------------------------------------------- data module


def test_all_config_problems_in_one_message():
    with pytest.raises(ValueError) as info:
        CausalLMDataModule(val_split=1.5, batch_size=0, format="oasst", max_seq_length=1, dataset="nope")
    message = str(info.value)
    for expected in ("dataset='nope'", "val_split=1.5", "batch_size=0", "format='oasst'", "max_seq_length=1"):
        assert expected in message, expected
    with pytest.raises(ValueError, match="not dataset and train_files"):
        CausalLMDataModule(dataset="addition", train_files="x.jsonl")
    with pytest.raises(ValueError, match="no data"):
        CausalLMDataModule()
    with pytest.raises(ValueError, match="val_split only applies"):
        CausalLMDataModule(dataset="addition", val_split=0.1)


def test_addition_datamodule_batches(tok):
    dm = CausalLMDataModule(dataset="addition", batch_size=4, eval_batch_size=3)
    dm.setup("fit")
    assert dm.vocab_size == 512
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 10
    assert batch[STEP_TOKENS_KEY] == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[0] == 3
    for prompt_ids, prompt, reference in zip(val["prompt_input_ids"], val["prompts"], val["references"], strict=True):
        a, b = prompt.rstrip("=").split("+")
        assert int(reference) == int(a) + int(b)
        assert tok.decode(prompt_ids, skip_special_tokens=True) == prompt
    assert len(dm.val_dataloader().dataset) == 1000


def test_shuffle_is_deterministic_per_seed():
    def first_batches(seed: int) -> list[list[list[int]]]:
        dm = CausalLMDataModule(dataset="addition", batch_size=8, seed=seed)
        loader = dm.train_dataloader()
        epoch_one = [b["input_ids"].tolist() for _, b in zip(range(3), loader, strict=False)]
        epoch_two = [b["input_ids"].tolist() for _, b in zip(range(3), loader, strict=False)]
        assert epoch_one != epoch_two  # a new order every epoch
        return epoch_one + epoch_two

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_step_token_windows_with_partial_last_window(tmp_path):
    records = [{"prompt": "1+1=", "completion": "2" * (i + 1)} for i in range(7)]
    dm = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "t.jsonl", records)), batch_size=2)
    loader = dm.train_dataloader()
    loader.accumulate_grad_batches = 3  # as if trainer.accumulate_grad_batches were 3
    batches = list(loader)
    assert len(batches) == 4  # windows of 3 batches and 1 batch
    counts = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches]
    assert [int(b[STEP_TOKENS_KEY]) for b in batches] == [sum(counts[:3])] * 3 + [counts[3]]
    assert sum(counts) == sum(len(r["completion"]) + 1 for r in records)


def test_files_val_split_packing_and_predict(tmp_path):
    records = [{"instruction": f"Echo {i}.", "output": str(i)} for i in range(20)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    write_jsonl(tmp_path / "predict.jsonl", [{"instruction": "Echo 5."}, {"instruction": "Echo 6."}])
    dm = CausalLMDataModule(
        train_files=str(train),
        val_split=0.25,
        packing=True,
        max_seq_length=64,
        predict_files=str(tmp_path / "p*.jsonl"),
    )
    dm.setup("fit")
    train_rows, val = dm.train_dataloader().dataset, dm.val_dataloader().dataset
    assert len(val) == 5 and "seq_lens" not in val.column_names
    assert len(train_rows) < 15 and all(len(ids) <= 64 for ids in train_rows["input_ids"])
    assert sum(len(lens) for lens in train_rows["seq_lens"]) == 15
    val_outputs = set(val["reference"])
    again = CausalLMDataModule(train_files=str(train), val_split=0.25, cache_dir=str(tmp_path / "other"))
    assert set(again.val_dataloader().dataset["reference"]) == val_outputs  # seeded split
    predict = next(iter(dm.predict_dataloader()))
    assert predict["prompts"][0] == "### Instruction:\nEcho 5.\n\n### Response:\n"
    assert predict["prompt_input_ids"].shape[0] == 2 and "references" not in predict


def test_no_validation_data_gives_no_val_batches(tmp_path):
    dm = CausalLMDataModule(train_files=str(write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}])))
    assert dm.val_dataloader() == []
    with pytest.raises(ValueError, match="nothing to predict"):
        dm.predict_dataloader()


def test_missing_field_in_file_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    dm = CausalLMDataModule(train_files=str(path))
    with pytest.raises(ValueError, match=r"t\.jsonl record 2: the 'prompt_completion' format needs"):
        dm.setup("fit")


TWO_RANK_SCRIPT = """
import json, sys
import torch
from lightning.pytorch import LightningModule, Trainer
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.loader import StepTokenDataLoader

torch.set_num_threads(1)


class Recorder(LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        loader = self.trainer.train_dataloader
        self.seen.append({
            "prompts": batch["input_ids"].tolist(),
            "step_tokens": int(batch["step_target_tokens"]),
            "tokens": int((batch["labels"][:, 1:] != -100).sum()),
            "loader": type(loader).__name__,
            "accumulate": loader.accumulate_grad_batches,
            "sampler": type(loader.sampler).__name__,
            "replicas": loader.sampler.num_replicas,
        })
        return (self.weight * 0).sum() + self.weight.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


dm = CausalLMDataModule(train_files=sys.argv[1], batch_size=2)
model = Recorder()
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, accumulate_grad_batches=2,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, dm)
with open(f"{sys.argv[2]}.{trainer.global_rank}", "w") as f:
    json.dump(model.seen, f)
"""


@pytest.mark.slow
def test_two_ranks_get_a_distributed_step_token_loader(tmp_path):
    """Lightning re-creates StepTokenDataLoader with a DistributedSampler and keeps accumulate_grad_batches."""
    records = [{"prompt": f"{i}+0=", "completion": str(i) * (1 + i % 3)} for i in range(16)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    script = tmp_path / "run.py"
    script.write_text(TWO_RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script), str(train), str(tmp_path / "seen")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in (0, 1)]
    for rank_batches in seen:
        assert len(rank_batches) == 4  # 16 samples / 2 ranks / batch 2
        # The data module's own distributed sampler (one permutation dealt out to the ranks), kept by Lightning.
        assert {(b["loader"], b["accumulate"], b["sampler"], b["replicas"]) for b in rank_batches} == {
            ("StepTokenDataLoader", 2, "EpochShuffleSampler", 2)
        }
        for window in (rank_batches[:2], rank_batches[2:]):
            assert [b["step_tokens"] for b in window] == [sum(b["tokens"] for b in window)] * 2
    rows = [tuple(row) for rank_batches in seen for b in rank_batches for row in b["prompts"]]
    assert len(rows) == 16 and len(set(rows)) == 16  # the ranks see disjoint samples covering the data set


def test_batches_are_pinned_when_training_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaders pin on CUDA, as HF's do: a pageable batch's copy to the GPU is staged through a pinned buffer and
    returns only once staged, which can wait for the GPU's queued work. Shows the decision only (the transfer's
    asynchrony needs a GPU: docs/testing-cuda-semantics.md)."""
    from types import SimpleNamespace

    pinned: list[torch.Size] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pinned.append(t.shape) or t)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # a CUDA machine, as far as pinning goes
    data = CausalLMDataModule(dataset="addition", batch_size=4)
    data.prepare_data()
    data.setup("fit")
    for device, expected in (("cpu", False), ("cuda", True)):
        strategy = SimpleNamespace(root_device=torch.device(device), distributed_sampler_kwargs=None)
        data.trainer = SimpleNamespace(strategy=strategy, accumulate_grad_batches=2)
        loader = data.train_dataloader()
        assert loader.pin_memory is expected
        pinned.clear()
        batch = next(iter(loader))
        assert batch["step_target_tokens"].numel() == 1
        assert (torch.Size([]) in pinned) is expected  # the step's token count, added after the DataLoader pinned
    assert CausalLMDataModule(dataset="addition", pin_memory=False)._pins() is False
