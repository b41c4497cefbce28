"""Strategies that run the same configuration on CPU ranks (gloo) and on GPUs (nccl).

``import gym_lightning`` registers their names with Lightning (``gym_lightning.registration``), so
``Trainer(strategy="zero3")`` works. The names and what each stands for are held once, in
``gym_lightning.vocabulary.STRATEGY_PRESETS`` (tests check this table against it):

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

import difflib

from lightning.pytorch.strategies import StrategyRegistry

from gym_lightning.strategies.base import GymStrategy
from gym_lightning.strategies.comm_hooks import bf16_allreduce_hook
from gym_lightning.strategies.ddp import GymDDPStrategy
from gym_lightning.strategies.fsdp import GymFSDPStrategy
from gym_lightning.strategies.parallel_dims import ParallelDims
from gym_lightning.strategies.zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from gym_lightning.vocabulary import AUTO_STRATEGY, STRATEGY_NAMES


def strategy_name_problem(name: str) -> str | None:
    """Why ``name`` is not a strategy Lightning can build (with the closest names and the full list), or ``None``.

    Lightning's own error lists a few of its names ("auto, ddp, ddp_spawn, deepspeed, ...") and none of ours.
    ``gym_auto`` is a name too: ``gym fit`` replaces it with the planner's choice (``cli.resolve_auto_strategy``).
    """
    known = StrategyRegistry.available_strategies()
    if name.lower() in ("auto", AUTO_STRATEGY) or name.lower() in known:
        return None
    names = [*STRATEGY_NAMES, AUTO_STRATEGY]
    close = difflib.get_close_matches(name.lower(), list(dict.fromkeys([*names, *known])), n=3)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    # The *_find_unused_parameters_* variants are spelt-out options of ddp/ddp_spawn/...: listed once as "...".
    others = sorted(n for n in set(known) - set(STRATEGY_NAMES) if "find_unused" not in n)
    return (
        f"not a strategy name. {hint}gym_lightning's strategies: {', '.join(STRATEGY_NAMES)}, and {AUTO_STRATEGY} "
        f"(the planner picks the fastest of them that fits); Lightning's: auto, "
        f"{', '.join(others)}. Or give a class: {{class_path: gym_lightning.strategies.ZeROStrategy, init_args: ...}}."
    )


__all__ = [
    "STRATEGY_NAMES",
    "GymDDPStrategy",
    "GymFSDPStrategy",
    "GymStrategy",
    "ParallelDims",
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "ZeROStrategy",
    "bf16_allreduce_hook",
    "strategy_name_problem",
]
