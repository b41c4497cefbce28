"""Precomputed reference log-probabilities: stored with the prepared data, reused on resume, redone for another
model or data, delivered in batch row order, and computed together by all ranks (2 gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.dist import HELPERS, REPO_ROOT, rank_env
from helpers.reference_worker import fake_logps

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.reference import model_fingerprint, rank_rows
from gym_lightning.errors import GymUserError

PAIRS = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(10)]
KTO = [{"prompt": f"{i}+{i}=", "completion": str(2 * i + i % 2), "label": i % 2 == 0} for i in range(10)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


class Counting:
    """``fake_logps`` that counts the rows it ran (or refuses to run)."""

    def __init__(self, allowed: bool = True) -> None:
        self.rows, self.allowed = 0, allowed

    def __call__(self, batch: dict) -> torch.Tensor:
        assert self.allowed, "the reference ran although its values were stored"
        self.rows += len(batch["input_ids"]) // 2
        return fake_logps(batch)


def module(path: Path, cache: Path, **options) -> CausalLMDataModule:
    options = {"val_split": 0.2, "batch_size": 3, "cache_dir": str(cache), **options}
    return CausalLMDataModule(train_files=str(path), **options)


@pytest.mark.parametrize("records", [PAIRS, KTO], ids=["pairs", "unpaired"])
def test_batches_carry_the_values_of_their_own_rows(tmp_path, records):
    dm = module(write_jsonl(tmp_path / "d.jsonl", records), tmp_path / "c")
    loader = dm.train_dataloader()  # made before the precompute: rows read the values when they are fetched
    reference = Counting()
    dm.precompute_reference_logps(reference, reference_id="a", batch_size=4)
    assert reference.rows == 10  # train and validation rows, once each
    for batch in [*loader, *dm.val_dataloader()]:
        expected = fake_logps(batch)  # the same rows, in the batch's order (chosen/completion rows, then the others)
        assert torch.allclose(batch["reference_logps"], expected) and batch["reference_logps"].shape == (len(expected),)


def test_a_resume_reuses_the_values_and_another_model_or_data_recomputes(tmp_path):
    path, cache = write_jsonl(tmp_path / "d.jsonl", PAIRS), tmp_path / "c"
    first = module(path, cache)
    first.precompute_reference_logps(Counting(), reference_id="a")
    again = module(path, cache)
    again.precompute_reference_logps(Counting(allowed=False), reference_id="a")
    assert all(np.array_equal(first._references[k], again._references[k]) for k in ("train", "val"))
    for options, reference_id in (({}, "b"), ({"max_seq_length": 64}, "a"), ({"truncation_mode": "keep_end"}, "a")):
        other = Counting()
        module(path, cache, **options).precompute_reference_logps(other, reference_id=reference_id)
        assert other.rows == 10
    # KTO's KL rows depend on the batch size (the partners' chunks): another batch size, other values.
    kto = write_jsonl(tmp_path / "k.jsonl", KTO)
    module(kto, cache).precompute_reference_logps(Counting(), reference_id="a")
    counted = Counting()
    module(kto, cache, batch_size=2).precompute_reference_logps(counted, reference_id="a")
    assert counted.rows == 10


def test_refusals_and_fingerprints(tmp_path):
    sft = module(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}] * 5), tmp_path / "c")
    with pytest.raises(GymUserError, match="needs preference data"):
        sft.precompute_reference_logps(Counting(), reference_id="a")
    pairs = module(write_jsonl(tmp_path / "d.jsonl", PAIRS), tmp_path / "c")
    with pytest.raises(GymUserError, match="needs a reference_id"):
        pairs.precompute_reference_logps(Counting(), reference_id="")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"1")
    before = model_fingerprint(str(folder), dtype="bfloat16")
    assert before != model_fingerprint(str(folder), dtype="float32")
    (folder / "model.safetensors").write_bytes(b"22")
    assert before != model_fingerprint(str(folder), dtype="bfloat16")
    assert sorted(rank_rows(5, 0, 2) + rank_rows(5, 1, 2)) == [0, 0, 1, 2, 3, 4]  # wrapped: equal shares


@pytest.mark.slow
def test_two_ranks_compute_their_shares_and_agree_to_skip_or_recompute(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    single = module(data, tmp_path / "single", batch_size=2, val_split=0.25)
    single.precompute_reference_logps(Counting(), reference_id="model-a")
    spec = json.dumps({"data": str(data), "cache": str(tmp_path / "cache"), "out": str(tmp_path)})
    env = rank_env()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "reference_worker.py"), str(rank), spec], cwd=REPO_ROOT, env=env
        )
        for rank in range(2)
    ]
    assert [rank.wait(timeout=240) for rank in ranks] == [0, 0]
    outs = [json.loads((tmp_path / f"out-{rank}.json").read_text()) for rank in range(2)]
    expected = {k: v.tolist() for k, v in single._references.items()}
    for passes in outs:
        assert [p["values"] for p in passes] == [expected] * 3
    # 8 training + 2 validation rows: 4 + 1 per rank when computing, none when both ranks have the file.
    assert [[p["rows"] for p in passes] for passes in outs] == [[5, 0, 5], [5, 0, 5]]
