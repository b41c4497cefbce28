"""Training objectives over the LM engine (``objectives.base``): ``sft`` and ``pt`` (``objectives.sft``)."""

from gym_lightning.objectives.base import (
    OBJECTIVES,
    Objective,
    ValidationLoss,
    objective_from_value,
    register_objective,
)
from gym_lightning.objectives.sft import SFT, ContinuedPretraining

__all__ = [
    "OBJECTIVES",
    "SFT",
    "ContinuedPretraining",
    "Objective",
    "ValidationLoss",
    "objective_from_value",
    "register_objective",
]
