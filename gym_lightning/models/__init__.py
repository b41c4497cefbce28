"""Model construction: built-in presets and loading from local folders or the Hugging Face Hub."""

from gym_lightning.models.loading import apply_config_overrides, build_causal_lm, load_model_config
from gym_lightning.models.presets import PRESETS, is_preset, preset_config

__all__ = ["PRESETS", "apply_config_overrides", "build_causal_lm", "is_preset", "load_model_config", "preset_config"]
