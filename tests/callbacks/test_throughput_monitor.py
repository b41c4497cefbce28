"""ThroughputCallback: rate arithmetic, sliding window, and exact counts in a real (1-process) Trainer run."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.tiny import TINY, TinyLM
from torch.utils.data import DataLoader, Sampler

from gym_lightning.callbacks import ThroughputCallback
from gym_lightning.errors import GymUserError
from gym_lightning.loss import count_target_tokens
from gym_lightning.metrics.flops import transformer_flops
from gym_lightning.metrics.throughput import Counters, Sample, SlidingWindow, batch_counts, rates


def _sample(time: float, steps: int, tokens: int, world: int = 2, flops: float | None = None) -> Sample:
    local = Counters(steps, samples=steps * 4, tokens=tokens, target_tokens=tokens // 2, flops=flops)
    job = Counters(steps, samples=steps * 4 * world, tokens=tokens * world, target_tokens=tokens, flops=None)
    if flops is not None:
        job = Counters(steps, steps * 4 * world, tokens * world, tokens, flops * world)
    return Sample(time, local, job)


def test_rates_job_device_local_and_mfu() -> None:
    start, end = _sample(10.0, 0, 0, flops=0.0), _sample(12.0, 4, 1000, flops=4e12)
    out = rates(start, end, world_size=2, peak_flops=1e12)
    assert out["tokens_per_sec"] == 1000  # 2000 job tokens in 2 s
    assert out["device_tokens_per_sec"] == 500
    assert out["local_tokens_per_sec"] == 500
    assert out["target_tokens_per_sec"] == 500
    assert out["samples_per_sec"] == 16
    assert out["optimizer_steps_per_sec"] == 2
    assert out["device_tflops_per_sec"] == pytest.approx(2.0)  # 8e12 job FLOPs / 2 s / 2 devices
    assert out["mfu"] == pytest.approx(2.0)  # 2e12 per device over a 1e12 peak


def test_unknown_flops_or_peak_give_none() -> None:
    out = rates(_sample(0.0, 0, 0), _sample(1.0, 1, 10), world_size=2, peak_flops=1e12)
    assert out["flops_per_sec"] is None and out["mfu"] is None
    out = rates(_sample(0.0, 0, 0, flops=0.0), _sample(1.0, 1, 10, flops=1.0), world_size=2, peak_flops=None)
    assert out["device_flops_per_sec"] == 1.0 and out["mfu"] is None


def test_sliding_window_keeps_last_window_steps() -> None:
    window = SlidingWindow(window_steps=3)
    for step in range(6):
        window.append(_sample(float(step), step, 100 * step))
    start, end = window.window()
    assert (start.job.steps, end.job.steps) == (2, 5)
    assert [s.job.steps for s in window.interval()] == [4, 5]
    assert window.total()[0].job.steps == 0
    with pytest.raises(ValueError, match="back in time"):
        window.append(_sample(1.0, 6, 0))


def test_batch_counts_padding_and_targets() -> None:
    batch = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
        "labels": torch.tensor([[-100, 5, 5, -100, -100], [-100, -100, 5, 5, 5]]),
    }
    assert batch_counts(batch).tolist() == [2, 8, 5, 9 + 25]


def test_batch_counts_rejects_non_dict_batches() -> None:
    with pytest.raises(GymUserError, match="input_ids"):
        batch_counts((torch.zeros(2, 3), torch.zeros(2)))


def test_all_argument_problems_reported_at_once() -> None:
    with pytest.raises(ValueError) as err:
        ThroughputCallback(warmup_steps=-1, window_steps=0, log_every_n_steps=0, flops_per_token=-3, peak_flops=0)
    for name in ("warmup_steps", "window_steps", "log_every_n_steps", "flops_per_token", "peak_flops"):
        assert name in str(err.value)


# ---------------------------------------------------------------------------------------------- Trainer run
def _rows(n: int = 30, width: int = 8) -> list[dict[str, torch.Tensor]]:
    rows = []
    for i in range(n):
        length = 3 + i % 5
        ids = torch.randint(0, TINY["vocab_size"], (width,), generator=torch.Generator().manual_seed(i))
        mask = (torch.arange(width) < length).long()
        labels = torch.where(mask.bool() & (torch.arange(width) >= 1 + i % 2), ids, -100)  # a 1-2 token "prompt"
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


class VariableBatches(Sampler[list[int]]):
    """Batch sizes 2, 3, 1, 2, 3, 1, ...: the callback must not assume a fixed batch size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        start, sizes = 0, [2, 3, 1]
        for k in range(len(self)):
            size = sizes[k % 3]
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return 12  # 12 batches of 2+3+1 -> 24 rows


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class NoConfigLM(TinyLM):
    """A Lightning project without a Hugging Face config: FLOPs must be n/a unless the user gives them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = self.model
        del self.model

    def configure_model(self) -> None:  # built in __init__, under another name
        pass

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _fit(module: pl.LightningModule, callback: ThroughputCallback, root: Path) -> dict[str, Any]:
    rows = _rows()
    loader = DataLoader(rows, batch_sampler=VariableBatches(len(rows)), collate_fn=_collate)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        accumulate_grad_batches=2,
        callbacks=[callback],
        default_root_dir=root,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        logger=pl.loggers.CSVLogger(root),
    )
    trainer.fit(module, loader)
    return json.loads((Path(trainer.log_dir) / "throughput.json").read_text())


def _measured_rows(warmup_steps: int, steps: int, accumulate: int = 2) -> list[dict[str, torch.Tensor]]:
    rows, batches = _rows(), list(VariableBatches(30))
    wanted = batches[warmup_steps * accumulate : steps * accumulate]
    return [rows[i] for batch in wanted for i in batch]


def test_counts_exact_with_accumulation_and_variable_batches(tmp_path: Path) -> None:
    callback = ThroughputCallback(warmup_steps=2, window_steps=2, log_every_n_steps=1, peak_flops=1e12)
    summary = _fit(TinyLM(), callback, tmp_path)
    measured = _measured_rows(warmup_steps=2, steps=5)
    lengths = [int(row["attention_mask"].sum()) for row in measured]
    counts = summary["job_counts"]
    assert summary["measured_steps"] == counts["steps"] == 3
    assert counts["samples"] == len(measured) == 12  # micro-batches 4..9: sizes 3,1,2,3,1,2
    assert counts["tokens"] == sum(lengths)
    assert counts["target_tokens"] == sum(int(count_target_tokens(row["labels"])) for row in measured)
    flops = transformer_flops(TinyLM().model, TinyLM().model.config)
    assert counts["flops"] == flops.for_tokens(sum(lengths), sum(n * n for n in lengths))
    total = summary["total"]
    assert total["tokens_per_sec"] == pytest.approx(counts["tokens"] / summary["elapsed_sec"])
    assert total["mfu"] == pytest.approx(total["device_flops_per_sec"] / 1e12)
    assert summary["flops"]["trainable_params"] == 26784 and summary["peak_flops_source"] == "user"
    metrics = (Path(tmp_path) / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "throughput/window/tokens_per_sec" in metrics and "throughput/interval/mfu" in metrics


def test_without_config_flops_are_na_unless_given(tmp_path: Path) -> None:
    summary = _fit(NoConfigLM(), ThroughputCallback(warmup_steps=1), tmp_path / "a")
    assert summary["job_counts"]["flops"] is None and summary["total"]["mfu"] is None
    assert summary["total"]["tokens_per_sec"] > 0
    summary = _fit(NoConfigLM(), ThroughputCallback(warmup_steps=1, flops_per_token=1000.0), tmp_path / "b")
    assert summary["job_counts"]["flops"] == 1000.0 * summary["job_counts"]["tokens"]
    assert summary["total"]["mfu"] is None  # CPU: no peak in the table, none given


class SlowValidationLM(TinyLM):
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        time.sleep(2.0)


def test_validation_time_is_not_training_time(tmp_path: Path) -> None:
    rows = _rows()
    loader = DataLoader(rows, batch_size=2, collate_fn=_collate)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[callback := ThroughputCallback(warmup_steps=1)],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(SlowValidationLM(), loader, loader)
    wall = time.perf_counter() - start
    # Validation after steps 2, 4 and 6 sleeps 6 s, all inside the measured window (end of warm-up step 1 to the end
    # of fit); counted, it would leave elapsed ~ wall - (setup + warm-up), far above wall - 4 s.
    assert callback.summary["elapsed_sec"] < wall - 4.0
