"""Model construction: built-in presets, loading from local folders or the Hugging Face Hub, and the build plan
through which a strategy says how it wants a model built (``models.plan``). Nothing here imports a strategy."""

from gym_lightning.models.facts import ModelFacts, model_facts
from gym_lightning.models.loading import apply_config_overrides, build_causal_lm, load_model_config
from gym_lightning.models.plan import BuildPlan, WeightsSource, plan_of, reference_state_dict
from gym_lightning.models.presets import PRESETS, is_preset, preset_config

__all__ = [
    "PRESETS",
    "BuildPlan",
    "ModelFacts",
    "WeightsSource",
    "apply_config_overrides",
    "build_causal_lm",
    "is_preset",
    "load_model_config",
    "model_facts",
    "plan_of",
    "preset_config",
    "reference_state_dict",
]
