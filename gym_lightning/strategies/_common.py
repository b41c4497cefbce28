"""Pieces shared by gym_lightning's strategies: CPU thread budget, config error collection, rank-0 state dicts."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from gym_lightning import errors
from gym_lightning._compat import rank_zero_info

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


# Precisions whose optimizer updates fp32 master weights and computes in half precision (autocast / FSDP's policy).
MIXED_PRECISIONS: tuple[str, ...] = ("bf16-mixed", "16-mixed")


def fp32_trainable_parameters(module: torch.nn.Module, precision: str) -> None:
    """Under a mixed precision, make every trainable floating-point parameter fp32 (in place, ties kept).

    transformers 5 loads a checkpoint in the dtype it was saved in (``dtype="auto"``), so a bf16 folder would train
    bf16 weights with bf16 AdamW states and lose updates below bf16's resolution (~0.4% of a weight). Mixed
    precision means fp32 master weights and optimizer state; ``bf16-true`` remains the explicit choice of bf16
    weights. Frozen parameters (e.g. the base model under LoRA) keep their dtype. Free on the meta device.
    """
    if str(precision) not in MIXED_PRECISIONS:
        return
    for param in module.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def raise_if_problems(strategy_name: str, problems: Iterable[str]) -> None:
    """Raise one ``GymUserError`` listing every configuration problem of a strategy (each with its fix)."""
    errors.raise_if_problems(f"Invalid {strategy_name} configuration", problems)


def cpu_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``module.state_dict()`` (keys exactly as the module reports them)."""
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}
