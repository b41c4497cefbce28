"""Tests' view of a trained model: its whole state dict on global rank 0, under any strategy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gym_lightning.lazy import full_tensors_of


def full_model_state_dict(strategy: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU copies of ``model``'s state dict on global rank 0, ``{}`` elsewhere. Every rank must call it: under
    a strategy that shards parameters each tensor is gathered on its own (``strategy.full_tensors``, a collective).
    Holds the whole model on rank 0: for the tests' small models."""
    keep = strategy.is_global_zero
    out: dict[str, torch.Tensor] = {}
    for key, tensor in full_tensors_of(strategy, model).items():
        value = tensor.load()
        if keep:
            out[key] = value.detach().cpu().clone()
    return out
