"""ZeRO-3's partitioned parameters: each rank reading its partitions' slices of a pretrained folder (no collective),
overwriting a partitioned model with one process's values one module at a time, and gathering a full tensor for the
exporter (collectives: every rank calls them in the same order)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from gym_lightning._compat import zero3_full_shape, zero3_partition
from gym_lightning.lazy import LazyTensor, eager
from gym_lightning.lora import ADAPTER_RNG_STATE, checkpoint_key, is_adapter_key
from gym_lightning.models.conversion import SafetensorsReader, TensorSource, convert, flat_range, refuse_missing
from gym_lightning.models.quantized import RowQuantizer, sources_of
from gym_lightning.quant.linear import COMPONENTS


@torch.no_grad()
def read_partitions(model: PreTrainedModel, folder: str) -> None:
    """Each rank fills its partitions of ``model``'s parameters from ``folder``'s safetensors files, reading only the
    checkpoint rows they cover, mapped as ``from_pretrained`` maps them (``models.conversion``: fused experts
    included); buffers the checkpoint holds are read whole. LoRA adapters keep their values.

    No collective: ``from_pretrained`` under ZeRO-3 reads the whole checkpoint on rank 0 and gathers every module on
    every rank to copy it in; here no rank holds more than its partitions plus the rows of one tensor.
    """
    reader = SafetensorsReader(folder)
    state = model.state_dict(keep_vars=True)
    groups, sources, layers = sources_of(model, reader.where, state)
    refuse_missing(folder, [key for key in groups if key not in sources and not is_adapter_key(key)])
    if layers:
        _read_quantized_partitions(RowQuantizer(model, reader, sources, layers))
    swapped: list[tuple[TensorSource, torch.Tensor]] = []
    for key, source in sources.items():
        if key in layers:
            continue
        tensor = state[groups[key][0]]
        partition, shape = zero3_partition(tensor), zero3_full_shape(tensor)
        if partition is not None and shape is not None:
            local, span = partition
            local[: len(span)].copy_(flat_range(source, reader, model, shape, span))
        elif shape is None:  # a buffer, or a parameter ZeRO-3 does not partition
            tensor.data.copy_(convert(source, reader.load, model))
        else:
            swapped.append((source, tensor))
    for source, tensor in swapped:  # partitions on NVMe: gathered one by one, written from rank 0 (collectives)
        _overwrite_whole(tensor, lambda source=source: convert(source, reader.load, model))


def _read_quantized_partitions(quantizer: RowQuantizer) -> None:
    """Each NF4 layer's partitions (codes and scales) from the quantisation of only the checkpoint rows they span;
    partitions on NVMe are quantised whole on rank 0 and written through a gather (collectives)."""
    for key, layer in quantizer.layers.items():
        for name in COMPONENTS:
            if (param := getattr(layer, name, None)) is None:
                continue
            partition, shape = zero3_partition(param), zero3_full_shape(param)
            whole = partial(quantizer.whole, key, name)
            if partition is not None and shape is not None:
                local, span = partition
                local[: len(span)].copy_(quantizer.span(key, name, tuple(shape), span))
            elif shape is None:  # a parameter ZeRO-3 does not partition: whole on every rank
                param.data.copy_(whole())
            else:
                _overwrite_whole(param, whole)


def replace_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """``model``'s non-persistent buffers named in ``buffers`` replaced by those tensors (their values and dtypes),
    on the device each buffer was on. ZeRO-3 never partitions buffers: every rank sets its own."""
    for key, value in buffers.items():
        owner, _, name = key.rpartition(".")
        module = model.get_submodule(owner)
        module.register_buffer(name, value.to(getattr(module, name).device), persistent=False)


def draw_partitioned_adapters(model: nn.Module) -> None:
    """peft's own initialisation of every LoRA adapter of ``model`` (``lora_B = 0``: the wrapped model starts as
    the base model), drawn on rank 0 and partitioned again (a collective per adapted layer).

    Why: under ``zero.Init`` the adapters peft creates are partitioned as they are created, with ``nn.Linear``'s
    random initialisation, and peft's reset then writes into the empty placeholders, which changes nothing; the
    adapters kept ``lora_B != 0`` and a LoRA run started 0.8 logits away from its base model (tiny models, measured).
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # LoRA is an extra: without peft there are no adapters
        return
    with torch.random.fork_rng(devices=[]):
        if (state := model.__dict__.get(ADAPTER_RNG_STATE)) is not None:
            torch.set_rng_state(state)  # the draws of lora.draw_adapters, layer by layer, in the same order
        for module in model.modules():
            if isinstance(module, LoraLayer):
                _reset_partitioned(module)


def _reset_partitioned(module: nn.Module) -> None:
    """peft's initialisation of ``module``'s adapters, on rank 0, within a gather of their partitions.

    peft's reset draws into plain fp32 CPU stand-ins, which are then copied into the gathered partitions: a gathered
    parameter lives on the GPU, where peft's draw would use the CUDA generator (the other strategies draw on the CPU,
    ``lora.draw_adapters``, so ZeRO-3 adapters differed from theirs on a GPU), and in the adapters' dtype, where
    torch's ``uniform_`` draws bf16 values differently (7 of 4,096 elements of a 64 x 64 kaiming draw come out at
    -bound instead of +bound, measured)."""
    import deepspeed

    entries = [
        (part, name, param)
        for adapter in module.lora_A
        for parts in (module.lora_A, module.lora_B)
        for part in parts[adapter].modules()
        for name, param in part.named_parameters(recurse=False)
    ]
    params = [param for _, _, param in entries]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=bool(params)):
        if torch.distributed.get_rank() != 0:
            return
        for part, name, param in entries:  # a registered name: setattr swaps the parameter, restored below
            setattr(part, name, nn.Parameter(param.data.detach().float().cpu(), requires_grad=param.requires_grad))
        try:
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, init_lora_weights=True)
            for part, name, param in entries:
                param.data.copy_(getattr(part, name).data)
        finally:
            for part, name, param in entries:
                setattr(part, name, param)


def _overwrite_whole(param: torch.Tensor, value: Callable[[], torch.Tensor]) -> None:
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            param.data.copy_(value())


def overwrite_partitioned(
    module: nn.Module, reference: dict[str, torch.Tensor], is_source: bool, prefix: str = ""
) -> None:
    """Depth-first: gather each module's own parameters, copy ``reference``'s values in on the source rank (0),
    re-partition them (``GatheredParameters`` with ``modifier_rank=0`` broadcasts the change)."""
    import deepspeed

    params = list(module.named_parameters(recurse=False))
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0, enabled=bool(params)):
        if is_source:
            for name, param in params:
                value = reference.get(checkpoint_key(prefix + name))
                if value is not None:  # parameters added after the build (LoRA adapters) keep their values
                    param.data.copy_(value)
    for name, child in module.named_children():
        overwrite_partitioned(child, reference, is_source, f"{prefix}{name}.")


def full_tensor(value: torch.Tensor) -> LazyTensor:
    """A ZeRO-3 parameter as a ``LazyTensor`` whose load gathers its partitions (a collective); buffers and
    persistent parameters are whole on every rank already."""
    shape = zero3_full_shape(value)
    if shape is None:
        return eager(value)

    def load_as(dtype: torch.dtype) -> torch.Tensor:
        import deepspeed

        # Copied out (the gathered storage is released on exit) and cast in one step: one copy, not two.
        with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
            return value.detach().to(device="cpu", dtype=dtype, copy=True)

    return LazyTensor(tuple(shape), value.dtype, lambda: load_as(value.dtype), load_as)


__all__ = [
    "draw_partitioned_adapters",
    "full_tensor",
    "overwrite_partitioned",
    "read_partitions",
    "replace_buffers",
]
