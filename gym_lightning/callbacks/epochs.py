"""``EpochFraction``: train for a fractional number of epochs (``--num_train_epochs 1.5``), as the HF Trainer does."""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gym_lightning.errors import GymUserError


def fractional_epoch_steps(epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of ``epochs`` epochs: ``ceil(epochs x steps per epoch)``, the HF Trainer's rule
    (HF: ``max_steps = math.ceil(args.num_train_epochs * num_update_steps_per_epoch)``)."""
    return max(1, math.ceil(epochs * steps_per_epoch))


class EpochFraction(Callback):
    """Stop after ``epochs`` epochs, a fraction allowed: the run's optimizer steps become
    ``ceil(epochs x steps per epoch)`` before the optimizer and the learning-rate schedule are built, so the schedule
    ends where training ends (as in the HF Trainer).

    Lightning counts whole epochs only (``max_epochs``); the number of steps in an epoch is known only once the
    training DataLoader exists (after tokenization, packing and the distributed sampler), which is first at ``setup``:
    this callback reads it there (``trainer.estimated_stepping_batches`` with ``max_epochs = ceil(epochs)``) and sets
    the epoch loop's ``max_steps``. Use it with ``Trainer(max_epochs=ceil(epochs), max_steps=-1)``.

    Args:
        epochs: Epochs to train (> 0), e.g. ``1.5``.
    """

    def __init__(self, epochs: float) -> None:
        if not isinstance(epochs, int | float) or isinstance(epochs, bool) or not epochs > 0:
            raise GymUserError(f"EpochFraction: epochs must be a number > 0, got {epochs!r}.")
        self.epochs = float(epochs)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        whole = trainer.max_epochs or 0
        if whole != math.ceil(self.epochs) or trainer.max_steps != -1:
            raise GymUserError(
                f"EpochFraction(epochs={self.epochs}) needs trainer.max_epochs={math.ceil(self.epochs)} and no "
                f"trainer.max_steps, got max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps}."
            )
        steps_per_epoch = int(trainer.estimated_stepping_batches) // whole
        trainer.fit_loop.epoch_loop.max_steps = fractional_epoch_steps(self.epochs, steps_per_epoch)


__all__ = ["EpochFraction", "fractional_epoch_steps"]
