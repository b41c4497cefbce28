"""Hand a resumed run's saved DataLoader positions to the loaders, also when Lightning would not.

The position is saved and restored by the loader itself (``data.loader.StepTokenDataLoader``'s ``state_dict`` and
``load_state_dict``), which Lightning's fit loop calls: it stores every training DataLoader's state in the
checkpoint's loop state. This module is the one place that makes sure the restore happens
(``ResumeLoaderPositions``, which ``CausalLMModule`` brings along and ``StepCheckpoint`` is).

Lightning restores the training DataLoader's ``state_dict`` in ``FitLoop.setup_data`` only when the loop is already
restarting. But ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (as ``CausalLMModule``'s
learning-rate schedule does) makes Lightning set up the training data *before* the checkpoint is restored, and
``setup_data`` does not run again: the saved position would be dropped and the interrupted epoch restarted from
its first batch (Lightning 2.6, ``fit_loop.py``: ``setup_data`` returns early once a combined loader exists).
Calling the loop's own loader-restoring step again from ``on_train_start`` (after the restore, before the first
batch is drawn) fixes that; it is a no-op when Lightning already did it or when there is nothing to restore, so
running it twice (the module's callback and ``StepCheckpoint``) does it once.

A run resumed on another number of ranks (or per-rank batch) also needs the fit loop's count of the interrupted
epoch's batches in the new layout: Lightning saved it per rank (6 batches of 2 on each of 2 ranks is 12 batches
on 1 rank), and it decides from it when the accumulation window closes and when the epoch ends. ``align_batch_progress``
shifts every counter by the same amount, so the relations Lightning's restart logic reads between them stay.
"""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from gym_lightning._compat import load_combined_loader_states
from gym_lightning.data.loader import StepTokenDataLoader


class ResumeLoaderPositions(pl.Callback):
    """Resume the training DataLoaders at the checkpoint's mid-epoch position, also when the module's
    ``configure_optimizers`` set up the data before the checkpoint was restored (see the module docstring)."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        load_pending_loader_states(trainer)


def load_pending_loader_states(trainer: pl.Trainer) -> None:
    """Give the training DataLoaders the positions saved in the checkpoint being resumed, if not done yet, and the
    fit loop the count of batches they stand for."""
    load_combined_loader_states(trainer)
    align_batch_progress(trainer)


def _resumed_loaders(trainer: pl.Trainer) -> list[StepTokenDataLoader]:
    loaders = trainer.train_dataloader
    values = (
        loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, list | tuple) else [loaders]
    )
    return [
        loader for loader in values if isinstance(loader, StepTokenDataLoader) and loader.resumed_batches is not None
    ]


def align_batch_progress(trainer: pl.Trainer) -> None:
    """Set the epoch loop's batch counters to the batches the resumed loader already trained in its own layout (a
    no-op when the layout is the one the checkpoint was taken with, or nothing was resumed)."""
    loop = trainer.fit_loop.epoch_loop
    loaders = _resumed_loaders(trainer)
    if not loop.restarting or not loaders:
        return
    progress = loop.batch_progress
    delta = loaders[0].resumed_batches - progress.current.processed
    if delta == 0:
        return
    for tracker in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(tracker, name, getattr(tracker, name) + delta)
