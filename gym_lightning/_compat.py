"""The one place where gym_lightning touches Lightning's private (``_``-prefixed) helpers.

Lightning does not promise to keep these stable; keeping every use here means one file to fix on an upgrade.
"""

from __future__ import annotations

# Strategy classes register their names through this registry type (Lightning's ``register_strategies`` hook).
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

# FSDP2-compatible activation checkpointing that keeps parameter names unchanged (unlike checkpoint_wrapper, which
# inserts ``_checkpoint_wrapped_module`` into every key); torchtitan and torch's own FSDP2 tests use it.
from torch.distributed._composable import checkpoint as checkpoint_activations

__all__ = ["_StrategyRegistry", "checkpoint_activations", "rank_zero_info", "rank_zero_warn"]
