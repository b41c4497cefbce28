"""What ``import gym_lightning`` does beyond defining names: registration, and nothing else process-wide.

- gym_lightning's strategy names (``gym_ddp``, ``gym_fsdp``, ``zero1``-``zero3``, ...) go into Lightning's
  ``StrategyRegistry``, so that ``Trainer(strategy="zero3")`` works;
- the module's hyper-parameter classes (``GenerationArgs``, ``LoRAArgs``, ``QuantizationArgs``, ``CompileArgs``,
  ``FusedOps``) are allow-listed for
  torch's ``weights_only=True`` unpickler, so that a checkpoint that stores them loads without running arbitrary
  code (the training objectives allow-list themselves as they register: ``objectives.register_objective``).

Console quieting (``gym_lightning.quiet``) is the command line's choice, and patches to other libraries are applied
explicitly (``gym_lightning.patches``).
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import StrategyRegistry

from gym_lightning.generation import GenerationArgs
from gym_lightning.lora import LoRAArgs
from gym_lightning.models.compiled import CompileArgs
from gym_lightning.models.fused import FusedOps
from gym_lightning.quant import QuantizationArgs
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

# Checkpoints store the hyper-parameters; loading them with ``weights_only=True`` needs these classes allow-listed.
SAFE_GLOBALS: tuple[type, ...] = (GenerationArgs, LoRAArgs, QuantizationArgs, CompileArgs, FusedOps)


def register() -> None:
    """Register gym_lightning's strategy names and safe globals (idempotent)."""
    for strategy_cls in (GymDDPStrategy, GymFSDPStrategy, ZeROStrategy):
        strategy_cls.register_strategies(StrategyRegistry)
    torch.serialization.add_safe_globals(list(SAFE_GLOBALS))


__all__ = ["SAFE_GLOBALS", "register"]
