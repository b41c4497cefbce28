"""``CurvesCallback``: ``curves.png`` in the run's log directory at the end of fit (loss, validation loss, lr, and a
preference run's reward margins and accuracies).

The recording and the drawing are plain functions and a small recorder class; the callback only calls them from
Lightning's hooks. x is the optimizer step everywhere (``trainer.global_step`` after the step), so gradient
accumulation and resumed runs line up with the logger's steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gym_lightning.callbacks.progress import host_values
from gym_lightning.callbacks.reports import report_dir

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The step metrics of gym_lightning.objectives' preference objectives, under TRL's names (DPOTrainer, KTOTrainer,
# CPOTrainer, ORPOTrainer): recorded at the logging steps, and as ``val/<name>`` after each validation.
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "kl",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
)
# Panels drawn beside the loss when a run logged the metric: (logged name, y label).
PREFERENCE_PANELS = (("rewards/margins", "reward margin"), ("rewards/accuracies", "reward accuracy"))
VALIDATION_PREFIX = "val/"


@dataclass
class Series:
    """Values of one metric at the optimizer steps ``steps``."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class Curves:
    """One value per optimizer step for ``loss`` and ``lr`` (x: ``steps``), one per validation for ``val_loss``;
    ``metrics`` (TRL's names) at the logging steps, ``val_metrics`` (the same names, without ``val/``) per
    validation."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    metrics: dict[str, Series] = field(default_factory=dict)
    val_metrics: dict[str, Series] = field(default_factory=dict)


class CurveRecorder:
    """Collects the training loss and step metrics without a host sync per step.

    The loss of each micro-batch stays a device tensor; a step's mean is formed on the device, and the pending step
    means, with the pending step metrics, are copied to the host together every ``flush_every`` steps (one sync per
    flush instead of one per step, and no growing pile of one-element device tensors: on CUDA each would hold a
    512-byte allocator block).
    """

    def __init__(self, flush_every: int = 100) -> None:
        self.curves = Curves()
        self.flush_every = flush_every
        self._step_sum: torch.Tensor | None = None
        self._step_count = 0
        self._pending: list[torch.Tensor] = []
        self._pending_metrics: list[tuple[int, tuple[str, ...], torch.Tensor]] = []

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

    def add_metrics(self, step: int, values: Mapping[str, torch.Tensor]) -> None:
        """Record the step metrics ``values`` (0-d device tensors) of optimizer step ``step``; kept on the device
        until the next flush."""
        if values:
            stacked = torch.stack([value.detach().float().reshape(()) for value in values.values()])
            self._pending_metrics.append((step, tuple(values), stacked))

    def add_validation(self, step: int, val_loss: float, metrics: Mapping[str, float] | None = None) -> None:
        self.curves.val_steps.append(step)
        self.curves.val_loss.append(val_loss)
        for name, value in (metrics or {}).items():
            series = self.curves.val_metrics.setdefault(name, Series())
            series.steps.append(step)
            series.values.append(value)

    def flush(self) -> None:
        chunks = ([torch.stack(self._pending)] if self._pending else []) + [m[2] for m in self._pending_metrics]
        if not chunks:
            return
        host = torch.cat([chunk.to(chunks[0].device) for chunk in chunks]).tolist()  # one device-to-host copy
        self.curves.loss.extend(host[: len(self._pending)])
        offset = len(self._pending)
        for step, names, _ in self._pending_metrics:
            for name, value in zip(names, host[offset : offset + len(names)], strict=True):
                series = self.curves.metrics.setdefault(name, Series())
                series.steps.append(step)
                series.values.append(value)
            offset += len(names)
        self._pending, self._pending_metrics = [], []


def preference_panels(curves: Curves) -> list[tuple[str, str]]:
    """``(metric, y label)`` of the ``PREFERENCE_PANELS`` whose metric the run recorded (none for SFT)."""
    return [(name, label) for name, label in PREFERENCE_PANELS if name in curves.metrics or name in curves.val_metrics]


def curves_figure(curves: Curves) -> Figure:
    """The figure of ``curves.png``: the loss (training, and validation if any) over the learning rate, and, for a
    run that logged them (preference objectives), the reward margins over the reward accuracies beside them.

    Uses matplotlib's Agg canvas directly, without pyplot, so a notebook's or the user's backend is left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = preference_panels(curves)
    figure = Figure(figsize=(12, 6) if panels else (7, 6), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(2, 2 if panels else 1, sharex=True, squeeze=False)
    loss_axes, lr_axes = grid[0][0], grid[1][0]
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
    if panels:
        for axes, (name, label) in zip((grid[0][1], grid[1][1]), panels, strict=False):
            draw_metric(axes, curves, name, label)
        grid[1][1].set_xlabel("optimizer step")
        if len(panels) == 1:
            grid[1][1].set_visible(False)
            grid[0][1].xaxis.set_tick_params(labelbottom=True)
            grid[0][1].set_xlabel("optimizer step")
    return figure


def draw_metric(axes: Axes, curves: Curves, name: str, label: str) -> None:
    """One preference metric on ``axes``: its training values at the logging steps and its validation values, with
    the reference line (0 for a margin, 0.5 for an accuracy: what a policy equal to its reference scores)."""
    train, validation = curves.metrics.get(name), curves.val_metrics.get(name)
    if train is not None:
        single = len(train.steps) == 1  # a line through one point draws nothing
        axes.plot(train.steps, train.values, "." if single else "-", label=f"train {name}", linewidth=0.8)
    if validation is not None:
        axes.plot(validation.steps, validation.values, "o-", label=f"validation {name}")
    if name == "rewards/accuracies":
        axes.axhline(0.5, color="grey", linestyle="--", linewidth=0.8)
        axes.set_ylim(-0.05, 1.05)
    else:
        axes.axhline(0.0, color="grey", linestyle="--", linewidth=0.8)
    axes.set_ylabel(label)
    axes.legend()
    axes.grid(alpha=0.3)


def plot_curves(curves: Curves, path: Path) -> Path:
    """Draw ``curves_figure(curves)`` into a PNG at ``path``. The file is written under a temporary name and
    renamed into place: a reader never sees half a PNG."""
    figure = curves_figure(curves)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    figure.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def current_lr(trainer: pl.Trainer) -> float:
    """The learning rate of the first parameter group of the first optimizer (what the next step will use)."""
    return float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else float("nan")


def is_logging_step(step: int, log_every_n_steps: int | None) -> bool:
    """Whether the loggers write the metrics of optimizer step ``step`` (``global_step`` after it): every
    ``log_every_n_steps`` steps, as Lightning's logger connector counts them (``GymProgressBar`` reads then too)."""
    return bool(log_every_n_steps) and step % int(log_every_n_steps) == 0


def tensors_of(metrics: Mapping[str, Any], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensor values among ``metrics``' ``keys``, in ``keys``' order."""
    return {key: metrics[key] for key in keys if isinstance(metrics.get(key), torch.Tensor)}


class CurvesCallback(Callback):
    """Writes ``curves.png`` (training loss, validation loss if logged, learning rate; a preference run's reward
    margins and accuracies beside them) to the log directory.

    Recorded on global rank zero only: the loss is that rank's logged ``loss_key`` (for ``CausalLMModule`` its
    micro-batch token mean, averaged over the micro-batches of each optimizer step), the lr is the first parameter
    group's when the step started, the validation loss is ``val_loss_key`` after each validation. The
    ``metric_keys`` a run logs are recorded at the Trainer's logging steps, the values its loggers write (the
    preference objectives' means over the step's pairs of every rank), and ``val/<key>`` after each validation.
    Reading ``trainer.callback_metrics`` turns progress-bar metrics into numbers, the same work the progress bar
    does at each refresh; the loss and the metrics themselves stay on the device until a flush (see
    ``CurveRecorder``). A micro-batch whose optimizer step did not run (``on_nonfinite: skip``) counts towards the
    next step's mean.

    Args:
        loss_key: The training loss as logged with ``self.log(..., on_step=True)``.
        val_loss_key: The validation loss as logged once per validation.
        filename: Name of the PNG in the log directory.
        flush_every_n_steps: Optimizer steps between copies of the recorded losses to the host; ``>= 1``.
        metric_keys: Step metrics to record when a run logs them (default: the preference objectives' TRL names).
    """

    def __init__(
        self,
        loss_key: str = "train/loss",
        val_loss_key: str = "val/loss",
        filename: str = "curves.png",
        flush_every_n_steps: int = 100,
        metric_keys: Sequence[str] = PREFERENCE_METRICS,
    ) -> None:
        if flush_every_n_steps < 1:
            from gym_lightning.errors import GymUserError

            raise GymUserError(f"CurvesCallback(flush_every_n_steps={flush_every_n_steps}): use an integer >= 1.")
        self.loss_key = loss_key
        self.val_loss_key = val_loss_key
        self.filename = filename
        self.metric_keys = tuple(metric_keys)
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
        metrics = trainer.callback_metrics
        loss = metrics.get(self.loss_key)
        if isinstance(loss, torch.Tensor):
            self.recorder.add_micro_batch(loss)
        if trainer.global_step > self._last_step:  # an optimizer step ran in this micro-batch
            self._last_step = trainer.global_step
            self.recorder.end_step(trainer.global_step, self._lr)
            if is_logging_step(trainer.global_step, trainer.log_every_n_steps):
                self.recorder.add_metrics(trainer.global_step, tensors_of(metrics, self.metric_keys))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if not trainer.is_global_zero or trainer.sanity_checking or self.val_loss_key not in metrics:
            return
        keys = [VALIDATION_PREFIX + key for key in self.metric_keys]
        values = host_values(metrics, [self.val_loss_key, *keys])  # one read for all
        extra = {key[len(VALIDATION_PREFIX) :]: value for key, value in values.items() if key in keys}
        self.recorder.add_validation(trainer.global_step, values[self.val_loss_key], extra)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        directory = report_dir(trainer)  # collective: every rank takes part
        if trainer.is_global_zero:
            self.recorder.flush()
            if self.recorder.curves.steps:
                self.path = plot_curves(self.recorder.curves, directory / self.filename)


__all__ = [
    "PREFERENCE_METRICS",
    "CurveRecorder",
    "Curves",
    "CurvesCallback",
    "Series",
    "current_lr",
    "curves_figure",
    "is_logging_step",
    "plot_curves",
    "preference_panels",
]
