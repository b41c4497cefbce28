"""Count, on a CPU run, the operations that stop the host on a GPU: a census of one piece of code, by kind and op.

A TorchDispatchMode alone, run on CPU tensors, misses half of them: ``tensor.tolist()`` and ``.numpy()`` read the
values through the CPU storage with no aten op at all (on CUDA: a device-to-host copy and a wait), and a CPU tensor
moved ``.to(device)`` is no copy when the device is the CPU. So the census is two modes:

- a TorchFunctionMode at the Python API: ``Tensor.tolist`` / ``numpy`` (a read of device data, kind ``read``) and
  every ``to`` / ``cuda`` / ``cpu`` / ``copy_`` naming another device or tensor (kind ``move``: a copy between host
  and device unless the tensor is already there; a CPU run cannot tell, so each is counted);
- a TorchDispatchMode at aten level, by ``host_syncs.aten_sync_kind``'s table (one for both censuses):
  ``_local_scalar_dense`` (``item``, ``bool``, ``int``, ``float``) and ``equal`` (kind ``read``);
  ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``bincount`` (its CUDA kernel reads the max
  index) and ``repeat_interleave`` without ``output_size`` (kind ``shape``: an output sized by the data, a read on
  CUDA); ``lift_fresh`` (``torch.tensor``, ``as_tensor``, ``new_tensor`` of Python data: host data becoming a
  tensor, which on a GPU is a blocking host-to-device copy, kind ``host data``); and ``_to_copy`` / ``copy_``
  between two devices (seen only where there are two).

What it cannot show: a sync inside a CUDA kernel it does not list, the caching allocator's (a ``cudaFree`` on a
retry), stream ordering and ``non_blocking`` copies of pageable memory, and anything run outside the modes (other
threads than the caller's and autograd's). It counts what it sees on every device, the CPU included: count the
code under test, not its set-up.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common.host_syncs import DATA_DEPENDENT, HOST_TO_DEVICE, READ, aten_sync_kind

aten = torch.ops.aten
# host_syncs' kinds (its table of the aten ops that stop the host) under this census's labels.
LABELS = {READ: "read", DATA_DEPENDENT: "shape", HOST_TO_DEVICE: "host data"}
COPIES = {aten._to_copy.default, aten.copy_.default}
FUNCTION_READS = {"tolist", "numpy"}
MOVES = {"to", "cuda", "cpu"}


class SyncCensus:
    """``with SyncCensus() as census: ...`` then ``census.counts``: ``{(kind, op name): count}``; ``census.total``
    all of them, ``census.of(kind)`` one kind's."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._function = _FunctionCensus(self.counts)
        self._dispatch = _DispatchCensus(self.counts)

    def __enter__(self) -> SyncCensus:
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def of(self, kind: str) -> int:
        return sum(n for (k, _), n in self.counts.items() if k == kind)

    def __repr__(self) -> str:
        return f"SyncCensus({dict(sorted(self.counts.items()))})"


class _FunctionCensus(TorchFunctionMode):
    def __init__(self, counts: Counter[tuple[str, str]]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FUNCTION_READS:
            self.counts["read", name] += 1
        elif _moves(name, args, kwargs):
            self.counts["move", name] += 1
        return func(*args, **kwargs)


def _moves(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call copies between devices, or would on a GPU: ``to`` / ``cuda`` / ``cpu`` naming a device,
    ``copy_`` between tensors on two devices."""
    if name in MOVES and args and isinstance(args[0], torch.Tensor):
        return _names_a_device(name, args, kwargs)
    if name == "copy_" and len(args) > 1 and all(isinstance(a, torch.Tensor) for a in args[:2]):
        return args[0].device != args[1].device
    return False


def _names_a_device(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(...)`` (``cuda``, ``cpu``) asks for a device: ``cuda`` / ``cpu`` always; ``to`` when it
    is given a device, a device string or a tensor (whose device it takes), not a dtype alone."""
    if name != "to":
        return True
    given = [*args[1:], kwargs.get("device"), kwargs.get("other")]
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in given)


class _DispatchCensus(TorchDispatchMode):
    def __init__(self, counts: Counter[tuple[str, str]]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            self.counts[kind, str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def _kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    kind = aten_sync_kind(func.overloadpacket, args, kwargs)
    if kind is not None:
        return LABELS[kind]
    if func in COPIES:
        source = args[1] if func is aten.copy_.default else args[0]
        target = args[0].device if func is aten.copy_.default else kwargs.get("device", source.device)
        if isinstance(source, torch.Tensor) and target is not None and torch.device(target) != source.device:
            return "move"
    return None


__all__ = ["SyncCensus"]
