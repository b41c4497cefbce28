"""``trainer_state.json`` and ``curves.png`` in the run folder, where a Hugging Face Trainer user looks for them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from gym_lightning.callbacks.curves import Curves, CurvesCallback
from gym_lightning.callbacks.reports import write_json


class TrainerStateCallback(CurvesCallback):
    """``CurvesCallback`` that also writes ``<output_dir>/trainer_state.json`` and copies ``curves.png`` there.

    ``trainer_state.json`` follows the HF Trainer's file of that name: ``log_history`` holds one
    ``{"loss", "learning_rate", "epoch", "step"}`` per optimizer step (rank 0's loss, averaged over the step's
    micro-batches; the learning rate the step used; ``epoch`` fractional, as HF counts it) and one
    ``{"eval_loss", "epoch", "step"}`` per validation. Written once, at the end of ``fit``, on global rank 0.

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


def trainer_state(curves: Curves, steps_per_epoch: int, global_step: int, max_steps: int) -> dict[str, Any]:
    """The HF Trainer's ``trainer_state.json`` fields that a run of recorded ``curves`` determines."""
    history: list[dict[str, Any]] = [
        {"loss": loss, "learning_rate": lr, "epoch": step / steps_per_epoch, "step": step}
        for step, loss, lr in zip(curves.steps, curves.loss, curves.lr, strict=True)
    ]
    history += [
        {"eval_loss": loss, "epoch": step / steps_per_epoch, "step": step}
        for step, loss in zip(curves.val_steps, curves.val_loss, strict=True)
    ]
    history.sort(key=lambda entry: (entry["step"], "eval_loss" in entry))
    return {
        "global_step": global_step,
        "max_steps": max_steps,
        "epoch": global_step / steps_per_epoch,
        "log_history": history,
    }


__all__ = ["TrainerStateCallback", "trainer_state"]
