"""The fp32 master weights of a ZeRO run's trainable parameters, for the exporter.

Under ``bf16-mixed`` / ``16-mixed`` DeepSpeed's engine holds the module's parameters in 16 bits and the optimizer
the fp32 masters it steps. An export read from the module carried the 16-bit rounding into what it computes in fp32
(a LoRA merge, a ``--dtype float32`` export) where the checkpoint's export, read from the masters, did not: the
live and the checkpoint exports of one zero3 LoRA run differed by one bf16 rounding in every merged weight. The
masters are read through DeepSpeed's public ``deepspeed.utils.safe_get_full_fp32_param`` (a collective: every rank
loads the exporter's tensors in the same order). Stage 3 only: under ZeRO-1/2 the checkpoint's export reads the
module's 16-bit copies, and the live export does the same there, so the two stay equal (both from the masters is
owed).
"""

from __future__ import annotations

import torch
from torch import nn

from gym_lightning.lazy import LazyTensor


def master_weights(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master copy of a trainable parameter where the engine's optimizer keeps one; ``None`` for a
    frozen parameter, or where no optimizer took it (a ``validate`` run: ZeRO-3's ``_z3_optimizer`` is unset)."""
    if not (isinstance(param, nn.Parameter) and param.requires_grad):
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    try:
        return safe_get_full_fp32_param(param)
    except AttributeError:  # the same on every rank: no rank enters the collective
        return None


def reading_master_weights(param: torch.Tensor, whole: LazyTensor) -> LazyTensor:
    """``whole`` (the module's copy of ``param``), except that a cast load (``load_cast``: what an fp32 merge or a
    float32 export asks for) reads the fp32 master where there is one. Its plain ``load`` stays the module's copy:
    the master rounded to the module's dtype, as DeepSpeed rounds it after each step."""
    if not (isinstance(param, nn.Parameter) and param.requires_grad):
        return whole

    def load_as(dtype: torch.dtype) -> torch.Tensor:
        master = master_weights(param)
        return whole.load_cast(dtype) if master is None else master.detach().to(device="cpu", dtype=dtype, copy=True)

    return LazyTensor(whole.shape, whole.dtype, whole.load, load_as)


__all__ = ["master_weights", "reading_master_weights"]
