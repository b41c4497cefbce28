"""Frozen models held beside the policy (``protocols.HoldsFrozenModels``: a preference objective's reference), the
parts every strategy shares: the build under the strategy's construction context, the policy's initial values
copied in (``copy_of``) through whatever holds each tensor, and the frozen state (no gradients, eval mode).

Each strategy holds the frozen model as it holds the policy: gym_ddp, ZeRO-1 and ZeRO-2 whole on every rank
(:func:`hold_whole`), gym_fsdp in FSDP2 shards (``GymFSDPStrategy.hold_frozen``), ZeRO-3 in partitions with an
inference engine's hooks (``strategies.zero.frozen``). The frozen model is never registered in the LightningModule,
so it is in no checkpoint and no optimizer: a resume builds it again from its source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gym_lightning.lora import checkpoint_key, is_adapter_key
from gym_lightning.models.plan import BuildPlan

Build = Callable[[BuildPlan], nn.Module]
# Writes the source tensor's values into what this rank holds of the target tensor (a whole tensor, a DTensor's
# shard, a ZeRO-3 partition).
Write = Callable[[torch.Tensor, torch.Tensor], None]


def build_frozen(strategy: Any, build: Build, plan: BuildPlan) -> nn.Module:
    """``build(plan)`` inside the contexts Lightning opens around ``configure_model`` (``trainer.call.
    _call_configure_model``: the strategy's tensor-initialisation and sharded-model contexts, the precision's
    module-initialisation context), so that the frozen model is created where and as the policy was (the root device,
    ZeRO-3's ``zero.Init``, a ``-true`` precision's default dtype)."""
    with (
        strategy.tensor_init_context(),
        strategy.model_sharded_context(),
        strategy.precision_plugin.module_init_context(),
    ):
        return build(plan)


def freeze(model: nn.Module) -> nn.Module:
    """``model`` without gradients, in eval mode (the frozen state every holder returns)."""
    model.requires_grad_(False)
    return model.eval()


def cast_parameters(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Every floating-point parameter of ``model`` in ``dtype`` (in place, ties kept; free on the meta device);
    buffers keep theirs (the rotary ``inv_freq`` stays fp32, as DeepSpeed's engine keeps it). ``None``: unchanged."""
    if dtype is None:
        return
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def copy_values(model: nn.Module, copy_of: nn.Module, write: Write) -> None:
    """The values of ``copy_of`` (the policy; peft's wrapper names and LoRA adapters left out) written into
    ``model``'s state, tensor by tensor, by ``write`` (a collective where the holding needs one: every rank calls this
    in the same order)."""
    source = {
        checkpoint_key(key): value
        for key, value in copy_of.state_dict(keep_vars=True).items()
        if not is_adapter_key(key)
    }
    targets = model.state_dict(keep_vars=True)
    if missing := sorted(set(targets) - set(source)):
        raise RuntimeError(
            f"The frozen model's tensors {missing[:4]} ({len(missing)} in all) are not in the policy whose initial "
            "values it takes: the two are not the same model."
        )
    with torch.no_grad():
        for key, target in targets.items():
            write(target, source[key])


def write_whole(target: torch.Tensor, source: torch.Tensor) -> None:
    """A whole tensor's values (any device or dtype) into a whole tensor."""
    target.data.copy_(source.detach())


def hold_whole(strategy: Any, build: Build, copy_of: nn.Module | None, dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen model whole on this rank's device, as a strategy that replicates the policy holds it (gym_ddp,
    ZeRO-1, ZeRO-2): built under the default plan, the policy's initial values copied in (``copy_of``), converted by
    the precision plugin as the policy was, its parameters in ``dtype`` (the engine's compute dtype, where it keeps
    the policy's weights in one) and moved to the root device. Not wrapped: it has no gradient to reduce."""
    model = build_frozen(strategy, build, BuildPlan())
    if copy_of is not None:
        copy_values(model, copy_of, write_whole)
    model = strategy.precision_plugin.convert_module(model)
    cast_parameters(model, dtype)
    return freeze(model.to(strategy.root_device))


__all__ = [
    "Build",
    "Write",
    "build_frozen",
    "cast_parameters",
    "copy_values",
    "freeze",
    "hold_whole",
    "write_whole",
]
