"""The settings of a 4-bit base model (QLoRA), as YAML's ``model.quantization`` and ``gym train``'s HF/TRL flags
(``--load_in_4bit --bnb_4bit_quant_type nf4 --bnb_4bit_compute_dtype bfloat16 --bnb_4bit_use_double_quant``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gym_lightning.errors import GymUserError
from gym_lightning.settings import settings_from

ComputeDType = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class QuantizationArgs:
    """A frozen base model in 4-bit NF4, its linear layers dequantised one at a time in the compute dtype.

    Args:
        quant_type: ``nf4`` (QLoRA's 4-bit NormalFloat; bitsandbytes' ``fp4`` is not offered: QLoRA, Sec. 4, finds
            NF4 better at the same size).
        compute_dtype: The dtype each weight is dequantised to and its matmul runs in.
        double_quant: Quantise the per-block scales too (8-bit, per output row): 4.14 instead of 4.5 bits a weight.
        block_size: Weights per scale along a row (64 in QLoRA); a linear layer whose input width does not divide
            by it stays in 16 bits.
        quant_storage: How the codes are stored: ``uint8`` only (see ``quant.nf4`` for why bitsandbytes'
            ``bfloat16`` storage is not needed here).
        skip_modules: Linear layers kept in full precision, by name or last name component (the LM head by default).
    """

    quant_type: Literal["nf4"] = "nf4"
    compute_dtype: ComputeDType = "bfloat16"
    double_quant: bool = True
    block_size: int = 64
    quant_storage: Literal["uint8"] = "uint8"
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])

    def problems(self) -> list[str]:
        found = []
        if self.quant_type != "nf4":
            found.append(f"quantization.quant_type must be 'nf4', got {self.quant_type!r} (fp4 is not offered)")
        if self.compute_dtype not in ("bfloat16", "float16", "float32"):
            found.append(f"quantization.compute_dtype must be bfloat16, float16 or float32, got {self.compute_dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            found.append(f"quantization.block_size must be an even integer >= 2 (64 in QLoRA), got {self.block_size!r}")
        if self.quant_storage != "uint8":
            found.append(
                f"quantization.quant_storage must be 'uint8', got {self.quant_storage!r}: gym_lightning's strategies "
                "shard per parameter, so the codes need no floating-point storage (which a cast could corrupt)"
            )
        return found

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype as a ``torch.dtype``."""
        return getattr(torch, self.compute_dtype)

    @classmethod
    def from_value(cls, value: QuantizationArgs | Mapping[str, Any] | None) -> QuantizationArgs | None:
        """``value`` as settings: as given, or built from a mapping (YAML, a checkpoint's hyper-parameters)."""
        return settings_from(
            cls, value, "quantization", "4-bit settings (quant_type, compute_dtype, double_quant, ...)"
        )


def check_strategy(strategy: object) -> None:
    """Refuse, in one line, a strategy that cannot hold a 4-bit base: Lightning's own FSDP (FSDP1 flattens a unit's
    parameters into one tensor of one dtype, which integer codes cannot join), DeepSpeed and model-parallel
    strategies (they build and shard the model their own way). gym_lightning's strategies, which say how models are
    built (``protocols.ProvidesBuildPlan``), one device and DDP hold it."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    from gym_lightning.protocols import ProvidesBuildPlan

    if isinstance(strategy, ProvidesBuildPlan) or not isinstance(
        strategy, (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy)
    ):
        return
    raise GymUserError(
        f"model.quantization (a 4-bit base) does not run under {type(strategy).__name__}: use gym_lightning's "
        "strategies (trainer.strategy: gym_ddp, gym_fsdp, zero1, zero2 or zero3), which shard the NF4 codes per "
        "parameter, or one device."
    )


__all__ = ["ComputeDType", "QuantizationArgs", "check_strategy"]
