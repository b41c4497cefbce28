"""Frozen models under ZeRO (``protocols.HoldsFrozenModels``: a preference objective's reference), held as the policy.

Stages 0-2 keep the whole policy on every rank, in the engine's compute dtype: the frozen model is whole there too
(``strategies.frozen.hold_whole``, parameters in :func:`engine_dtype`). Stage 3 partitions it as the policy: built
under ``zero.Init`` and filled partition by partition (``ZeROStrategy.hold_frozen``), then handed to an inference
engine (:func:`with_inference_hooks`), as accelerate and TRL prepare a ZeRO-3 reference (``deepspeed.initialize``
without an optimizer: ``DeepSpeedZeRoOffload``'s hooks gather each module's partitions for its forward and release
them after; under ``offload_param`` the partitions stay on the host between uses).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from gym_lightning._compat import zero3_full_shape, zero3_partition
from gym_lightning.errors import GymUserError

# Where a frozen ZeRO-3 model keeps its inference engine: DeepSpeed's engine removes the model's hooks when it is
# collected (``DeepSpeedEngine.__del__`` -> ``destroy``), so it must live as long as the model. Set in the model's
# ``__dict__``: as an attribute an ``nn.Module`` value would become a registered submodule (the engine holds the
# model, so a cycle of modules).
INFERENCE_ENGINE = "_gym_inference_engine"


def engine_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed's engine keeps a module's parameters in under ``config`` (``bf16``/``fp16`` enabled), or
    ``None`` where it keeps them as they are (fp32)."""
    if (config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return None


def check_zero3_dtype(config: dict[str, Any], dtype: torch.dtype | None) -> None:
    """Refuse a frozen model's ``dtype`` other than the one ZeRO-3 partitions it in: ``zero.Init`` creates every
    partition in the engine's dtype (:func:`engine_dtype`, fp32 without ``bf16``/``fp16``), the policy's too."""
    held = engine_dtype(config) or torch.float32
    if dtype is not None and dtype != held:
        name = str(held).removeprefix("torch.")
        raise GymUserError(
            f"ZeRO-3 partitions the reference in the engine's dtype ({name}), not reference_dtype "
            f"{str(dtype).removeprefix('torch.')}: set reference_dtype to {name} or null, or change the precision "
            "(bf16-mixed holds a bf16 reference)."
        )


def with_inference_hooks(model: nn.Module, args: argparse.Namespace, config: dict[str, Any]) -> nn.Module:
    """``model`` (partitioned by ``zero.Init``, frozen) with the hooks of a ZeRO-3 inference engine built on it
    (``config``: ``resolve.inference_config``), which ``model`` keeps alive. The model itself is returned, not the
    engine: the objectives call its submodules (the LM head, in chunks) as they call the policy's, and each
    submodule's own hooks gather it. Collective."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(args=args, config=config, model=model, dist_init_required=False)
    model.__dict__[INFERENCE_ENGINE] = engine
    return model


def write_partition(target: torch.Tensor, source: torch.Tensor) -> None:
    """``source``'s values (a tensor of the policy) into what this rank holds of ``target`` (the frozen model's):
    partition to partition where both hold the same span (models partitioned over the same ranks; no communication),
    else through a gather of what is partitioned (a collective: every rank calls it for the same tensors)."""
    import deepspeed

    held, given = zero3_partition(target), zero3_partition(source)
    if held is not None and given is not None and held[1] == given[1]:
        held[0][: len(held[1])].copy_(given[0][: len(given[1])])
        return
    partitioned = [t for t in (target, source) if zero3_full_shape(t) is not None]
    if zero3_full_shape(target) is None:  # a buffer, or a tensor ZeRO-3 does not partition: every rank writes it
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None, enabled=bool(partitioned)):
            target.data.copy_(source.detach())
        return
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):  # rank 0 writes, then re-partitions
        if torch.distributed.get_rank() == 0:
            target.data.copy_(source.detach())


__all__ = ["INFERENCE_ENGINE", "check_zero3_dtype", "engine_dtype", "with_inference_hooks", "write_partition"]
