"""``CurvesCallback``: ``curves.png`` in the run's log directory at the end of fit (loss, validation loss, lr).

The recording and the drawing are plain functions and a small recorder class; the callback only calls them from
Lightning's hooks. x is the optimizer step everywhere (``trainer.global_step`` after the step), so gradient
accumulation and resumed runs line up with the logger's steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gym_lightning.callbacks.reports import report_dir


@dataclass
class Curves:
    """One value per optimizer step for ``loss`` and ``lr`` (x: ``steps``), one per validation for ``val_loss``."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)


class CurveRecorder:
    """Collects the training loss without a host sync per step.

    The loss of each micro-batch stays a device tensor; a step's mean is formed on the device, and the pending step
    means are copied to the host together every ``flush_every`` steps (one sync per flush instead of one per step,
    and no growing pile of one-element device tensors: on CUDA each would hold a 512-byte allocator block).
    """

    def __init__(self, flush_every: int = 100) -> None:
        self.curves = Curves()
        self.flush_every = flush_every
        self._step_sum: torch.Tensor | None = None
        self._step_count = 0
        self._pending: list[torch.Tensor] = []

    def add_micro_batch(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        self._step_sum = loss if self._step_sum is None else self._step_sum + loss
        self._step_count += 1

    def end_step(self, step: int, lr: float) -> None:
        """Close optimizer step ``step`` (its micro-batches added before), run at learning rate ``lr``."""
        if self._step_sum is None:
            return
        self._pending.append(self._step_sum / self._step_count)
        self._step_sum, self._step_count = None, 0
        self.curves.steps.append(step)
        self.curves.lr.append(lr)
        if len(self._pending) >= self.flush_every:
            self.flush()

    def add_validation(self, step: int, val_loss: float) -> None:
        self.curves.val_steps.append(step)
        self.curves.val_loss.append(val_loss)

    def flush(self) -> None:
        if self._pending:
            self.curves.loss.extend(torch.stack(self._pending).cpu().tolist())
            self._pending = []


def plot_curves(curves: Curves, path: Path) -> Path:
    """Draw the loss (training, and validation if any) and the learning rate over optimizer steps into a PNG.

    Uses matplotlib's Agg canvas directly, without pyplot, so a notebook's or the user's backend is left alone. The
    file is written under a temporary name and renamed into place: a reader never sees half a PNG.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, lr_axes = figure.subplots(2, 1, sharex=True)
    loss_axes.plot(curves.steps, curves.loss, label="train loss", linewidth=0.8)
    if curves.val_loss:
        loss_axes.plot(curves.val_steps, curves.val_loss, "o-", label="validation loss")
    loss_axes.set_ylabel("loss")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    lr_axes.plot(curves.steps, curves.lr, color="tab:green")
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("optimizer step")
    lr_axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    figure.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def current_lr(trainer: pl.Trainer) -> float:
    """The learning rate of the first parameter group of the first optimizer (what the next step will use)."""
    return float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else float("nan")


class CurvesCallback(Callback):
    """Writes ``curves.png`` (training loss, validation loss if logged, learning rate) to the log directory.

    Recorded on global rank zero only: the loss is that rank's logged ``loss_key`` (for ``CausalLMModule`` its
    micro-batch token mean, averaged over the micro-batches of each optimizer step), the lr is the first parameter
    group's when the step started, the validation loss is ``val_loss_key`` after each validation. Reading
    ``trainer.callback_metrics`` turns progress-bar metrics into numbers, the same work the progress bar does at
    each refresh; the loss itself stays on the device until a flush (see ``CurveRecorder``). A micro-batch whose
    optimizer step did not run (``on_nonfinite: skip``) counts towards the next step's mean.

    Args:
        loss_key: The training loss as logged with ``self.log(..., on_step=True)``.
        val_loss_key: The validation loss as logged once per validation.
        filename: Name of the PNG in the log directory.
        flush_every_n_steps: Optimizer steps between copies of the recorded losses to the host; ``>= 1``.
    """

    def __init__(
        self,
        loss_key: str = "train/loss",
        val_loss_key: str = "val/loss",
        filename: str = "curves.png",
        flush_every_n_steps: int = 100,
    ) -> None:
        if flush_every_n_steps < 1:
            from gym_lightning.errors import GymUserError

            raise GymUserError(f"CurvesCallback(flush_every_n_steps={flush_every_n_steps}): use an integer >= 1.")
        self.loss_key = loss_key
        self.val_loss_key = val_loss_key
        self.filename = filename
        self.recorder = CurveRecorder(flush_every_n_steps)
        self.path: Path | None = None
        self._lr = float("nan")
        self._last_step = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.recorder = CurveRecorder(self.recorder.flush_every)
        self._last_step = trainer.global_step  # after a resume: the restored step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            self._lr = current_lr(trainer)  # schedulers step after the optimizer: this is the lr of this step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        loss = trainer.callback_metrics.get(self.loss_key)
        if isinstance(loss, torch.Tensor):
            self.recorder.add_micro_batch(loss)
        if trainer.global_step > self._last_step:  # an optimizer step ran in this micro-batch
            self._last_step = trainer.global_step
            self.recorder.end_step(trainer.global_step, self._lr)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.val_loss_key)
        if trainer.is_global_zero and not trainer.sanity_checking and value is not None:
            self.recorder.add_validation(trainer.global_step, float(value))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        directory = report_dir(trainer)  # collective: every rank takes part
        if trainer.is_global_zero:
            self.recorder.flush()
            if self.recorder.curves.steps:
                self.path = plot_curves(self.recorder.curves, directory / self.filename)


__all__ = ["CurveRecorder", "Curves", "CurvesCallback", "current_lr", "plot_curves"]
