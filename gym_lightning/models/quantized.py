"""A model whose linear layers are built as ``NF4Linear``, and its quantised weights read from a checkpoint by rows.

Quantise as you read: the builder never creates the 16-bit linear weights (``nf4_linears`` builds the layers as
``NF4Linear`` directly, on the meta device or under ZeRO-3's ``zero.Init``), and a loader hands each caller the
quantisation of only the checkpoint rows it holds (:class:`RowQuantizer`). Because ``quant.nf4`` keeps all state per
row, those rows are exactly the rows of the whole weight's quantisation, on any rank count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from gym_lightning.lazy import LazyTensor
from gym_lightning.lora import checkpoint_key
from gym_lightning.models.conversion import (
    SafetensorsReader,
    TensorSource,
    checkpoint_sources,
    read_rows,
    tied_groups,
)
from gym_lightning.quant import nf4
from gym_lightning.quant.config import QuantizationArgs
from gym_lightning.quant.linear import COMPONENTS, NF4Linear, linears_built_as

_LINEAR = nn.modules.linear.Linear  # the class itself, whatever ``nn.Linear`` names during a build


def quantizable(name: str, module: nn.Module, args: QuantizationArgs) -> bool:
    """Whether the linear layer ``name`` is stored in NF4: not skipped by name, and its rows split into blocks."""
    last = name.rpartition(".")[2]
    if any(skip in (name, last) or name.endswith(f".{skip}") for skip in args.skip_modules):
        return False
    return module.in_features % args.block_size == 0


@contextmanager
def nf4_linears(args: QuantizationArgs) -> Iterator[None]:
    """While open, every linear layer a model build creates whose input width splits into blocks is an NF4Linear;
    :func:`restore_skipped` then puts back the ones that stay in full precision (the layer names are known only
    once the model is built)."""
    layer = partial(
        NF4Linear,
        block_size=args.block_size,
        double_quant=args.double_quant,
        compute_dtype=args.dtype,
        quant_type=args.quant_type,
    )
    with linears_built_as(lambda width, _: layer if width % args.block_size == 0 else None):
        yield


def restore_skipped(model: PreTrainedModel, args: QuantizationArgs) -> None:
    """Each NF4Linear of ``model`` that :func:`quantizable` keeps in full precision (the LM head, ``skip_modules``)
    replaced by an ``nn.Linear`` made where the layer was (the meta device, or partitioned under ``zero.Init``),
    its weight left to the loader; tied weights are tied again (a tied LM head was tied into the NF4 stand-in).
    The output embedding is never quantised (transformers' bitsandbytes integration keeps it too)."""
    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if isinstance(module, NF4Linear) and (module is head or not quantizable(name, module, args)):
            parent, _, attr = name.rpartition(".")
            device = next(module.parameters()).device
            full = _LINEAR(module.in_features, module.out_features, module.bias is not None, device, model.dtype)
            setattr(model.get_submodule(parent), attr, full)
    model.tie_weights()


def nf4_layers(model: nn.Module) -> dict[str, NF4Linear]:
    """``{checkpoint key of its weight: layer}`` for every NF4Linear of ``model`` (peft's wrapper names removed)."""
    return {
        checkpoint_key(f"{name}.weight" if name else "weight"): module
        for name, module in model.named_modules()
        if isinstance(module, NF4Linear)
    }


def without_quant_state(keys: Iterable[str], layers: dict[str, NF4Linear]) -> list[str]:
    """``keys`` (checkpoint keys) without the NF4 scale tensors, which are made with their layer's ``weight``."""
    extra = {key.removesuffix("weight") + name for key in layers for name in COMPONENTS if name != "weight"}
    return [key for key in keys if key not in extra]


class RowQuantizer:
    """The NF4 quantisation of rows of a checkpoint weight, read and quantised only for those rows; the last result
    is kept, so the codes and scales of one layer's rows are made once.

    Args:
        model: The model the checkpoint is mapped to (``models.conversion``).
        reader: The checkpoint's tensors.
        sources: ``{checkpoint key: TensorSource}`` of the quantised layers' weights.
        layers: ``{checkpoint key: NF4Linear}`` (:func:`nf4_layers`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        reader: SafetensorsReader,
        sources: dict[str, TensorSource],
        layers: dict[str, NF4Linear],
    ) -> None:
        self.model, self.reader, self.sources, self.layers = model, reader, sources, layers
        self._last: tuple[tuple[str, int, int], dict[str, torch.Tensor]] | None = None

    def rows(self, key: str, first: int, last: int) -> dict[str, torch.Tensor]:
        """``nf4.quantize`` of rows ``first:last`` of the weight ``key``."""
        if self._last is not None and self._last[0] == (key, first, last):
            return self._last[1]
        layer = self.layers[key]
        weight = read_rows(self.sources[key], self.reader, self.model, first, last)
        parts = nf4.quantize(weight, layer.block_size, layer.double_quant, layer.quant_type)
        self._last = ((key, first, last), parts)
        return parts

    def component(self, key: str, name: str, first: int, last: int) -> torch.Tensor:
        """Rows ``first:last`` of the component ``name`` (e.g. ``weight_scales``) of layer ``key``: every component
        keeps its state per row, so these are those rows of the whole weight's quantisation."""
        return self.rows(key, first, last)[COMPONENTS[name]]

    def whole(self, key: str, name: str) -> torch.Tensor:
        """The whole component ``name`` (e.g. ``weight_scales``) of layer ``key``."""
        return self.component(key, name, 0, self.layers[key].out_features)


def sources_of(
    model: PreTrainedModel, stored: Iterable[str], targets: dict[str, torch.Tensor]
) -> tuple[dict[str, list[str]], dict[str, TensorSource], dict[str, NF4Linear]]:
    """For a loader: ``targets``' keys grouped by tensor (``{checkpoint key: model keys}``, the NF4 scales left
    out), their checkpoint sources (the weight of an NF4 layer included), and the NF4 layers by checkpoint key."""
    layers = nf4_layers(model)
    groups = {checkpoint_key(group[0]): group for group in tied_groups(targets)}
    groups = {key: groups[key] for key in without_quant_state(groups, layers)}
    return groups, checkpoint_sources(model, stored, groups), layers


def dequantized_tensors(tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """``tensors`` (a state dict's, lazy) with each NF4 layer's codes and scales replaced by its dequantised
    ``weight`` in fp32 (the values the layer computes with, rounded once, when the exporter writes its dtype), at the
    codes' place: an exporter walking the result still holds one layer at a time, and its loads (collectives under
    sharding) keep their order on every rank. A layer is known by its ``weight_scales``, so this works on a live
    model's tensors and on a checkpoint's alike."""
    layers = {key.removesuffix("_scales") for key in tensors if key.endswith(".weight_scales")}
    out: dict[str, LazyTensor] = {}
    for key, tensor in tensors.items():
        base, _, suffix = key.rpartition(".")
        if f"{base}.weight" not in layers or suffix not in COMPONENTS:
            out[key] = tensor
        elif suffix == "weight":
            parts = {COMPONENTS[name]: tensors[f"{base}.{name}"] for name in COMPONENTS if f"{base}.{name}" in tensors}
            out[key] = _dequantized(parts)
    return out


def _dequantized(parts: dict[str, LazyTensor]) -> LazyTensor:
    rows, half = parts["codes"].shape

    def load() -> torch.Tensor:
        return nf4.dequantize({part: tensor.load() for part, tensor in parts.items()}, torch.float32)

    return LazyTensor((rows, 2 * half), torch.float32, load)


__all__ = [
    "RowQuantizer",
    "dequantized_tensors",
    "nf4_layers",
    "nf4_linears",
    "quantizable",
    "restore_skipped",
    "sources_of",
    "without_quant_state",
]
