"""A model whose linear layers are built as ``NF4Linear`` and whose fused expert weights are NF4 (``quant.experts``),
and its quantised weights read from a checkpoint by rows.

Quantise as you read: the builder never creates the 16-bit linear or expert weights (``nf4_linears`` builds the
layers as ``NF4Linear`` directly, ``quant.experts.experts_built_as_nf4`` the experts with integer parts, on the meta
device or under ZeRO-3's ``zero.Init``), and a loader hands each caller the quantisation of only the checkpoint rows
it holds (:class:`RowQuantizer`; an expert weight's dim-0 rows are whole experts, read from their own per-expert
checkpoint tensors). Because ``quant.nf4`` keeps all state per row, those rows are exactly the rows of the whole
weight's quantisation, on any rank count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from gym_lightning.lazy import LazyTensor
from gym_lightning.lora import checkpoint_key
from gym_lightning.models.conversion import (
    SafetensorsReader,
    TensorSource,
    checkpoint_sources,
    read_rows,
    tied_groups,
)
from gym_lightning.quant import experts as nf4_experts_module
from gym_lightning.quant import nf4
from gym_lightning.quant.config import QuantizationArgs
from gym_lightning.quant.linear import COMPONENTS, NF4Linear, linears_built_as

_LINEAR = nn.modules.linear.Linear  # the class itself, whatever ``nn.Linear`` names during a build


def quantizable(name: str, module: nn.Module, args: QuantizationArgs) -> bool:
    """Whether the linear layer ``name`` is stored in NF4: not skipped by name, and its rows split into blocks."""
    return not nf4_experts_module.skipped(name, args.skip_modules) and module.in_features % args.block_size == 0


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


@contextmanager
def nf4_experts(args: QuantizationArgs, config: PretrainedConfig) -> Iterator[None]:
    """While open, the experts modules of a ``config`` model build hold their fused weights in NF4
    (``quant.experts.experts_built_as_nf4``); ``skip_modules: [experts]`` keeps every one in 16 bits (a full
    module or weight name is honoured by :func:`restore_skipped`, once names exist)."""
    classes = [] if "experts" in args.skip_modules else _experts_classes(config)
    with nf4_experts_module.experts_built_as_nf4(classes, args):
        yield


def _experts_classes(config: PretrainedConfig) -> list[type[nn.Module]]:
    """The experts classes of the modeling module of ``config``'s causal LM (none for remote code: transformers'
    experts classes are what ``quant.experts`` knows)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return []
    return nf4_experts_module.experts_classes(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])


def restore_skipped(model: PreTrainedModel, args: QuantizationArgs) -> None:
    """Each NF4Linear of ``model`` that :func:`quantizable` keeps in full precision (the LM head, ``skip_modules``)
    replaced by an ``nn.Linear`` made where the layer was (the meta device, or partitioned under ``zero.Init``),
    its weight left to the loader; tied weights are tied again (a tied LM head was tied into the NF4 stand-in).
    The output embedding is never quantised (transformers' bitsandbytes integration keeps it too). Experts modules
    whose module or weight names ``skip_modules`` names are built again with those weights in 16 bits
    (``quant.experts.restore_skipped_experts``)."""
    nf4_experts_module.restore_skipped_experts(model, args, model.dtype)
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


@dataclass(frozen=True)
class QuantizedWeight:
    """One NF4 weight of a model, as a loader fills it: an ``NF4Linear``'s or an experts module's fused weight.

    Args:
        module: The module holding its parameters.
        names: ``{parameter name: nf4 part}``, the codes' first (``weight`` or the expert weight's name).
        rows: Its dim-0 size (output rows of a linear layer, experts of a fused weight): every part has it.
        block_size: Weights per scale along a row.
        double_quant: Whether the scales are quantised too.
        quant_type: ``nf4`` or ``fp4``.
    """

    module: nn.Module
    names: dict[str, str]
    rows: int
    block_size: int
    double_quant: bool
    quant_type: str

    @property
    def codes(self) -> str:
        """The name of the codes' parameter, whose checkpoint tensor is the 16-bit weight."""
        return next(iter(self.names))

    def parameters(self) -> dict[str, nn.Parameter]:
        """``{parameter name: parameter}`` of its parts."""
        return {name: getattr(self.module, name) for name in self.names}


def nf4_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """``{checkpoint key of its codes: QuantizedWeight}`` for every NF4 weight of ``model``: the NF4Linear layers'
    (:func:`nf4_layers`) and the experts modules' (``quant.experts``), peft's wrapper names removed."""
    found = {
        key: QuantizedWeight(
            layer,
            {name: part for name, part in COMPONENTS.items() if hasattr(layer, name)},
            layer.out_features,
            layer.block_size,
            layer.double_quant,
            layer.quant_type,
        )
        for key, layer in nf4_layers(model).items()
    }
    for key, (experts, name) in nf4_experts_module.nf4_expert_weights(model).items():
        spec = nf4_experts_module.nf4_weights_of(experts)[name]
        names = nf4_experts_module.stored_components(name, spec)
        found[checkpoint_key(key)] = QuantizedWeight(
            experts, names, spec.shape[0], spec.block_size, spec.double_quant, spec.quant_type
        )
    return found


def without_quant_state(keys: Iterable[str], weights: dict[str, QuantizedWeight]) -> list[str]:
    """``keys`` (checkpoint keys) without the NF4 scale tensors, which are made with their weight's codes."""
    extra = {
        key.removesuffix(weight.codes) + name
        for key, weight in weights.items()
        for name in weight.names
        if name != weight.codes
    }
    return [key for key in keys if key not in extra]


class RowQuantizer:
    """The NF4 quantisation of rows of a checkpoint weight, read and quantised only for those rows; the last result
    is kept, so the codes and scales of one layer's rows are made once.

    Args:
        model: The model the checkpoint is mapped to (``models.conversion``).
        reader: The checkpoint's tensors.
        sources: ``{checkpoint key: TensorSource}`` of the quantised weights (a fused expert weight's source reads
            only the experts of the rows asked for, ``TensorSource.by_rows``).
        layers: ``{checkpoint key: QuantizedWeight}`` (:func:`nf4_weights`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        reader: SafetensorsReader,
        sources: dict[str, TensorSource],
        layers: dict[str, QuantizedWeight],
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
        """Rows ``first:last`` of the component ``name`` (e.g. ``weight_scales``, ``down_proj_scales``) of weight
        ``key``: every component keeps its state per row, so these are those rows of the whole weight's
        quantisation (for fused experts: experts ``first:last``)."""
        return self.rows(key, first, last)[self.layers[key].names[name]]

    def whole(self, key: str, name: str) -> torch.Tensor:
        """The whole component ``name`` (e.g. ``weight_scales``) of weight ``key``."""
        return self.component(key, name, 0, self.layers[key].rows)


def sources_of(
    model: PreTrainedModel, stored: Iterable[str], targets: dict[str, torch.Tensor]
) -> tuple[dict[str, list[str]], dict[str, TensorSource], dict[str, QuantizedWeight]]:
    """For a loader: ``targets``' keys grouped by tensor (``{checkpoint key: model keys}``, the NF4 scales left
    out), their checkpoint sources (the 16-bit weight of an NF4 weight included), and the NF4 weights (linear
    layers' and fused experts') by checkpoint key."""
    layers = nf4_weights(model)
    groups = {checkpoint_key(group[0]): group for group in tied_groups(targets)}
    groups = {key: groups[key] for key in without_quant_state(groups, layers)}
    return groups, checkpoint_sources(model, stored, groups), layers


def dequantized_tensors(tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """``tensors`` (a state dict's, lazy) with each NF4 weight's codes and scales replaced by its dequantised
    weight in fp32 (the values the layer computes with, rounded once, when the exporter writes its dtype), at the
    codes' place and under the codes' name: an NF4 layer's ``weight``, an experts module's fused ``gate_up_proj``
    ``[E, R, C]`` (which the exporter's checkpoint layout then splits into per-expert tensors). An exporter walking
    the result still holds one weight at a time, and its loads (collectives under sharding) keep their order on
    every rank. A quantised weight is known by its integer codes ``X`` beside an ``X_scales``, so this works on a
    live model's tensors and on a checkpoint's alike."""
    codes = {key.removesuffix("_scales") for key in tensors if key.endswith("_scales")}
    quantized = {key for key in codes if key in tensors and tensors[key].dtype == torch.uint8}
    parts_of = {f"{codes}{suffix}": codes for codes in quantized for suffix in nf4_experts_module.SUFFIXES}
    out: dict[str, LazyTensor] = {}
    for key, tensor in tensors.items():
        if key not in parts_of:
            out[key] = tensor
        elif key in quantized:
            suffixes = nf4_experts_module.SUFFIXES.items()
            parts = {part: tensors[key + suffix] for suffix, part in suffixes if key + suffix in tensors}
            out[key] = _dequantized(parts)
    return out


def _dequantized(parts: dict[str, LazyTensor]) -> LazyTensor:
    *lead, half = parts["codes"].shape

    def load() -> torch.Tensor:
        return nf4.dequantize({part: tensor.load() for part, tensor in parts.items()}, torch.float32)

    return LazyTensor((*lead, 2 * half), torch.float32, load)


__all__ = [
    "QuantizedWeight",
    "RowQuantizer",
    "dequantized_tensors",
    "nf4_experts",
    "nf4_layers",
    "nf4_linears",
    "nf4_weights",
    "quantizable",
    "restore_skipped",
    "sources_of",
    "without_quant_state",
]
