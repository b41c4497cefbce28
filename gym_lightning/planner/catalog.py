"""The planner's model catalogue: shapes of public models by name (``gym plan --model llama-3-70b``), presets and
local ``config.json`` files, resolved into ``models.shapes.ModelShape``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gym_lightning.errors import GymUserError
from gym_lightning.models.presets import is_preset, preset_config
from gym_lightning.models.shapes import ModelShape, shape_from_config


def _shape(
    name: str, h: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool, **extra: object
) -> ModelShape:
    head_dim = int(extra.pop("head_dim", h // heads))
    return ModelShape(name, h, inter, layers, heads, kv, head_dim, vocab, tied, **extra)  # type: ignore[arg-type]


_MOE = {"head_dim": 128, "qk_norm": True, "num_experts": 128, "experts_per_token": 8}  # the Qwen3-MoE family's

# Shapes copied from each model's config.json on the Hugging Face hub (weights are never needed). The published
# parameter count of each is in PUBLISHED_PARAMS; tests check the computed counts against it.
BUNDLED: dict[str, ModelShape] = {
    "llama-3.2-1b": _shape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, True, head_dim=64),
    "llama-3.2-3b": _shape("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128256, True),
    "llama-3-8b": _shape("llama-3-8b", 4096, 14336, 32, 32, 8, 128256, False),
    "llama-3-70b": _shape("llama-3-70b", 8192, 28672, 80, 64, 8, 128256, False),
    "llama-3.1-405b": _shape("llama-3.1-405b", 16384, 53248, 126, 128, 8, 128256, False),
    "mistral-7b": _shape("mistral-7b", 4096, 14336, 32, 32, 8, 32000, False),
    "qwen2.5-7b": _shape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, False, attention_bias=True),
    "qwen2.5-72b": _shape("qwen2.5-72b", 8192, 29568, 80, 64, 8, 152064, False, attention_bias=True),
    "qwen3-0.6b": _shape("qwen3-0.6b", 1024, 3072, 28, 16, 8, 151936, True, head_dim=128, qk_norm=True),
    "qwen3-1.7b": _shape("qwen3-1.7b", 2048, 6144, 28, 16, 8, 151936, True, head_dim=128, qk_norm=True),
    "qwen3-4b": _shape("qwen3-4b", 2560, 9728, 36, 32, 8, 151936, True, head_dim=128, qk_norm=True),
    "qwen3-8b": _shape("qwen3-8b", 4096, 12288, 36, 32, 8, 151936, False, head_dim=128, qk_norm=True),
    "qwen3-14b": _shape("qwen3-14b", 5120, 17408, 40, 40, 8, 151936, False, head_dim=128, qk_norm=True),
    "qwen3-32b": _shape("qwen3-32b", 5120, 25600, 64, 64, 8, 151936, False, head_dim=128, qk_norm=True),
    # Mixtures of experts: every layer sparse, 128 experts of which 8 per token.
    "qwen3-30b-a3b": _shape("qwen3-30b-a3b", 2048, 6144, 48, 32, 4, 151936, False, moe_intermediate_size=768, **_MOE),
    "qwen3-235b-a22b": _shape(
        "qwen3-235b-a22b", 4096, 12288, 94, 64, 4, 151936, False, moe_intermediate_size=1536, **_MOE
    ),
}

# Parameter counts from the model cards (billions, as rounded there): what the computed counts are checked against.
PUBLISHED_PARAMS: dict[str, float] = {
    "llama-3.2-1b": 1.24,
    "llama-3.2-3b": 3.21,
    "llama-3-8b": 8.03,
    "llama-3-70b": 70.6,
    "llama-3.1-405b": 405.9,
    "mistral-7b": 7.24,
    "qwen2.5-7b": 7.61,
    "qwen2.5-72b": 72.7,
    "qwen3-0.6b": 0.6,
    "qwen3-1.7b": 1.7,
    "qwen3-4b": 4.0,
    "qwen3-8b": 8.2,
    "qwen3-14b": 14.8,
    "qwen3-32b": 32.8,
    "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235.0,
}

# Activated parameters of the mixtures of experts, from the same model cards (billions).
PUBLISHED_ACTIVE_PARAMS: dict[str, float] = {"qwen3-30b-a3b": 3.3, "qwen3-235b-a22b": 22.0}


def resolve_shape(model: str, config_overrides: Mapping[str, Any] | None = None) -> ModelShape:
    """The shape named by ``model``: a bundled name, a gym_lightning preset, a ``config.json`` / model folder, or a
    hub name whose last part is a bundled name (``Qwen/Qwen3-0.6B``: no download).

    Args:
        model: What ``gym plan --model`` and a run's ``model.model`` take.
        config_overrides: ``config.json`` keys to change first, as ``CausalLMModule(config_overrides=...)`` does; a
            bundled name has no ``config.json`` and refuses them.
    """
    overrides = dict(config_overrides or {})
    path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
    bundled = BUNDLED.get(model.lower())
    if bundled is None and not is_preset(model) and not path.is_file():
        bundled = BUNDLED.get(model.lower().rsplit("/", 1)[-1])  # a hub name (its config.json is not fetched)
    if bundled is not None and overrides:
        raise GymUserError(
            f"config_overrides {sorted(overrides)} need the model's config.json; {model!r} is planned from the "
            "planner's bundled shape: pass a local config.json or model folder instead."
        )
    if bundled is not None:
        return bundled
    if is_preset(model):
        return shape_from_config({**preset_config(model).to_dict(), **overrides}, model)
    if path.is_file():
        return shape_from_config({**json.loads(path.read_text()), **overrides}, model)
    raise GymUserError(
        f"Unknown model {model!r}: pass a bundled name ({', '.join(BUNDLED)}), a gym_lightning preset "
        f"(tiny-llama, tiny-qwen3), or a local Hugging Face config.json / model folder."
    )
