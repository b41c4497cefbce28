"""The one place where gym_lightning touches Lightning's private (``_``-prefixed) helpers.

Lightning does not promise to keep these stable; keeping every use here means one file to fix on an upgrade.
"""

from __future__ import annotations

import lightning.pytorch as pl

# Strategy classes register their names through this registry type (Lightning's ``register_strategies`` hook).
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

# FSDP2-compatible activation checkpointing that keeps parameter names unchanged (unlike checkpoint_wrapper, which
# inserts ``_checkpoint_wrapped_module`` into every key); torchtitan and torch's own FSDP2 tests use it.
from torch.distributed._composable import checkpoint as checkpoint_activations


def load_combined_loader_states(trainer: pl.Trainer) -> None:
    """Run the fit loop's own (private, Lightning 2.6) step that hands saved DataLoader states to the loaders.

    It checks ``restarting`` and clears the pending states itself, so calling it again is a no-op. If a Lightning
    upgrade removes it, say so: mid-epoch resume would otherwise silently restart the interrupted epoch.
    """
    restore = getattr(trainer.fit_loop, "_load_combined_loader_states", None)
    if restore is None:
        rank_zero_warn(
            "This Lightning version has no FitLoop._load_combined_loader_states: a run resumed mid-epoch restarts "
            "the interrupted epoch from its first batch. Pin lightning<2.7 for exact resume."
        )
        return
    restore()


__all__ = [
    "_StrategyRegistry",
    "checkpoint_activations",
    "load_combined_loader_states",
    "rank_zero_info",
    "rank_zero_warn",
]
