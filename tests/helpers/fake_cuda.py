"""A CUDA device on a machine without one, with the two CUDA semantics a CPU run of the same code hides.

:class:`FakeCuda` is a ``TorchDispatchMode`` under which tensors created on (or copied to) ``cuda`` are
:class:`OnDevice` tensors: they report ``device("cuda", 0)`` and keep their values on the host. What it keeps of CUDA:

- a copy from the device to the host with ``non_blocking=True`` returns at once and lands later: the host tensor
  holds stale values (zeros, a fresh pinned buffer) until a synchronisation (``.item()``, a blocking copy, a
  ``torch.cuda.Event``'s ``synchronize``, ``torch.cuda.synchronize``); a blocking copy waits and is complete;
- an op that mixes a device tensor with a host tensor of more than one element raises, as CUDA kernels do.

Everything else computes on the host at once: no stream, no overlap; kernel launch order is program order, so a
device op sees every earlier device op's result (stream order), and only the host can read too early.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten


class OnDevice(torch.Tensor):
    """A tensor on the fake ``cuda:0`` whose values (``elem``) live on the host."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device=CUDA, requires_grad=elem.requires_grad
        )
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on a fake CUDA tensor outside FakeCuda")


def _is_device(value: Any) -> bool:
    return isinstance(value, OnDevice)


def _cuda_kwarg(kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cuda"


class FakeEvent:
    """``torch.cuda.Event``: ``synchronize`` lands every copy still in flight; ``query`` says whether one is."""

    def __init__(self, world: FakeCuda, **_: Any) -> None:
        self.world = world

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return not self.world.in_flight

    def synchronize(self) -> None:
        self.world.land()


class FakeCuda(TorchDispatchMode):
    """The fake device (see the module docstring); ``late_copies`` counts the device-to-host copies that were
    made with ``non_blocking=True`` (each one's host tensor stale until the next synchronisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host tensor, the values that will land)
        self.late_copies = 0

    def land(self) -> None:
        """A synchronisation: every device-to-host copy in flight lands."""
        for host, values in self.in_flight:
            host.copy_(values)
        self.in_flight.clear()

    def _late(self, values: torch.Tensor) -> torch.Tensor:
        host = torch.zeros_like(values)  # the pinned buffer before the DMA has written it
        self.in_flight.append((host, values.clone()))
        self.late_copies += 1
        return host

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (aten._to_copy.default, aten.copy_.default):
            return self._copy(func, args, kwargs)
        if func is aten._local_scalar_dense.default and _is_device(args[0]):
            self.land()  # .item() waits for the device
            return args[0].elem.item()
        if func in (aten._pin_memory.default, aten.pin_memory.default):
            return args[0].clone()
        kwargs.pop("pin_memory", None)  # this build cannot pin; the buffer's semantics are FakeCuda's
        on_device = _cuda_kwarg(kwargs) or any(_is_device(a) for a in tree_leaves((args, kwargs)))
        if _cuda_kwarg(kwargs):
            kwargs["device"] = torch.device("cpu")
        self._refuse_mixed(func, args)
        result = func(*tree_map(lambda a: a.elem if _is_device(a) else a, args), **kwargs)
        if not on_device:
            return result
        if func._schema.name.endswith("_") and args and _is_device(args[0]):  # in place: the device tensor itself
            return args[0]
        return tree_map(lambda r: OnDevice(r) if isinstance(r, torch.Tensor) and not _is_device(r) else r, result)

    def _copy(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        non_blocking = bool(kwargs.pop("non_blocking", False) or (len(args) > 2 and args[2]))
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if _is_device(dst):
                dst.elem.copy_(src.elem if _is_device(src) else src)
            elif _is_device(src) and non_blocking:
                self.in_flight.append((dst, src.elem.to(dst.dtype).clone()))
                self.late_copies += 1
            else:
                if _is_device(src):
                    self.land()
                dst.copy_(src.elem if _is_device(src) else src)
            return dst
        src, target = args[0], kwargs.pop("device", None)
        kwargs.pop("pin_memory", None)
        values = aten._to_copy.default(src.elem if _is_device(src) else src, **kwargs)
        to_device = target is not None and torch.device(target).type == "cuda"
        if to_device or (target is None and _is_device(src)):
            return OnDevice(values)
        if _is_device(src):
            if non_blocking:
                return self._late(values)
            self.land()  # a blocking copy waits for the device
        return values

    @staticmethod
    def _refuse_mixed(func: Any, args: Any) -> None:
        tensors = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
        host = [t for t in tensors if not _is_device(t) and t.dim() > 0 and t.device.type == "cpu"]
        if host and any(_is_device(t) for t in tensors):
            raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found cuda:0 and cpu")


@contextlib.contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """Run the block with :class:`FakeCuda` active and ``torch.cuda``'s host-side calls answered by it."""
    world = FakeCuda()
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(world, **kw))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: world.land())
    # The optimizers ask whether a CUDA graph is being captured once CUDA "is available"; a CUDA build of torch
    # without a GPU (the CI's floor environment) would ask the driver.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with world:
        yield world
