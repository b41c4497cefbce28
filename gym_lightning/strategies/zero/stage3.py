"""ZeRO-3's partitioned parameters: what each rank holds of them for the one weight loader (``models.fill``:
its partitions' slices of a pretrained folder, no collective), overwriting a partitioned model with one process's
values one module at a time, and gathering a full tensor for the exporter (collectives: every rank calls them in the
same order)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from gym_lightning._compat import zero3_full_shape, zero3_partition
from gym_lightning.lazy import LazyTensor, eager
from gym_lightning.lora import ADAPTER_RNG_STATE, checkpoint_key
from gym_lightning.models.fill import fill_weights
from gym_lightning.models.holdings import Part, Span, Value, Whole
from gym_lightning.models.plan import WeightsSource, reference_buffers

_T = TypeVar("_T")
# ZeROStrategy._without_zero_init: ``build(source)`` with the strategy's transformers DeepSpeed integration off.
Alone = Callable[[Callable[[WeightsSource], _T], WeightsSource], _T]


def fill_partitions(built: list[tuple[nn.Module, WeightsSource]], alone: Alone) -> None:
    """Give the models built under ``zero.Init`` (``built``: what the build plan recorded) their weights, through the
    one loader every strategy uses (``models.fill``) and :class:`Partitions`. A pretrained folder: each rank reads
    only its partitions' slices (no collective but for partitions on NVMe; no rank holds the model). A random
    initialisation: one process's draw from the same seed, which rank 0 builds on CPU, then each module is gathered,
    overwritten on rank 0 and re-partitioned (rank 0 holds the whole model once for this). Then the buffers no
    checkpoint holds as one CPU process computes them (``reference_buffers``) and peft's adapter initialisation
    (:func:`draw_partitioned_adapters`).

    Args:
        built: ``(model, weights source)`` of each model built under the plan.
        alone: Runs a build as one plain process, outside ``zero.Init`` (the strategy's HF integration off).
    """
    for hf_model, source in built:
        fill_weights(hf_model, source, hf_model.state_dict(keep_vars=True), Partitions(alone))
        replace_buffers(hf_model, alone(reference_buffers, source))
        draw_partitioned_adapters(hf_model)


class Partitions:
    """ZeRO-3's holdings (``models.holdings``): each rank holds a flat span of every partitioned parameter; buffers
    and parameters ZeRO-3 does not partition are whole on every rank, and a partition swapped to NVMe is written
    whole from rank 0 through a gather (a collective every rank joins).

    Args:
        alone: Runs a build as one plain process, outside ``zero.Init``.
    """

    def __init__(self, alone: Alone) -> None:
        self._alone = alone

    def part(self, tensor: torch.Tensor) -> Part:
        """The span of the flattened parameter this rank's partition holds, else the whole tensor."""
        partition, shape = zero3_partition(tensor), zero3_full_shape(tensor)
        return Span(shape, partition[1]) if partition is not None and shape is not None else Whole()

    def write(self, tensor: torch.Tensor, part: Part, value: Value) -> None:
        """Into the partition, the whole tensor, or (a partition swapped to NVMe) a gather written from rank 0."""
        partition = zero3_partition(tensor)
        if isinstance(part, Span) and partition is not None:
            local, span = partition
            local[: len(span)].copy_(value())
        elif zero3_full_shape(tensor) is None:  # a buffer, or a parameter ZeRO-3 does not partition
            tensor.data.copy_(value())
        else:
            _overwrite_whole(tensor, value)

    def alone(self, build: Callable[[WeightsSource], _T], source: WeightsSource) -> _T:
        """``build(source)`` outside ``zero.Init``: inside, ``from_config`` would build partitioned again (a
        collective, when one rank builds) and initialise through gathers."""
        return self._alone(build, source)

    def distribute(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
    ) -> None:
        """Every module of ``model`` gathered in turn and overwritten from rank 0 (:func:`overwrite_partitioned`)."""
        overwrite_partitioned(model, reference, torch.distributed.get_rank() == 0)


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
    adapters kept ``lora_B != 0`` and a LoRA run did not start from its base model (docs/benchmarks-history.md,
    "ZeRO-3's LoRA initialisation").
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
    torch's ``uniform_`` draws bf16 values differently (a few elements of a kaiming draw come out at -bound instead
    of +bound; docs/benchmarks-history.md, "ZeRO-3's LoRA initialisation")."""
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
    "Partitions",
    "draw_partitioned_adapters",
    "fill_partitions",
    "full_tensor",
    "overwrite_partitioned",
    "replace_buffers",
]
