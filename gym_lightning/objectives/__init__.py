"""Training objectives over the LM engine (``objectives.base``): ``sft`` and ``pt`` (``objectives.sft``); the preference
objectives ``dpo``, ``kto``, ``orpo`` and ``simpo`` (``objectives.preference`` holds what they share)."""

from gym_lightning.objectives.base import (
    OBJECTIVES,
    Objective,
    ValidationLoss,
    objective_from_value,
    register_objective,
)
from gym_lightning.objectives.dpo import DPO
from gym_lightning.objectives.kto import KTO
from gym_lightning.objectives.orpo import ORPO
from gym_lightning.objectives.sft import SFT, ContinuedPretraining
from gym_lightning.objectives.simpo import SimPO

__all__ = [
    "DPO",
    "KTO",
    "OBJECTIVES",
    "ORPO",
    "SFT",
    "ContinuedPretraining",
    "Objective",
    "SimPO",
    "ValidationLoss",
    "objective_from_value",
    "register_objective",
]
