"""Micro-benchmarks of the machine a process runs on, for the planner's step-time model on CPU ranks: matmul FLOP/s,
memory bandwidth and the process group's all-reduce bus bandwidth (pure torch, no Lightning).

A GPU's figures come from the catalog (``assets/hardware.yaml``); a CPU's depend on the host, its cores and what
else runs there, so they are measured: each in a fraction of a second, medians of short repeats. The all-reduce is
timed like nccl-tests' ``all_reduce_perf`` and reported as its bus bandwidth (``algbw x 2(n-1)/n``), the figure the
model reads for NCCL links too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HostFigures:
    """What :func:`measure_host` found on this process.

    Args:
        matmul_flops: FLOP/s of square matmuls of the model's width in its compute dtype, on this process's threads.
        memory_bandwidth: Bytes/s read plus written by an elementwise update of a tensor larger than the caches.
        bus_bandwidth: All-reduce bus bandwidth of the default process group, bytes/s (0 without one or alone).
        latency: Seconds of a small all-reduce (0 without a group).
        gather_bus_bandwidth: All-gather bus bandwidth, bytes/s (0 without a group).
        scatter_bus_bandwidth: Reduce-scatter bus bandwidth, bytes/s (0 without a group).
    """

    matmul_flops: float
    memory_bandwidth: float
    bus_bandwidth: float = 0.0
    latency: float = 0.0
    gather_bus_bandwidth: float = 0.0
    scatter_bus_bandwidth: float = 0.0


def _median_seconds(run: Callable[[], object], repeats: int, budget: float) -> float:
    """Median seconds of ``run`` over ``repeats`` calls after one warm-up, stopping early past ``budget`` seconds."""
    run()
    times: list[float] = []
    started = time.perf_counter()
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
        if time.perf_counter() - started > budget:
            break
    return statistics.median(times)


def matmul_flops(
    width: int,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    budget: float = 0.3,
    rows: int | None = None,
    cols: int | None = None,
) -> float:
    """FLOP/s of a ``rows x width`` by ``width x cols`` matmul (``2 rows width cols`` FLOPs; square by default)."""
    rows, cols = rows or width, cols or width
    a, b = torch.randn(rows, width, dtype=dtype), torch.randn(width, cols, dtype=dtype)
    return 2 * rows * width * cols / _median_seconds(lambda: a @ b, repeats, budget)


def model_matmul_flops(width: int, dtype: torch.dtype = torch.float32, tokens: int = 2048) -> float:
    """FLOP/s of the matmul a decoder layer spends most of its time in: ``tokens x width`` activations by a
    ``width x 3 width`` weight (an MLP projection), with ``tokens`` cut so one call is about 8 GFLOPs (a 4096-wide
    layer would otherwise take seconds on a CPU core). Square matmuls of the width alone misjudge small models by a
    factor of several (docs/benchmarks-history.md, "CPU calibration figures")."""
    cols = 3 * width
    rows = max(256, min(tokens, int(8e9 / (2 * width * cols))))
    return matmul_flops(width, dtype, rows=rows, cols=cols)


def memory_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5, budget: float = 0.3) -> float:
    """Bytes/s of ``x += y`` over fp32 tensors of ``nbytes`` each (two reads and one write per element; 64 MiB each
    is past the last-level cache of the hosts this runs on, 30-60 MiB)."""
    x, y = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    return 3 * nbytes / _median_seconds(lambda: x.add_(y), repeats, budget)


def all_reduce_figures(nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """``(bus bandwidth, latency)`` of the default process group: an all-reduce of ``nbytes`` fp32 (nccl-tests'
    ``busbw = bytes / time x 2(n-1)/n``) and one of 4 bytes; ``(0, 0)`` without a group or alone. Every rank must
    call it (they are collectives); the slowest rank's times are returned to all."""
    figures = collective_figures(nbytes, repeats)
    return figures["all_reduce"], figures["latency"]


def collective_figures(nbytes: int = 32 * 2**20, repeats: int = 5) -> dict[str, float]:
    """Bus bandwidths of the default process group's all-reduce, all-gather and reduce-scatter of ``nbytes`` (the
    full tensor, fp32), bytes/s, and the latency of a 4-byte all-reduce, seconds; zeros without a group or alone.
    A collective, as :func:`all_reduce_figures`. Measured each, because gloo's all-gather and reduce-scatter reach a
    fraction of its all-reduce's bandwidth: one figure for all three made FSDP and ZeRO look faster on CPU ranks than
    they ran (docs/benchmarks-history.md, "CPU calibration figures"); NCCL's are alike (nccl-tests)."""
    names = ("all_reduce", "all_gather", "reduce_scatter", "latency")
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return dict.fromkeys(names, 0.0)
    n = dist.get_world_size()
    full, part, tiny = torch.ones(nbytes // 4 // n * n), torch.ones(nbytes // 4 // n), torch.ones(1)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        "latency": lambda: dist.all_reduce(tiny),
    }
    seconds = {}
    for name, call in calls.items():
        dist.barrier()
        seconds[name] = _median_seconds(call, repeats, budget=5.0)
    slowest = torch.tensor([seconds[name] for name in names], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = dict(zip(names, slowest.tolist(), strict=True))
    size, latency = full.numel() * 4, times["latency"]
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    out = {name: size * factor / max(times[name] - latency, 1e-9) for name, factor in factors.items()}
    return {**out, "latency": latency}


def measure_host(width: int, dtype: torch.dtype = torch.float32) -> HostFigures:
    """The :class:`HostFigures` of this process (collective: call on every rank when a process group exists).

    Args:
        width: The model's hidden size (:func:`model_matmul_flops`).
        dtype: The compute dtype (``torch.bfloat16`` under bf16-mixed autocast).
    """
    comm = collective_figures()
    return HostFigures(
        model_matmul_flops(width, dtype),
        memory_bandwidth(),
        comm["all_reduce"],
        comm["latency"],
        comm["all_gather"],
        comm["reduce_scatter"],
    )
