"""Strategies that run the same configuration on CPU ranks (gloo) and on GPUs (nccl).

Importing this package registers their names with Lightning, so ``Trainer(strategy="zero3")`` works after
``import gym_lightning``:

==================  ==============================================================
``gym_ddp``         :class:`GymDDPStrategy`
``gym_fsdp``        :class:`GymFSDPStrategy` (FSDP2, one shard unit per decoder layer)
``zero1``           :class:`ZeROStrategy` stage 1
``zero2``           stage 2
``zero3``           stage 3
``zero2_offload``   stage 2, optimizer offloaded to CPU
``zero3_offload``   stage 3, optimizer and parameters offloaded to CPU
``zero_infinity``   stage 3, optimizer and parameters offloaded to NVMe (a temporary folder)
==================  ==============================================================
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from gym_lightning.strategies.comm_hooks import bf16_allreduce_hook
from gym_lightning.strategies.ddp import GymDDPStrategy
from gym_lightning.strategies.deepspeed import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from gym_lightning.strategies.fsdp import GymFSDPStrategy

STRATEGY_NAMES: tuple[str, ...] = (
    "gym_ddp",
    "gym_fsdp",
    "zero1",
    "zero2",
    "zero3",
    "zero2_offload",
    "zero3_offload",
    "zero_infinity",
)


def register_strategies() -> None:
    """Register gym_lightning's strategy names in Lightning's ``StrategyRegistry`` (idempotent)."""
    for strategy_cls in (GymDDPStrategy, GymFSDPStrategy, ZeROStrategy):
        strategy_cls.register_strategies(StrategyRegistry)


register_strategies()

__all__ = [
    "STRATEGY_NAMES",
    "GymDDPStrategy",
    "GymFSDPStrategy",
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "ZeROStrategy",
    "bf16_allreduce_hook",
    "register_strategies",
]
