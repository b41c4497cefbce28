"""Tensors that are read only when asked for: the currency of the exporter.

A ``LazyTensor`` knows its shape and dtype up front (enough to plan safetensors shards) and materialises itself on
``load()``: from a memory-mapped checkpoint file, from ZeRO-3 partitions on disk, or from a live sharded model, where
``load()`` is a collective (FSDP2's ``DTensor.full_tensor``, ZeRO-3's ``GatheredParameters``) that every rank calls in
the same order. Whoever holds a ``dict[str, LazyTensor]`` can therefore walk a model one tensor at a time and never
hold more than one tensor (plus what it chooses to keep) in memory.

Strategies that shard parameters provide ``full_tensors(model)`` (``protocols.ProvidesFullTensors``); for any other
strategy every rank holds the whole model and ``full_tensors_of`` reads the module's own state dict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gym_lightning.protocols import ProvidesFullTensors


@dataclass(frozen=True)
class LazyTensor:
    """A tensor that is materialised (on the CPU) only when ``load()`` is called.

    Args:
        shape: Its full (unsharded) shape.
        dtype: Its dtype as stored.
        load: Returns the full tensor; may be a collective (then every rank must call it, in the same order).
        load_as: Returns the full tensor cast to a dtype, where that saves a copy (e.g. casting inside a gather
            instead of copying out and then casting); ``None``: ``load()`` then cast.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]
    load_as: Callable[[torch.dtype], torch.Tensor] | None = None

    def load_cast(self, dtype: torch.dtype) -> torch.Tensor:
        """The full tensor as ``dtype`` (a collective where ``load`` is one)."""
        return self.load_as(dtype) if self.load_as is not None else self.load().to(dtype)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Its size in bytes, stored as ``dtype`` (default: its own)."""
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return int(torch.Size(self.shape).numel()) * element


def eager(tensor: torch.Tensor) -> LazyTensor:
    """A ``LazyTensor`` over a tensor that is already whole on this rank (no collective; no copy on the CPU)."""
    return LazyTensor(tuple(tensor.shape), tensor.dtype, lambda: tensor.detach().cpu())


def full_tensors_of(strategy: object, model: nn.Module) -> dict[str, LazyTensor]:
    """``model``'s state dict as lazy full tensors, keyed as ``model.state_dict()``; loads are collectives when the
    strategy shards parameters, so every rank walks the result in the same order."""
    if isinstance(strategy, ProvidesFullTensors):
        return strategy.full_tensors(model)
    return {key: eager(value) for key, value in model.state_dict().items()}


__all__ = ["LazyTensor", "eager", "full_tensors_of"]
