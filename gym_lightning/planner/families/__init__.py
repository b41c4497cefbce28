"""A cost model per strategy family: memory per phase, collectives, optimizer and host work behind one interface
(:class:`~gym_lightning.planner.families.base.CostModel`). ``cost_model(strategy, shape, spec)`` is the only place
a strategy row's family is looked up; nothing else in the planner branches on it."""

from __future__ import annotations

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.families.base import CostModel, ModelStates, PhasePeak, Traffic
from gym_lightning.planner.families.fsdp import FSDP
from gym_lightning.planner.families.replicated import Replicated
from gym_lightning.planner.families.zero import ZeRO
from gym_lightning.planner.spec import RunSpec
from gym_lightning.planner.strategies import Strategy

FAMILIES: dict[str, type[CostModel]] = {"replicated": Replicated, "fsdp": FSDP, "zero": ZeRO}


def cost_model(strategy: Strategy, shape: ModelShape, spec: RunSpec) -> CostModel:
    """The cost model of ``strategy``'s family for ``shape`` trained as ``spec`` describes."""
    return FAMILIES[strategy.family](strategy, shape, spec)


__all__ = ["FAMILIES", "CostModel", "ModelStates", "PhasePeak", "Traffic", "cost_model"]
