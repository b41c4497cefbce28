"""Bytes of parameters, gradients and optimizer state that THIS rank holds (pure accounting, no Lightning).

DeepSpeed's attributes (:func:`held_bytes` names them) are read through ``gym_lightning._compat.deepspeed_attribute``,
which accepts only those declared in ``_compat.DEEPSPEED_MEMORY_ATTRIBUTES`` (checked against the installed DeepSpeed by
tests).

Counting ``numel()`` of parameters would report the full model on every rank under FSDP and ZeRO-3 and miss the fp32
master copies DeepSpeed keeps, so we follow tensors to their storages instead and count each storage once
(:func:`held_bytes` lists where they are for each strategy).

A storage on the training device counts as ``on_device``; anywhere else (CPU RAM under DeepSpeed offload while
training on CUDA) as ``offloaded``. When several categories reach the same storage, the first in
:data:`CATEGORIES` order keeps it, so nothing is counted twice.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gym_lightning._compat import DTensor, ddp_bucket_sizes, deepspeed_attribute, wrapped_optimizer

CATEGORIES: tuple[str, ...] = ("params", "master_params", "optimizer_state", "comm_buffers", "grads")


@dataclass
class HeldBytes:
    """Bytes per category held by one rank, on the training device and offloaded elsewhere."""

    on_device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    offloaded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def total(self, category: str) -> int:
        return self.on_device[category] + self.offloaded[category]

    def maximum(self, other: HeldBytes) -> HeldBytes:
        """Per-category maximum: what is held across two moments (before and after an optimizer step)."""
        return HeldBytes(
            {c: max(self.on_device[c], other.on_device[c]) for c in CATEGORIES},
            {c: max(self.offloaded[c], other.offloaded[c]) for c in CATEGORIES},
        )


class StorageLedger:
    """Adds tensors to categories, counting every underlying storage once (first category wins)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.held = HeldBytes()
        self._seen: set[tuple[str, int | None, int]] = set()

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if not isinstance(local, torch.Tensor) or local.device.type == "meta":
                continue
            storage = local.untyped_storage()
            nbytes = storage.nbytes()
            key = (local.device.type, local.device.index, storage.data_ptr())
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            bucket = self.held.on_device if _same_device(local.device, self.device) else self.held.offloaded
            bucket[category] += nbytes


def held_bytes(module: nn.Module, optimizers: Iterable[Any], device: torch.device) -> HeldBytes:
    """What this rank holds now for ``module`` (the strategy's wrapped model) and its ``optimizers``.

    * plain torch (single device, DDP): module parameters, their ``.grad`` and the tensors in ``optimizer.state``; DDP's
      gradient buckets that are not the gradients' storage (all of them with ``gradient_as_bucket_view=False``, and with
      it while ``.grad`` is ``None`` or a fresh tensor, e.g. a ``no_sync`` backward after
      ``zero_grad(set_to_none=True)``): then they are held beside, or as a second copy of, the gradients;
    * FSDP2 (``fully_shard``): parameters, gradients and optimizer states are DTensors; we count the LOCAL shard
      (``to_local()``'s storage, padding included), not the global size;
    * DeepSpeed ZeRO-1/2 (``runtime/zero/stage_1_and_2.py``): module parameters are views into ``bit16_groups_flat``;
      the fp32 master partition is ``single_partition_of_fp32_groups`` (its ``.grad`` is the fp32 gradient partition),
      the reduced gradients are ``all_grad_tensors`` (between backward and step when the caller owns accumulation),
      ``averaged_gradients``/``grads_in_partition`` and per-parameter ``grad_accum`` (``accumulated_grads_in_cpu`` when
      offloaded), the optimizer state lives in the wrapped ``optimizer.optimizer.state``; ``ipg_buckets`` are the
      communication buckets;
    * DeepSpeed ZeRO-3 (``runtime/zero/stage3.py``): each parameter's partition is ``param.ds_tensor`` (``param.data``
      is empty unless gathered or persistent), masters are ``fp32_partitioned_groups_flat`` (the SAME storage as the
      parameters when the model already trains in fp32 on that device — counted once, as parameters), gradient
      partitions ``grad_partitions_flat_buffer``, host copies for parameter offload
      ``param_groups_fp16_flat_cpu_memory``.
    """
    optimizers = list(optimizers)
    ledger = StorageLedger(device)
    ledger.add("params", _param_tensors(module, optimizers))
    for opt in optimizers:
        ledger.add("master_params", _tensors(deepspeed_attribute(opt, "single_partition_of_fp32_groups")))
        ledger.add("master_params", _tensors(deepspeed_attribute(opt, "fp32_partitioned_groups_flat")))
    ledger.add("optimizer_state", (t for opt in optimizers for t in _optimizer_state(opt)))
    ledger.add("comm_buffers", (t for opt in optimizers for t in _zero_buckets(opt)))
    ledger.add("grads", _grad_tensors(module, optimizers))
    ledger.held.on_device["comm_buffers"] += _ddp_bucket_bytes(module)
    return ledger.held


def _param_tensors(module: nn.Module, optimizers: list[Any]) -> Iterator[torch.Tensor]:
    for param in module.parameters():
        yield param
        ds_tensor = deepspeed_attribute(param, "ds_tensor")  # ZeRO-3 partition
        if ds_tensor is not None:
            yield ds_tensor
    for opt in optimizers:  # ZeRO-3 host copies when parameters are offloaded
        yield from _tensors(deepspeed_attribute(opt, "param_groups_fp16_flat_cpu_memory"))


def _grad_tensors(module: nn.Module, optimizers: list[Any]) -> Iterator[torch.Tensor]:
    for param in module.parameters():
        yield from _tensors(param.grad)
        yield from _tensors(deepspeed_attribute(param, "grad_accum"))  # ZeRO-1/2 separate accumulation buffer
    for opt in optimizers:
        for master in _tensors(deepspeed_attribute(opt, "single_partition_of_fp32_groups")):
            if master.grad is not None:
                yield master.grad
        for name in ("all_grad_tensors", "averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
            yield from _tensors(deepspeed_attribute(opt, name))
        yield from _tensors(deepspeed_attribute(opt, "accumulated_grads_in_cpu"))


def _optimizer_state(opt: Any) -> Iterator[torch.Tensor]:
    """Tensors in ``opt.state`` and in the states of the optimizers it wraps (DeepSpeed keeps a torch one inside)."""
    seen: set[int] = set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            for per_param in state.values():
                yield from _tensors(per_param)
        opt = wrapped_optimizer(opt)


def _zero_buckets(opt: Any) -> Iterator[torch.Tensor]:
    buckets = deepspeed_attribute(opt, "ipg_buckets")
    if isinstance(buckets, dict):
        for bucket in buckets.values():
            yield from _tensors(deepspeed_attribute(bucket, "buffer"))


def _ddp_bucket_bytes(module: nn.Module) -> int:
    """Bytes of DDP's reducer buckets that the gradients (already counted) do not live in.

    With ``gradient_as_bucket_view=True`` the gradients of a bucket are views of one storage, which several
    parameters share; the bytes of such shared storages are bucket bytes already counted as gradients. The
    reducer's buckets are private: their total comes from its logging data (``_compat.ddp_bucket_sizes``), which
    lags a rebuild by one iteration (a static graph rebuilds after its first: 1 bucket logged, 2 real) but
    keeps the total, so totals are compared, not bucket by bucket. A storage of one parameter is a fresh gradient
    (beside the buckets) unless a bucket of exactly that size holds one parameter only.
    """
    if not isinstance(module, DistributedDataParallel):
        return 0
    sizes = ddp_bucket_sizes(module)
    if not module.gradient_as_bucket_view:
        return sum(sizes)
    users: dict[int, list[int]] = {}  # data_ptr -> [nbytes, parameters whose .grad lives there]
    for param in module.parameters():
        if param.grad is not None:
            storage = param.grad.untyped_storage()
            users.setdefault(storage.data_ptr(), [storage.nbytes(), 0])[1] += 1
    shared = sum(nbytes for nbytes, count in users.values() if count > 1)
    singles = Counter(nbytes for nbytes, count in users.values() if count == 1)
    one_parameter_buckets = Counter(sizes)
    in_buckets = shared + sum(size * min(n, one_parameter_buckets[size]) for size, n in singles.items())
    return max(0, sum(sizes) - in_buckets)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in ``obj``: a tensor, or (nested) lists, tuples and dict values of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def peak_host_rss_bytes() -> int | None:
    """Peak resident set size of this process (``getrusage`` reports KiB on Linux, bytes on macOS); ``None`` where
    ``resource`` does not exist (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def host_rss_bytes() -> int:
    """Current resident set size of this process."""
    return psutil.Process().memory_info().rss


def cuda_peak_bytes(device: torch.device) -> tuple[int | None, int | None]:
    """``(max allocated, max reserved)`` by PyTorch's caching allocator on ``device``; ``None`` off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def take_cuda_peak(device: torch.device) -> tuple[int | None, int | None]:
    """``cuda_peak_bytes`` since the previous call (or the process start), then the counters start a new phase.

    The allocator keeps one peak per process: without the reset, every phase after the largest (the load, say)
    would report that phase's peak again.
    """
    peak = cuda_peak_bytes(device)
    if peak[0] is not None:
        torch.cuda.reset_peak_memory_stats(device)
    return peak
