"""``trainer_state.json`` and ``curves.png`` in the run folder, where a Hugging Face Trainer user looks for them."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from gym_lightning.callbacks.curves import Curves, CurvesCallback, Series
from gym_lightning.callbacks.reports import write_json

EVAL_PREFIX = "eval_"  # HF's metric_key_prefix of evaluate(): eval_loss, and TRL's eval_rewards/chosen, ...


class TrainerStateCallback(CurvesCallback):
    """``CurvesCallback`` that also writes ``<output_dir>/trainer_state.json`` and copies ``curves.png`` there.

    ``trainer_state.json`` follows the HF Trainer's file of that name: ``log_history`` holds one
    ``{"loss", "learning_rate", "epoch", "step"}`` per optimizer step (rank 0's loss, averaged over the step's
    micro-batches; the learning rate the step used; ``epoch`` fractional, as HF counts it) and one
    ``{"eval_loss", "epoch", "step"}`` per validation. A preference run's metrics join them under TRL's names, as
    TRL's trainers write them: ``rewards/chosen``, ``rewards/margins``, ``logps/chosen``, ... in the entries of the
    logging steps (the values the loggers got), ``eval_rewards/chosen``, ... in the validation entries. Written
    once, at the end of ``fit``, on global rank 0.

    Args:
        output_dir: Folder of ``trainer_state.json`` and the copy of ``curves.png``.
        **kwargs: ``CurvesCallback``'s arguments.
    """

    def __init__(self, output_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.output_dir = Path(output_dir)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        steps_per_epoch = max(1, trainer.num_training_batches // max(1, trainer.accumulate_grad_batches))
        state = trainer_state(self.recorder.curves, steps_per_epoch, trainer.global_step, trainer.max_steps)
        write_json(self.output_dir / "trainer_state.json", state)
        if self.path is not None and self.path.is_file():
            shutil.copyfile(self.path, self.output_dir / self.filename)


def history_entries(columns: Mapping[str, Series], steps_per_epoch: int) -> list[dict[str, Any]]:
    """One ``log_history`` entry per step that any of ``columns`` (``{key: series}``) has a value at, its keys in
    ``columns``' order, then HF's ``epoch`` (fractional) and ``step``; sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for key, series in columns.items():
        for step, value in zip(series.steps, series.values, strict=True):
            by_step.setdefault(step, {})[key] = value
    return [{**entry, "epoch": step / steps_per_epoch, "step": step} for step, entry in sorted(by_step.items())]


def log_history(curves: Curves, steps_per_epoch: int) -> list[dict[str, Any]]:
    """HF's ``log_history`` of recorded ``curves``: the training entries (``loss``, ``learning_rate``, the step
    metrics under their TRL names), then, at a step with both, the validation entry (``eval_loss``,
    ``eval_<metric>``), as HF logs the step before evaluating."""
    train = {"loss": Series(curves.steps, curves.loss), "learning_rate": Series(curves.steps, curves.lr)}
    train |= curves.metrics
    evaluation = {f"{EVAL_PREFIX}loss": Series(curves.val_steps, curves.val_loss)}
    evaluation |= {EVAL_PREFIX + name: series for name, series in curves.val_metrics.items()}
    history = history_entries(train, steps_per_epoch) + history_entries(evaluation, steps_per_epoch)
    history.sort(key=lambda entry: (entry["step"], f"{EVAL_PREFIX}loss" in entry))
    return history


def trainer_state(curves: Curves, steps_per_epoch: int, global_step: int, max_steps: int) -> dict[str, Any]:
    """The HF Trainer's ``trainer_state.json`` fields that a run of recorded ``curves`` determines."""
    return {
        "global_step": global_step,
        "max_steps": max_steps,
        "epoch": global_step / steps_per_epoch,
        "log_history": log_history(curves, steps_per_epoch),
    }


__all__ = ["EVAL_PREFIX", "TrainerStateCallback", "history_entries", "log_history", "trainer_state"]
