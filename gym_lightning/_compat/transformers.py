"""Private and undocumented transformers members: the declared inventory and the functions through which the package
reaches them (``gym_lightning._compat`` says why). transformers is imported lazily where it is needed."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

# Private transformers members, named with the module that assigns them (checked by tests/test_compat.py).
TRANSFORMERS_MEMBERS: tuple[tuple[str, str], ...] = (
    # The conversion table from_pretrained loaded a model with; save_pretrained reverts that one
    # (core_model_loading.revert_weight_conversion), and so does the exporter (models/conversion.py).
    ("transformers.core_model_loading", "_weight_conversions"),
    # Undocumented: marks DeepSpeed's zero.Init as open already, so that from_config under transformers' ZeRO-3
    # integration neither opens another one nor gathers every module to initialise it (initialize_weights_zero3).
    ("transformers.modeling_utils", "set_zero3_state"),
    # The attention implementation a built model's attention layers look up at every call (a config property;
    # set_attn_implementation validates against the installed kernels, which a registered name is not).
    ("transformers.configuration_utils", "_attn_implementation"),
)


def attention_implementation(config: Any) -> str | None:
    """The attention implementation the model of ``config`` runs (``_attn_implementation``, declared above)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, name: str) -> None:
    """Make the built model of ``config`` attend with ``name`` from its next call (a registered implementation)."""
    config._attn_implementation = name


def weight_conversions_of(model: nn.Module) -> list[Any] | None:
    """The weight transforms ``from_pretrained`` loaded ``model`` with, or ``None`` (built another way)."""
    return getattr(model, "_weight_conversions", None)


def zero3_init_open() -> contextlib.AbstractContextManager[None]:
    """transformers' own marker that a ``zero.Init`` context is open (``set_zero3_state``, declared above): a
    model built inside it is neither wrapped in a second ``zero.Init`` nor initialised by gathers."""
    from transformers.modeling_utils import set_zero3_state

    return set_zero3_state()


__all__ = [
    "TRANSFORMERS_MEMBERS",
    "attention_implementation",
    "set_attention_implementation",
    "weight_conversions_of",
    "zero3_init_open",
]
