"""``GymProgressBar``: Lightning's tqdm progress bar without the logger's version number or a host sync per step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

# The preference objectives' reward margin and accuracy (TRL's names): shown beside the loss when a run logs them.
PREFERENCE_BAR_KEYS = ("rewards/margins", "rewards/accuracies")


def host_values(metrics: Mapping[str, Any], keys: Sequence[str]) -> dict[str, float]:
    """The values of those ``keys`` that ``metrics`` holds, as host numbers, with one device-to-host copy for all
    the tensors among them (one host sync on CUDA however many keys: one ``.item()`` each would stop the host once
    per key)."""
    present = [key for key in keys if key in metrics]
    tensors = [key for key in present if isinstance(metrics[key], torch.Tensor)]
    read: dict[str, float] = {}
    if tensors:
        stacked = torch.stack([metrics[key].detach().reshape(()).float() for key in tensors])
        read = dict(zip(tensors, stacked.tolist(), strict=True))
    return {key: read[key] if key in read else float(metrics[key]) for key in present}


class GymProgressBar(TQDMProgressBar):
    """A ``TQDMProgressBar`` that does not show ``v_num`` and reads the loss only at the Trainer's logging steps.

    ``v_num`` is the logger's version folder (``version_0`` shows as ``v_num: 0.000``): the same on every step, it
    takes room from the loss and ``tok/s`` and reads like a metric. tqdm rather than Rich: Lightning's Rich bar can
    fail inside Jupyter (see the notebooks), and one bar everywhere keeps the console the same in both.

    The loss (``loss_key``) and the ``metric_keys`` a run logs (a preference run's reward margin and accuracy, under
    TRL's names), all logged without ``prog_bar`` so that Lightning does not turn them into numbers, are read
    together every ``trainer.log_every_n_steps`` optimizer steps, as the loggers read them, and shown until the next
    read: Lightning converts every ``prog_bar`` metric with ``.item()`` at each batch end, each time the bar
    refreshes and each time ``trainer.callback_metrics`` is read, and on CUDA each of those stops the host until the
    GPU has finished the step (3 syncs per step for one metric, tests/test_host_syncs.py), so the next step's kernels
    are not queued ahead. Callbacks with a ``progress_bar_items`` dict of host numbers (``ThroughputCallback``'s
    ``tok/s``) are shown too.

    Args:
        refresh_rate: Batches between redraws, as ``TQDMProgressBar``'s.
        process_position: As ``TQDMProgressBar``'s.
        leave: As ``TQDMProgressBar``'s.
        loss_key: The logged training loss to show (``CausalLMModule`` logs ``train/loss``).
        metric_keys: Further logged step metrics to show beside the loss when the run logs them (default: the
            preference objectives' ``rewards/margins`` and ``rewards/accuracies``; an SFT run logs neither).
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        loss_key: str = "train/loss",
        metric_keys: Sequence[str] = PREFERENCE_BAR_KEYS,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.loss_key = loss_key
        self.metric_keys = tuple(metric_keys)
        self._shown: dict[str, float] = {}
        self._read_at = -1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        every = max(1, int(trainer.log_every_n_steps or 1))
        if step != self._read_at and (step % every == 0 or self._read_at < 0):
            self._read_at = step
            # the one read per logging interval
            self._shown.update(host_values(trainer.callback_metrics, (self.loss_key, *self.metric_keys)))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        items.update(self._shown)
        for callback in trainer.callbacks:
            items.update(getattr(callback, "progress_bar_items", None) or {})
        return items


__all__ = ["PREFERENCE_BAR_KEYS", "GymProgressBar", "host_values"]
