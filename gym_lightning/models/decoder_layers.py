"""A model's decoder layers, as transformers names them: the unit that FSDP2 shards, ZeRO-3 gathers whole and
regional compilation compiles (pure functions over a built model)."""

from __future__ import annotations

from torch import nn


def decoder_layer_names(model: nn.Module) -> set[str]:
    """Class names of the model's decoder layers: the union of ``_no_split_modules`` of every Hugging Face model
    inside ``model`` (the classes transformers never splits across devices)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` (outermost matches only: a layer inside a layer is part of it)."""
    names = decoder_layer_names(model)
    layers: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__ in names and not any(module in set(layer.modules()) for layer in layers[-1:]):
            layers.append(module)
    return layers


__all__ = ["decoder_layer_names", "decoder_layers"]
