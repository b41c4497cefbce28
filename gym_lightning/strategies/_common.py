"""Pieces shared by gym_lightning's strategies: CPU thread budget, host allocator, process-group lifetime and
timeouts, config error collection."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterable
from datetime import timedelta

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from gym_lightning._compat import rank_zero_info
from gym_lightning.errors import raise_if_problems

# The standard OpenMP variable: a user who sets it chose the per-rank thread count, so torch's setting is left alone.
THREADS_ENV_VAR = "OMP_NUM_THREADS"


def available_cpus() -> int:
    """CPUs this process may run on (respects taskset/cgroup affinity, unlike ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS/Windows have no affinity API
        return os.cpu_count() or 1


def threads_per_rank(local_processes: int, cpus: int) -> int:
    """Intra-op threads for each of ``local_processes`` ranks sharing ``cpus`` cores (at least 1).

    Oversubscribing cores makes every collective wait for the slowest, descheduled rank: with 2 ranks x 2 threads
    on 2 cores, DDP ran ~7x slower than with 1 thread each.
    """
    return max(1, cpus // max(1, local_processes))


def configure_cpu_threads(device: torch.device, local_processes: int) -> None:
    """Give each CPU rank its share of the cores, unless the user chose a thread count through the environment."""
    if device.type != "cpu" or THREADS_ENV_VAR in os.environ:
        return
    threads = threads_per_rank(local_processes, available_cpus())
    if torch.get_num_threads() != threads:
        rank_zero_info(f"gym_lightning: {local_processes} CPU rank(s) per node, using {threads} thread(s) per rank.")
        torch.set_num_threads(threads)


# glibc's mallopt parameter and environment variable for the size from which allocations are memory-mapped.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_ENV_VAR = "MALLOC_MMAP_THRESHOLD_"
# Host allocations of this size and larger go straight to mmap, so freeing them returns the memory to the system.
HEAP_MMAP_THRESHOLD = 1 << 20


def return_freed_host_memory(device: torch.device) -> None:
    """On CPU ranks, make freed tensors of 1 MiB and more go back to the system instead of staying in glibc's heap.

    glibc serves allocations below its mmap threshold from the heap and raises that threshold (up to 32 MiB) each time a
    mapped block is freed, so after the first steps most per-tensor transients (gathered FSDP units, 16-bit gradients,
    autocast copies: 6-23 MiB each for 250M-1B Llama layers) come from the heap, and freeing them leaves holes the heap
    cannot trim: resident memory that every later phase (save, export) starts from (benchmarks/scale.py,
    ``GYM_SCALE_TRIM=1``; docs/benchmarks-history.md, "glibc's heap on CPU ranks"). Fixing the threshold (which also
    stops glibc from raising it) maps every tensor of 1 MiB and more on its own. The cost is a page fault per new page
    of such tensors. Nothing happens off glibc, on accelerators, or when the user set ``MALLOC_MMAP_THRESHOLD_`` (glibc
    read it at start-up).
    """
    if device.type != "cpu" or MMAP_THRESHOLD_ENV_VAR in os.environ:
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
        libc.malloc_trim(0)  # what loading already freed
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group (and every subgroup) when the program ends cleanly, while Python still runs.

    Lightning leaves the process group up after ``fit`` (a ``test`` may follow), so it used to die in the
    interpreter's finalisation. There, gloo's worker threads can still hold finished work that refers to tensors;
    releasing them needs an interpreter that is going away, and the process aborts ("terminate called without an
    active exception", exit code -6 / 134) after a run that succeeded. Seen once in CI at the end of the 2-rank
    gym_fsdp memory test (tests/callbacks/test_memory_monitor.py); PyTorch's own atexit fix was proposed and dropped
    (pytorch/pytorch#179291; #190489 reports the abort). Lightning registers the same cleanup for NCCL only
    (``_init_dist_connection``, Lightning #19931). Registering twice keeps one handler. atexit runs handlers
    last-in first-out, so this one, registered when the strategy sets up, runs after handlers added later.
    """
    atexit.unregister(_destroy_process_group)
    atexit.register(_destroy_process_group)


_LEAVE_AT_EXIT = False


def leave_process_group_at_exit() -> None:
    """Do not destroy the process group at exit: a collective on it failed because a peer stopped or died
    (``strategies.rank_failure``), and destroying it would wait for that peer."""
    global _LEAVE_AT_EXIT
    _LEAVE_AT_EXIT = True


def _destroy_process_group() -> None:
    # A program ended by an unhandled exception keeps the old behaviour: a rank that failed between launching an
    # async collective and waiting for it would wait in the destructor for its peers until the collective timeout.
    if getattr(sys, "last_value", None) is not None or _LEAVE_AT_EXIT:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rendezvous_timeout(collective: timedelta | None) -> timedelta:
    """The timeout a strategy starts its process group with: at least torch's default (30 minutes).

    torch uses the one ``timeout`` of ``init_process_group`` for the rendezvous too: rank 0 waits that long for the
    others to connect. A collective timeout short enough to catch a hung rank quickly (30 s) failed the start of a
    2-rank CPU run whose second rank took longer than that to import (Lightning starts it after rank 0 has imported):
    starting takes as long as it takes, and the strategy's ``timeout`` applies to collectives once every rank has
    arrived (``watch_collectives``)."""
    return max(collective, default_pg_timeout) if collective is not None else default_pg_timeout


def raise_strategy_problems(strategy_name: str, problems: Iterable[str]) -> None:
    """Raise one ``GymUserError`` listing every configuration problem of a strategy (each with its fix):
    ``errors.raise_if_problems`` about "Invalid <strategy_name> configuration"."""
    raise_if_problems(f"Invalid {strategy_name} configuration", problems)
