"""Optimizer parameter groups and learning-rate schedules (pure functions; the module wires them in)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

SchedulerName = Literal["cosine", "linear", "constant"]


def weight_decay_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, object]]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Biases and normalisation weights are 1-D, matrices (linear and embedding weights) are 2-D or more: decaying
    only the latter is the rule of GPT-2/nanoGPT (``configure_optimizers`` in nanoGPT's ``model.py``) and of the
    Hugging Face Trainer (which excludes biases and ``LayerNorm`` weights).
    """
    decay, no_decay = [], []
    for _, param in named_parameters:
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


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
