"""What a strategy may need to know of a model before it exists: its width and the size of one decoder layer.

DeepSpeed sizes its buffers from the model (``strategies.zero.sizing``: buckets and ZeRO-3's gathered-parameter
limits of one decoder layer; the Hugging Face integration's hidden-size rules) when it initialises, and under ZeRO-3
that is before ``configure_model`` builds the model inside ``zero.Init``. So the facts come from the model config,
through ``protocols.ProvidesModelFacts`` on the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import shape_from_config
from gym_lightning.protocols import ProvidesModelFacts


@dataclass(frozen=True)
class ModelFacts:
    """A model's facts; ``None`` means "not known".

    Args:
        hidden_size: The model width (DeepSpeed's Hugging Face-style bucket sizes scale with it).
        layer_numel: Elements of the model's largest decoder layer (the unit ZeRO-3 gathers and FSDP shards).
    """

    hidden_size: int | None = None
    layer_numel: int | None = None


def hidden_size_of(model_config: Any) -> int | None:
    """The model width as HF picks it: ``hidden_size``, else the largest ``hidden_sizes``, else the text config's."""
    for candidate in (model_config, getattr(model_config, "text_config", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None) is not None:
            return int(candidate.hidden_size)
        if getattr(candidate, "hidden_sizes", None):
            return int(max(candidate.hidden_sizes))
    return None


def layer_numel_of(model_config: Any, name: str) -> int | None:
    """Elements of one decoder layer of a Llama/Mistral/Qwen-style config (``models.shapes``), else ``None``."""
    try:
        return shape_from_config(model_config.to_dict(), name).layer_params()
    except GymUserError:
        return None


def model_facts(model_config: Any, name: str) -> ModelFacts:
    """The :class:`ModelFacts` of the model ``model_config`` describes (``name`` labels errors)."""
    return ModelFacts(hidden_size=hidden_size_of(model_config), layer_numel=layer_numel_of(model_config, name))


def model_facts_of(module: object) -> ModelFacts:
    """``module.model_facts()`` when the module states them (``protocols.ProvidesModelFacts``), else all unknown."""
    return module.model_facts() if isinstance(module, ProvidesModelFacts) else ModelFacts()


__all__ = ["ModelFacts", "hidden_size_of", "layer_numel_of", "model_facts", "model_facts_of"]
