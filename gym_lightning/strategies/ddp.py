"""Distributed data parallel with gradient compression that works on CPU (gloo) as well as CUDA (nccl).

Two costs of a plain ``DDPStrategy`` are gone (issue 47: on one H200, Qwen3-1.7B shape, fp32 parameters under
bf16 autocast, micro-batch 4x2048, one rank, gym_ddp ran at 0.862 of a plain PyTorch loop and peaked at 71.6 GiB,
6.6 GiB of it DDP's buckets = 1.72B gradients x 4 B):

* one rank without a communication hook trains the LightningModule unwrapped, as Lightning's
  ``SingleDeviceStrategy`` would: there is nothing to reduce, so no reducer, no buckets, no autograd hooks;
* the gradients are DDP's buckets (``gradient_as_bucket_view=True``) and stay them: see
  :func:`zero_gradients_in_place`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from gym_lightning._compat import _StrategyRegistry
from gym_lightning.checkpointing.io import PartialFileCheckpointIO
from gym_lightning.precision import ClipsWithAnyOptimizer, fp32_master_weights
from gym_lightning.strategies._common import raise_strategy_problems
from gym_lightning.strategies.base import GymStrategy
from gym_lightning.strategies.comm_hooks import bf16_allreduce_hook
from gym_lightning.strategies.frozen import Build, hold_whole
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
            (torch's DDP docs: then it supports reentrant backward, activation checkpointing run several times and
            parameters that never get a gradient, and skips the per-step search for unused parameters). ``None``
            (default): on where valid, see :func:`resolve_static_graph`. ``True`` with gradient accumulation is
            refused: torch <= 2.13 asserts in the reducer when a ``no_sync`` backward comes first (torch issue
            143580, fix pytorch#187732 open).
        find_unused_parameters: Let DDP handle parameters that get no gradient in a step (slower; needed for
            models with conditional branches, e.g. MoE experts that a step may not route to). Gradients are then
            set to ``None`` between steps as usual (an unused parameter must keep ``grad=None`` so that the
            optimizer skips it), so under gradient accumulation a second copy of the gradients exists again.
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
        static_graph: bool | None = None,
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
        )
        self.powersgd_rank = powersgd_rank or 1
        self.powersgd_start_iter = powersgd_start_iter or 10
        self.gradient_compression = gradient_compression
        # DistributedDataParallel's arguments live here, not in Lightning's kwargs: static_graph is resolved in
        # configure_ddp, once the Trainer's accumulation is known.
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters

    @override
    def setup(self, trainer: Trainer) -> None:
        if self.model is not None:  # fp32 master weights under bf16-mixed, whatever dtype the checkpoint had
            fp32_master_weights(self.model, self.precision_plugin)
        super().setup(trainer)

    @property
    def needs_reducer(self) -> bool:
        """Whether the model is wrapped in ``DistributedDataParallel``: with more than one rank, or when a
        communication hook was asked for (the hook tests run it on one rank). One rank without a hook has nothing
        to reduce: PyTorch measures DDP on one GPU within a few percent of no wrapper, issue 47 measured 0.862 of a
        plain loop through Lightning; Lightning itself trains one device without DDP."""
        return self.world_size > 1 or self.gradient_compression != "none"

    @override
    def configure_ddp(self) -> None:
        # Lightning's configure_ddp, with this strategy's DDP arguments, and nothing at all where no reducer is
        # needed: the LightningModule then trains unwrapped, as under Lightning's SingleDeviceStrategy.
        # block_backward_sync, pre/post_backward, the forward redirection and teardown all check for the wrapper.
        if not self.needs_reducer:
            return
        accumulation = self.lightning_module.trainer.accumulate_grad_batches
        static_graph = resolve_static_graph(self.static_graph, self.find_unused_parameters, accumulation)
        device_ids = self.determine_ddp_device_ids()
        # As Lightning: DDP's constructor on a side stream (https://pytorch.org/docs/stable/notes/cuda.html#id5).
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with stream:
            self.model = DistributedDataParallel(
                module=self.model,
                device_ids=device_ids,
                find_unused_parameters=self.find_unused_parameters,
                static_graph=static_graph,
                gradient_as_bucket_view=True,  # the buckets are the gradients: one copy, no copy in or out
            )
        self.register_comm_hook()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if isinstance(self.model, DistributedDataParallel) and not self.find_unused_parameters:
            for optimizer in self.optimizers:
                zero_gradients_in_place(optimizer)
            self.optimizers = self.optimizers  # Lightning's wrappers copy the optimizer's attributes: copy again

    @override
    def teardown(self) -> None:
        for optimizer in self.optimizers:  # the optimizers outlive the fit: they zero as torch's own again
            vars(optimizer).pop("zero_grad", None)
        super().teardown()

    def register_comm_hook(self) -> None:
        """Register the hook of ``gradient_compression`` on the wrapped model, on any device (Lightning's
        ``_register_ddp_hooks``, which this replaces with ``configure_ddp``, does it on CUDA only)."""
        if not isinstance(self.model, DistributedDataParallel):
            return
        state, hook = comm_hook_for(self.gradient_compression, self.powersgd_rank, self.powersgd_start_iter)
        if hook is not None:
            self.model.register_comm_hook(state=state, hook=hook)

    def local_gradients(self, module: torch.nn.Module) -> list[torch.Tensor] | None:
        """This rank's gradients of ``module`` (for ``NonFiniteGuard``): every rank holds them all, as ``.grad``."""
        return [p.grad for p in module.parameters() if p.grad is not None]

    def hold_frozen(
        self, build: Build, copy_of: nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> nn.Module:
        """A frozen model (a preference objective's reference, ``protocols.HoldsFrozenModels``) as every rank holds
        the policy: whole, on this rank's device, converted by the precision plugin as the policy was; not wrapped in
        ``DistributedDataParallel``, which would only add buckets for gradients it never has. ``dtype``: its
        parameters' (under ``bf16-mixed`` autocast computes in bf16 whatever they are stored in)."""
        return hold_whole(self, build, copy_of, dtype)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry.register, cls, "ddp")  # gym_lightning.vocabulary: gym_ddp


def resolve_static_graph(static_graph: bool | None, find_unused_parameters: bool, accumulation: int) -> bool:
    """DDP's ``static_graph`` for a run: ``static_graph`` if given, else on where it is valid.

    Valid means: the same parameters get gradients in every step (torch's DDP docs), so not with
    ``find_unused_parameters`` (which says they may not: MoE experts a step does not route to, conditional
    branches), and no ``no_sync`` micro-batches (gradient accumulation), which torch <= 2.13 does not support with a
    static graph (reducer.cpp asserts ``expect_autograd_hooks_`` on the first backward, torch issue 143580; checked
    here on torch 2.13 CPU/gloo). Activation checkpointing (reentrant or not) and LoRA (frozen parameters are not
    DDP's) are supported by a static graph.

    Per step it costs one read per parameter of the reducer's ``local_used_map_`` at the end of backward
    (reducer.cpp ``finalize_bucket_dense``): a host tensor on CUDA too, so no device sync; only a parameter no rank
    used would make the reducer wait for the map's all-reduce. For a graph whose parameters all get gradients it
    saves nothing per step either: its value is that unused parameters and reentrant checkpointing run at all.
    Measured side by side, both settings step at the same speed (docs/benchmarks.md, "Host syncs per quiet step").

    Args:
        static_graph: The strategy's argument; ``None`` resolves to the rule above.
        find_unused_parameters: The strategy's argument.
        accumulation: The Trainer's ``accumulate_grad_batches``.

    Raises:
        GymUserError: ``static_graph=True`` with ``accumulation`` > 1.
    """
    if static_graph is None:
        return not find_unused_parameters and accumulation == 1
    if static_graph and accumulation > 1:
        raise_strategy_problems(
            "GymDDPStrategy",
            [
                f"static_graph=True cannot run with accumulate_grad_batches={accumulation}: torch's reducer fails on "
                "the no_sync backward of an accumulated micro-batch (torch issue 143580). Set static_graph=None "
                "(the default: off under accumulation) or False, or accumulate_grad_batches=1."
            ],
        )
    return static_graph


def zero_gradients_in_place(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.zero_grad()`` zero the gradients in place unless ``set_to_none=True`` is passed explicitly.

    With ``gradient_as_bucket_view=True`` each ``.grad`` is a view into DDP's bucket once a step has synchronised.
    ``zero_grad(set_to_none=True)`` (torch's default, which Lightning's ``LightningModule.optimizer_zero_grad``
    calls) drops those views; the next backward then creates fresh ``.grad`` tensors, and on a ``no_sync``
    micro-batch (gradient accumulation) they are a second copy of the gradients beside the buckets until the
    synchronising micro-batch copies them in. Zeroed in place, the gradients stay the buckets: the strategy owns how
    gradients are stored, so it changes the default of the optimizers it set up, for the fit only (``teardown``
    removes it). An explicit ``set_to_none=True`` (``NonFiniteGuard`` skipping a step) still drops them: DDP makes
    them views again on the next synchronising backward.

    Args:
        optimizer: A torch optimizer of the DDP-wrapped model.
    """
    zero_grad = functools.partial(type(optimizer).zero_grad, optimizer)

    @functools.wraps(type(optimizer).zero_grad)
    def zero_grad_in_place(set_to_none: bool | None = None) -> None:
        zero_grad(set_to_none=bool(set_to_none))

    optimizer.zero_grad = zero_grad_in_place  # type: ignore[method-assign]


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
