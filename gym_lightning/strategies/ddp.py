"""Distributed data parallel with gradient compression that works on CPU (gloo) as well as CUDA (nccl)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from gym_lightning._compat import _StrategyRegistry
from gym_lightning.checkpointing.io import PartialFileCheckpointIO
from gym_lightning.precision import ClipsWithAnyOptimizer, fp32_master_weights
from gym_lightning.strategies._common import raise_strategy_problems
from gym_lightning.strategies.base import GymStrategy
from gym_lightning.strategies.comm_hooks import bf16_allreduce_hook
from gym_lightning.strategies.parallel_dims import size_problems
from gym_lightning.vocabulary import register_presets

GradientCompression = Literal["none", "fp16", "bf16", "powersgd"]
GRADIENT_COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")


def comm_hook_for(
    compression: str, powersgd_rank: int, powersgd_start_iter: int
) -> tuple[object | None, Callable[..., torch.futures.Future] | None]:
    """The ``(state, hook)`` pair for ``DistributedDataParallel.register_comm_hook``; ``(None, None)`` for none."""
    if compression == "fp16":
        return None, default_hooks.fp16_compress_hook
    if compression == "bf16":
        return None, bf16_allreduce_hook
    if compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start_iter
        )
        return state, powerSGD_hook.powerSGD_hook
    return None, None


class GymDDPStrategy(ClipsWithAnyOptimizer, GymStrategy, DDPStrategy):
    """Lightning's ``DDPStrategy`` plus gradient compression that also runs on CPU ranks.

    Gradients are not all-reduced on gradient-accumulation micro-batches (Lightning runs them under ``no_sync``);
    they are reduced once, on the micro-batch that ends the accumulation window. Lightning itself only registers
    DDP communication hooks on CUDA and ignores them silently elsewhere; this strategy registers them on any device.
    Under ``bf16-mixed``/``16-mixed`` gradients are clipped with fused optimizers too (``precision.GymMixedPrecision``).

    Args:
        accelerator: As for ``DDPStrategy`` (normally chosen by the Trainer).
        parallel_devices: As for ``DDPStrategy`` (normally chosen by the Trainer).
        cluster_environment: As for ``DDPStrategy`` (torchrun, SLURM, ... detected by the Trainer).
        checkpoint_io: As for ``DDPStrategy``; default ``PartialFileCheckpointIO`` (written in place, no temp dir).
        precision_plugin: As for ``DDPStrategy``.
        gradient_compression: How gradients travel between ranks. ``"none"`` (fp32 all-reduce, exact),
            ``"fp16"`` / ``"bf16"`` (all-reduce in half precision: half the traffic, rounding error in the mean),
            ``"powersgd"`` (low-rank PowerSGD with error feedback: much less traffic, approximate).
        powersgd_rank: Matrix-approximation rank of PowerSGD (1 or more; higher is more exact). Only with
            ``gradient_compression="powersgd"``; defaults to 1.
        powersgd_start_iter: Iterations of plain all-reduce before PowerSGD starts (at least 2, which torch's
            error feedback needs; PowerSGD's authors recommend a longer warm-up). Only with
            ``gradient_compression="powersgd"``; defaults to 10.
        static_graph: Tell DDP that the set of used parameters and the graph do not change between iterations
            (enables more overlap; required by some activation-checkpointing setups).
        find_unused_parameters: Let DDP handle parameters that get no gradient in a step (slower; needed for
            models with conditional branches).
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: nccl on CUDA, gloo on CPU).
        timeout: Timeout of collective operations, as for :class:`~gym_lightning.strategies.base.GymStrategy`.
        start_method: How Lightning starts the other local ranks: ``"popen"`` (default), ``"spawn"``, ``"fork"``,
            ``"forkserver"``.
        sequence_parallel_size: Ranks that share each training sequence, as for
            :class:`~gym_lightning.strategies.base.GymStrategy`. 1: off.
    """

    strategy_name = "gym_ddp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        gradient_compression: GradientCompression = "none",
        powersgd_rank: int | None = None,
        powersgd_start_iter: int | None = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        sequence_parallel_size: int = 1,
    ) -> None:
        problems = _ddp_problems(gradient_compression, powersgd_rank, powersgd_start_iter)
        raise_strategy_problems(type(self).__name__, problems + size_problems(sequence_parallel_size))
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            # Single-file checkpoints are written once, beside their final name (checkpointing/io.py).
            checkpoint_io=checkpoint_io if checkpoint_io is not None else PartialFileCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            sequence_parallel_size=sequence_parallel_size,
            start_method=start_method,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        self.powersgd_rank = powersgd_rank or 1
        self.powersgd_start_iter = powersgd_start_iter or 10
        self.gradient_compression = gradient_compression

    @override
    def setup(self, trainer: Trainer) -> None:
        if self.model is not None:  # fp32 master weights under bf16-mixed, whatever dtype the checkpoint had
            fp32_master_weights(self.model, self.precision_plugin)
        super().setup(trainer)

    @override
    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            return
        state, hook = comm_hook_for(self.gradient_compression, self.powersgd_rank, self.powersgd_start_iter)
        if hook is not None:
            self.model.register_comm_hook(state=state, hook=hook)

    def local_gradients(self, module: torch.nn.Module) -> list[torch.Tensor] | None:
        """This rank's gradients of ``module`` (for ``NonFiniteGuard``): every rank holds them all, as ``.grad``."""
        return [p.grad for p in module.parameters() if p.grad is not None]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry.register, cls, "ddp")  # gym_lightning.vocabulary: gym_ddp


def _ddp_problems(compression: str, powersgd_rank: int | None, powersgd_start_iter: int | None) -> list[str]:
    problems = []
    if compression not in GRADIENT_COMPRESSIONS:
        problems.append(f"gradient_compression={compression!r} is not one of {GRADIENT_COMPRESSIONS}.")
    # PowerSGD's error feedback needs plain all-reduce for at least the first 2 iterations (torch refuses fewer).
    minimum = {"powersgd_rank": 1, "powersgd_start_iter": 2}
    for name, value in {"powersgd_rank": powersgd_rank, "powersgd_start_iter": powersgd_start_iter}.items():
        if value is None:
            continue
        if compression != "powersgd":
            problems.append(f"{name}={value} only applies to PowerSGD; set gradient_compression='powersgd' or drop it.")
        if not isinstance(value, int) or value < minimum[name]:
            problems.append(f"{name} must be an integer >= {minimum[name]}, got {value!r}.")
    return problems
