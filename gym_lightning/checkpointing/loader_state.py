"""Hand a resumed run's saved DataLoader positions to the loaders, also when Lightning would not.

Lightning restores the training DataLoader's ``state_dict`` in ``FitLoop.setup_data`` only when the loop is already
restarting. But ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (as ``CausalLMModule``'s
learning-rate schedule does) makes Lightning set up the training data *before* the checkpoint is restored, and
``setup_data`` does not run again: the saved position would be dropped and the interrupted epoch restarted from
its first batch (Lightning 2.6, ``fit_loop.py``: ``setup_data`` returns early once a combined loader exists).
Calling the loop's own loader-restoring step again from ``on_train_start`` (after the restore, before the first
batch is drawn) fixes that; it is a no-op when Lightning already did it or when there is nothing to restore.
"""

from __future__ import annotations

import lightning.pytorch as pl

from gym_lightning._compat import load_combined_loader_states


def load_pending_loader_states(trainer: pl.Trainer) -> None:
    """Give the training DataLoaders the positions saved in the checkpoint being resumed, if not done yet."""
    load_combined_loader_states(trainer)
