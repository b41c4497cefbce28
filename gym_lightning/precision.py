"""The fp32 master-weight rule: under a mixed precision, trainable weights are fp32 whatever the checkpoint holds.

transformers 5 loads a checkpoint in the dtype it was saved in (``dtype="auto"``), so a bf16 folder would train bf16
weights with bf16 AdamW states and lose updates below bf16's resolution (~0.4% of a weight). Mixed precision means
fp32 master weights and optimizer state; ``bf16-true`` remains the explicit choice of bf16 weights. Frozen parameters
(the base model under LoRA) keep their dtype. DeepSpeed's precision plugin is the one exception: its engine casts the
module to 16 bits and keeps fp32 master partitions itself, so an fp32 copy here would only add 4 bytes per parameter
to every rank's load peak (docs/benchmarks-history.md, "The fp32 master copy under DeepSpeed").

This module holds the whole rule; ``CausalLMModule.configure_model`` applies it to the model it builds (under any
strategy), and gym_lightning's DDP and FSDP strategies apply it to any LightningModule in their set-up (before
wrapping or sharding). Applying it twice changes nothing.

It also holds :class:`GymMixedPrecision`, Lightning's autocast plugin with gradient clipping for optimizers that
unscale in their own step (torch's fused AdamW, the module's default): ``bf16-mixed`` with
``gradient_clip_val`` (HF's default ``max_grad_norm=1.0``) failed with Lightning's "does not allow for gradient
clipping because it performs unscaling of gradients internally" on one process, under DDP and under FSDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from typing_extensions import override

from gym_lightning._compat import grad_scaler_found_infs, optimizer_unscales_itself, start_grad_scaler_on

# Precisions whose optimizer updates fp32 master weights and computes in half precision (autocast / FSDP's policy).
MIXED_PRECISIONS: tuple[str, ...] = ("bf16-mixed", "16-mixed")


def keeps_fp32_masters(precision_plugin: Any) -> bool:
    """Whether trainable weights must be fp32 under ``precision_plugin`` (a Lightning ``Precision``, or the
    precision string): mixed precisions, except DeepSpeed's, whose engine keeps its own fp32 masters."""
    if isinstance(precision_plugin, DeepSpeedPrecision):
        return False
    precision = getattr(precision_plugin, "precision", precision_plugin)
    return str(precision) in MIXED_PRECISIONS


def fp32_master_weights(module: torch.nn.Module, precision_plugin: Any) -> None:
    """Make every trainable floating-point parameter of ``module`` fp32 when :func:`keeps_fp32_masters` says so (in
    place, ties kept; free on the meta device)."""
    if not keeps_fp32_masters(precision_plugin):
        return
    for param in module.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


class GymMixedPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` (autocast; a ``GradScaler`` under ``16-mixed``) that clips gradients for every
    optimizer, fused ones included.

    Lightning refuses clipping whenever the optimizer can unscale gradients inside its own step
    (``_step_supports_amp_scaling``: torch's fused Adam/AdamW/SGD), because under ``16-mixed`` it then leaves the
    gradients scaled until the step. That rule is needless under ``bf16-mixed``, which has no scaler: gradients are
    never scaled. Under ``16-mixed`` the scaler's rules are kept and the gradients are unscaled right after the
    closure for every optimizer, as Lightning does for the unfused ones: clipping, ``on_before_optimizer_step`` and
    the step then all see true gradients. torch's ``GradScaler.step`` supports that order for fused optimizers: it
    passes them no ``grad_scale`` once ``unscale_`` ran, and still skips a step whose gradients hold inf/NaN.

    Clipping by norm is torch's ``clip_grad_norm_`` over the optimizer's parameters: under DDP every rank holds the
    whole reduced gradient; under FSDP2 the gradients are ``DTensor`` shards, whose norm torch reduces over the
    mesh, so the clipped gradients equal one process's (tests/strategies/test_clipping.py).

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"``.
        device: The device type of ``torch.autocast`` (``"cuda"``, ``"cpu"``).
        scaler: The ``GradScaler`` of ``16-mixed`` (default: a new one); must be ``None`` under ``bf16-mixed``.
    """

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None or not optimizer_unscales_itself(optimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        scaler = self.scaler

        def closure_then_unscale() -> Any:
            result = closure()
            if result is not None or not model.automatic_optimization:  # None: backward was skipped
                scaler.unscale_(optimizer)
            return result

        return super().optimizer_step(optimizer, model=model, closure=closure_then_unscale, **kwargs)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Gradients are unscaled here whatever the optimizer (see the class docstring): skip MixedPrecision's refusal.
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class GymShardedGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` (the ``16-mixed`` loss scaler for sharded gradients: every rank unscales only
    its shards, so the inf/NaN flags are summed over the ranks and every rank skips the same steps) kept where the
    optimizer steps, and fit for torch's fused optimizers.

    - The scale lives on ``device`` from the start: the host under FSDP ``cpu_offload``. torch's creates it on the
      first loss's device, the GPU, and then hands the host gradients copies of the scale and of its flag made with
      ``non_blocking=True``, which the CPU unscaling kernel reads at once, before the copies have landed. A scale
      on the host is copied to the GPU for ``scale(loss)`` from pageable memory, which CUDA stages before the copy
      call returns, so a later in-place update of the scale cannot race it.
    - The flags summed over the ranks become one 0-dim flag of at most 1 after ``unscale_``, as ``GradScaler``'s
      are: torch's fused Adam/AdamW/SGD skip a step only where ``found_inf == 1`` (and subtract ``found_inf`` from
      their 0-dim step counts), so a sum of 2 (both ranks saw an overflow) made them apply the step, and
      ``ShardedGradScaler``'s ``[1]``-shaped flag made that subtraction fail ("output with shape [] doesn't match
      the broadcast shape [1]", torch 2.11 to 2.13).

    Args:
        device: The device type the optimizer steps on (``"cpu"`` under offload or on CPU ranks, else ``"cuda"``).
        **kwargs: ``ShardedGradScaler``'s (``init_scale``, ``growth_factor``, ``process_group``, ...).
    """

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self.home = torch.device(device)

    @override
    def scale(self, outputs: Any) -> Any:
        if self.is_enabled():
            start_grad_scaler_on(self, self.home)
        return super().scale(outputs)

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        found_infs = grad_scaler_found_infs(self, optimizer)
        for device, found_inf in found_infs.items():
            found_infs[device] = found_inf.clamp(max=1.0).reshape(())  # on its device: no host sync


def shard_aware_scaler(scaler: Any, device: str) -> Any:
    """``scaler`` as a :class:`GymShardedGradScaler` stepping on ``device``, with the same settings, when it is
    torch's plain ``GradScaler`` (what Lightning makes for ``16-mixed``); any other scaler (``None``, a sharded one,
    a user's subclass) as it is. For strategies whose ranks hold different gradients (FSDP's shards): a plain
    scaler lets each rank skip (and back off its scale) alone."""
    if type(scaler) not in (torch.amp.GradScaler, torch.cuda.amp.GradScaler):
        return scaler
    return GymShardedGradScaler(
        device,
        init_scale=scaler.get_scale(),  # its initial scale until it has scaled a loss: no host sync
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )


def clipping_precision(plugin: Precision | None) -> Precision | None:
    """``plugin`` as a :class:`GymMixedPrecision` with the same settings (and scaler) when it is exactly Lightning's
    ``MixedPrecision``; any other plugin (DeepSpeed's, FSDP's, true precisions, a user's subclass) as it is."""
    if type(plugin) is not MixedPrecision:
        return plugin
    return GymMixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]


class ClipsWithAnyOptimizer:
    """Strategy mixin: the precision plugin the Trainer gives the strategy becomes :class:`GymMixedPrecision`
    (``clipping_precision``), so a Lightning project that picks a gym_lightning strategy can clip under
    ``bf16-mixed``/``16-mixed`` with a fused optimizer too. The plugin is only swapped for one of the same settings;
    the strategy reads nothing else of the Trainer's."""

    # Strategy's own property does the storing; only what is stored changes.
    @property
    def precision_plugin(self) -> Precision:
        return Strategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        Strategy.precision_plugin.fset(self, clipping_precision(plugin))  # type: ignore[attr-defined]


__all__ = [
    "MIXED_PRECISIONS",
    "ClipsWithAnyOptimizer",
    "GymMixedPrecision",
    "GymShardedGradScaler",
    "clipping_precision",
    "fp32_master_weights",
    "keeps_fp32_masters",
    "shard_aware_scaler",
]
