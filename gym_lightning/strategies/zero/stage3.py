"""ZeRO-3's partitioned parameters, one module or one tensor at a time: overwriting a partitioned model with one
process's values, and gathering a full tensor for the exporter (collectives: every rank calls them in the same
order)."""

from __future__ import annotations

import torch
from torch import nn

from gym_lightning._compat import zero3_full_shape
from gym_lightning.lazy import LazyTensor, eager
from gym_lightning.lora import checkpoint_key


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


__all__ = ["full_tensor", "overwrite_partitioned"]
