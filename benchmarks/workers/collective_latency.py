"""Latency of the small blocking collectives a training step may add, on 2 CPU ranks over gloo.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.workers.collective_latency

Each sample starts right after a synchronising all-reduce, so it is the collective's own round trip (not the wait for
a late rank). Lines: Lightning's ``strategy.reduce`` (``barrier()`` then ``all_reduce``, what NonFiniteGuard used to
call), a bare ``all_reduce`` of the guard's flags (what it calls now), and Lightning's per-batch SIGTERM flag
broadcast with its host read. Rank 0 prints the median and 90th percentile in ms, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SAMPLES = 300


def _sigterm_broadcast() -> None:
    flag = torch.tensor([0])
    dist.broadcast(flag, src=0)
    flag.item()


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    flags = torch.zeros(4)
    calls: dict[str, Callable[[], object]] = {
        "barrier + all_reduce (strategy.reduce)": lambda: (dist.barrier(), dist.all_reduce(flags)),
        "all_reduce (NonFiniteGuard now)": lambda: dist.all_reduce(flags),
        "broadcast + .item() (SIGTERM flag)": _sigterm_broadcast,
    }
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(SAMPLES):
        for name, call in calls.items():  # interleaved: load from other jobs hits all lines alike
            dist.all_reduce(torch.zeros(1))
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        for name, values in seconds.items():
            p90 = sorted(values)[int(0.9 * len(values))]
            print(f"{name:40s} median {1000 * statistics.median(values):.3f} ms  p90 {1000 * p90:.3f} ms")
        print("load average (1/5/15 min):", " / ".join(f"{x:.2f}" for x in os.getloadavg()))
    dist.destroy_process_group()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options; --help says what it is
    main()
