"""CurvesCallback: one loss and one lr per optimizer step, validation losses, a valid curves.png in the log folder."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.tiny import TINY

from gym_lightning import CausalLMDataModule, CausalLMModule, CurvesCallback
from gym_lightning.callbacks.curves import CurveRecorder, Curves, plot_curves
from gym_lightning.errors import GymUserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fit_with_curves(root: Path, max_steps: int, accumulation: int, flush_every: int) -> CurvesCallback:
    pl.seed_everything(3)
    module = CausalLMModule("tiny-llama", config_overrides=TINY, lr=1e-3, scheduler="linear", warmup_steps=2)
    data = CausalLMDataModule(dataset="addition", batch_size=8, eval_batch_size=16)
    curves = CurvesCallback(flush_every_n_steps=flush_every)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulation,
        val_check_interval=2 * accumulation, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[curves],
        logger=pl.loggers.CSVLogger(root), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, data)
    return curves


def test_fit_writes_a_png_with_one_point_per_optimizer_step(tmp_path: Path) -> None:
    callback = fit_with_curves(tmp_path, max_steps=5, accumulation=2, flush_every=2)
    assert callback.path == tmp_path / "lightning_logs" / "version_0" / "curves.png"
    assert callback.path.read_bytes()[:8] == PNG_SIGNATURE
    assert not list(callback.path.parent.glob(".*tmp*"))  # the temporary file was renamed into place
    curves = callback.recorder.curves
    assert curves.steps == [1, 2, 3, 4, 5]  # 10 micro-batches, 5 optimizer steps
    assert len(curves.loss) == 5 and all(math.isfinite(loss) for loss in curves.loss)
    # linear schedule, 2 warm-up steps of 5: the lr each step ran at rises, then falls
    assert curves.lr[0] < curves.lr[1] and curves.lr[1] > curves.lr[-1] > 0
    assert curves.val_steps == [2, 4]  # the sanity check is not recorded


def test_step_loss_is_the_mean_of_its_micro_batches() -> None:
    recorder = CurveRecorder(flush_every=100)
    for loss in (1.0, 3.0):
        recorder.add_micro_batch(torch.tensor(loss))
    recorder.end_step(1, lr=0.5)
    recorder.add_micro_batch(torch.tensor(4.0))
    recorder.end_step(2, lr=0.25)
    assert recorder.curves.loss == []  # still on the device: nothing copied before a flush
    recorder.flush()
    assert recorder.curves == Curves(steps=[1, 2], loss=[2.0, 4.0], lr=[0.5, 0.25])


def test_plot_without_validation_and_bad_flush_interval(tmp_path: Path) -> None:
    path = plot_curves(Curves(steps=[1, 2, 3], loss=[3.0, 2.0, 1.5], lr=[1e-3, 1e-3, 5e-4]), tmp_path / "c.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(GymUserError, match="flush_every_n_steps=0"):
        CurvesCallback(flush_every_n_steps=0)
