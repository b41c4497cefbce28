"""The fp32 master-weight rule: under a mixed precision, trainable weights are fp32 whatever the checkpoint holds.

transformers 5 loads a checkpoint in the dtype it was saved in (``dtype="auto"``), so a bf16 folder would train bf16
weights with bf16 AdamW states and lose updates below bf16's resolution (~0.4% of a weight). Mixed precision means
fp32 master weights and optimizer state; ``bf16-true`` remains the explicit choice of bf16 weights. Frozen parameters
(the base model under LoRA) keep their dtype. DeepSpeed's precision plugin is the one exception: its engine casts the
module to 16 bits and keeps fp32 master partitions itself, so an fp32 copy here would only add 4 bytes per parameter
to every rank's load peak (478 MiB at 250M).

This module holds the whole rule; ``CausalLMModule.configure_model`` applies it to the model it builds (under any
strategy), and gym_lightning's DDP and FSDP strategies apply it to any LightningModule in their set-up (before
wrapping or sharding). Applying it twice changes nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision

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


__all__ = ["MIXED_PRECISIONS", "fp32_master_weights", "keeps_fp32_masters"]
