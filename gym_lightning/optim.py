"""Optimizer parameter groups and learning-rate schedules (pure functions; the module wires them in)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch

from gym_lightning._compat import zero3_full_shape

SchedulerName = Literal["cosine", "linear", "constant"]
# HF Trainer --optim names built here, as Trainer.get_optimizer_cls_and_kwargs builds them (torch's optimizers and
# transformers' Adafactor; the others need bitsandbytes, torchao, galore, ... or an XLA/NPU device).
OptimizerName = Literal["adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor"]
# transformers.SchedulerType values that transformers.get_scheduler builds from the step counts alone
# (reduce_lr_on_plateau and greedy follow a validation metric).
HFSchedulerName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
]


DecayRule = Literal["ndim", "hf"]
# The HF Trainer's names of parameters without weight decay (Trainer.get_decay_parameter_names, transformers 5).
HF_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def weight_decay_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    weight_decay: float,
    decay_names: set[str] | None = None,
) -> list[dict[str, object]]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Without ``decay_names``: biases and normalisation weights are 1-D, matrices (linear and embedding weights) are
    2-D or more; decaying only the latter is the rule of GPT-2/nanoGPT (``configure_optimizers`` in nanoGPT's
    ``model.py``). With ``decay_names`` (``hf_decay_names``): exactly those are decayed, the HF Trainer's rule.
    The two agree on Llama/Qwen-style models (their only 1-D parameters are norm weights).
    """
    decay, no_decay = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            # A ZeRO-3 parameter is an empty 1-D partition when the optimizer is built: its full shape decides.
            ndim = len(zero3_full_shape(param) or param.shape)
            decayed = ndim >= 2 if decay_names is None else name in decay_names
            (decay if decayed else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def hf_decay_names(model: torch.nn.Module) -> set[str]:
    """The HF Trainer's decayed parameter names: not in a ``LayerNorm``, not named bias or (layer/rms)norm."""
    from transformers.trainer_pt_utils import get_parameter_names

    return set(get_parameter_names(model, [torch.nn.LayerNorm], HF_NO_DECAY_PATTERNS))


def resolve_warmup_steps(warmup_steps: int, warmup_ratio: float, total_steps: int) -> int:
    """Warm-up length in optimizer steps: explicit steps win over a ratio of the total (as in the HF Trainer)."""
    return warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_steps)


def lr_multiplier(step: int, *, name: SchedulerName, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Factor applied to the base learning rate at optimizer step ``step`` (0-based).

    Linear warm-up from ``1/(warmup_steps+1)`` to 1, then constant, linear decay or half-cosine decay towards
    ``min_lr_ratio`` at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


# Device types with torch's fused AdamW kernel (torch 2.13: torch.utils._foreach_utils' fused list; CPU since 2.4).
FUSED_ADAMW_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "xpu", "mps", "hpu")


def adamw_kernel(groups: list[dict[str, object]]) -> dict[str, bool]:
    """``fused=True`` where every parameter is a float tensor on a device with the fused kernel, else the for-loop.

    The fused kernel updates each tensor in place without temporaries. torch's other two paths allocate them: the
    for-loop (``foreach=False``, the CPU default) two fp32 tensors the size of the parameter being updated, the
    ``foreach`` path (the CUDA default) its intermediates over a whole list of parameters at once
    (``benchmarks/optimizer_transients.py``; docs/benchmarks-history.md, "AdamW's step transients"). Where fused is
    not available the for-loop's transient (one largest parameter, twice) is the smaller of the other two on large
    models.
    """
    params = [p for group in groups for p in group["params"]]  # type: ignore[attr-defined]
    fusable = all(p.device.type in FUSED_ADAMW_DEVICE_TYPES and torch.is_floating_point(p) for p in params)
    return {"fused": True} if fusable else {"foreach": False}


def build_optimizer(
    name: OptimizerName, groups: list[dict[str, object]], *, lr: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """The optimizer the HF Trainer builds for ``--optim name`` (betas/eps are AdamW's only, as there).

    ``adamw_torch_fused`` (HF 5's default and the module's) falls back to the for-loop AdamW on devices without the
    fused kernel (``adamw_kernel``); ``adamw_torch`` is torch's default path, as the HF Trainer builds it.
    """
    if name in ("adamw_torch", "adamw_torch_fused"):
        kernel = adamw_kernel(groups) if name == "adamw_torch_fused" else {}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kernel)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # HF's settings for --optim adafactor: the given learning rate, not Adafactor's relative step sizes.
        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)
    classes: dict[str, Any] = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}
    return classes[name](groups, lr=lr)


def hf_scheduler(
    name: HFSchedulerName,
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    kwargs: dict[str, Any] | None = None,
) -> torch.optim.lr_scheduler.LRScheduler:
    """``transformers.get_scheduler``: the HF Trainer's schedule, its warm-up ``step / warmup_steps`` included."""
    from transformers import get_scheduler

    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=kwargs,
    )
