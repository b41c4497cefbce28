"""What one rank holds of each model tensor, asked of an adapter: the one question in which strategies differ when
weights are loaded (``models.fill``).

A strategy that shards or partitions a model hands the loader an adapter that answers, per target tensor, which part
of the full tensor this rank holds (:class:`Whole`, a dim-0 row range :class:`Rows`, a flat element span
:class:`Span`) and writes that part; the loader computes each part from the checkpoint (or a random draw) alone.
Where nothing of a tensor is held locally but the rank must still join the collective that writes it (a ZeRO-3
partition swapped to NVMe), the adapter asks for the :class:`Whole` tensor and calls the value on the rank that
writes only. Adapters live beside their engines: :class:`WholeTensors` here (every tensor whole: one process, or
tensors replicated on every rank), the DTensor row ranges of gym_fsdp in ``strategies.materialize``, ZeRO-3's flat
partitions in ``strategies.zero.stage3``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from gym_lightning.lora import checkpoint_key
from gym_lightning.models.conversion import tied_groups
from gym_lightning.models.plan import WeightsSource

_T = TypeVar("_T")
Value = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Whole:
    """The whole tensor (or, for an adapter that slices or gathers it itself, the whole tensor it starts from)."""

    @property
    def empty(self) -> bool:
        """Whether the part holds no element (never: a whole tensor is read even when it has none)."""
        return False


@dataclass(frozen=True)
class Rows:
    """Rows ``first:last`` (dim 0) of the full tensor.

    Args:
        first: The first row held.
        last: One past the last row held.
    """

    first: int
    last: int

    @property
    def empty(self) -> bool:
        """Whether the range holds no row (a rank whose shard of an uneven split is empty)."""
        return self.last <= self.first


@dataclass(frozen=True)
class Span:
    """Elements ``elements`` of the flattened full tensor, of shape ``shape``.

    Args:
        shape: The full tensor's shape.
        elements: Indices into its flattening.
    """

    shape: tuple[int, ...]
    elements: range

    @property
    def empty(self) -> bool:
        """Whether the span holds no element (a partition past the end of a small tensor)."""
        return not self.elements


Part = Whole | Rows | Span


@runtime_checkable
class Holdings(Protocol):
    """What this rank holds of each model tensor and how it is written: all a loader asks of a strategy."""

    def part(self, tensor: torch.Tensor) -> Part:
        """Which part of the full tensor ``tensor`` stands for this rank holds (or starts from)."""
        ...

    def write(self, tensor: torch.Tensor, part: Part, value: Value) -> None:
        """Write ``value()`` (the values of ``part``) into what this rank holds of ``tensor``; an adapter that writes
        through a collective calls ``value`` on the writing rank only."""
        ...

    def alone(self, build: Callable[[WeightsSource], _T], source: WeightsSource) -> _T:
        """``build(source)`` as one plain process runs it (called on rank 0 for the random draw)."""
        ...

    def distribute(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
    ) -> None:
        """Copy one process's random draw ``reference`` (held on rank 0 only, empty elsewhere) into ``targets`` of
        ``model``: a collective wherever ranks hold parts of a tensor."""
        ...


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class WholeTensors:
    """Every tensor held whole: one process, or a tensor every rank holds entirely (a random draw is broadcast from
    rank 0)."""

    def part(self, tensor: torch.Tensor) -> Part:
        """The whole tensor."""
        return Whole()

    def write(self, tensor: torch.Tensor, part: Part, value: Value) -> None:
        """``value()`` copied into ``tensor`` (cast to its dtype, on its device)."""
        tensor.copy_(value())

    def alone(self, build: Callable[[WeightsSource], _T], source: WeightsSource) -> _T:
        """``build(source)``: nothing to switch off."""
        return build(source)

    def distribute(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
    ) -> None:
        """``reference``'s tensors sent one at a time from rank 0 (:meth:`send`), tied names once, in ``targets``'
        order: every rank calls the same collectives in the same order."""
        is_source = rank() == 0
        for group in tied_groups(targets):
            target = targets[group[0]]
            full = reference.pop(checkpoint_key(group[0])) if is_source else torch.empty(target.shape)
            self.send(full.to(device=target.device, dtype=target.dtype), target)
            for key in group[1:]:
                reference.pop(checkpoint_key(key), None)

    def send(self, full: torch.Tensor, target: torch.Tensor) -> None:
        """Rank 0's ``full`` (a stand-in of its shape elsewhere) into ``target`` on every rank (a broadcast)."""
        if torch.distributed.is_initialized():
            torch.distributed.broadcast(full, src=0)
        target.copy_(full)


__all__ = ["Holdings", "Part", "Rows", "Span", "Value", "Whole", "WholeTensors", "rank"]
