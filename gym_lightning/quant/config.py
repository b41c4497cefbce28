"""The settings of a 4-bit base model (QLoRA), as YAML's ``model.quantization`` and ``gym train``'s HF/TRL flags
(``--load_in_4bit --bnb_4bit_quant_type nf4 --bnb_4bit_compute_dtype bfloat16 --bnb_4bit_use_double_quant
--bnb_4bit_quant_storage bfloat16``): every value transformers' ``BitsAndBytesConfig`` takes for these."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from gym_lightning._compat import rank_zero_info
from gym_lightning.errors import GymUserError
from gym_lightning.settings import settings_from

QuantType = Literal["nf4", "fp4"]
ComputeDType = Literal["bfloat16", "float16", "float32", "float64"]
# transformers' BitsAndBytesConfig's bnb_4bit_quant_storage names (its list, in its order).
QuantStorage = Literal["float16", "float32", "int8", "uint8", "float64", "bfloat16"]
QUANT_TYPES: tuple[str, ...] = get_args(QuantType)
COMPUTE_DTYPES: tuple[str, ...] = get_args(ComputeDType)
QUANT_STORAGES: tuple[str, ...] = get_args(QuantStorage)


@dataclass(frozen=True)
class QuantizationArgs:
    """A frozen base model in 4-bit NF4 (or FP4), its linear layers dequantised one at a time in the compute dtype.

    Args:
        quant_type: ``nf4`` (QLoRA's 4-bit NormalFloat) or ``fp4`` (bitsandbytes' 4-bit float, its code book: the
            same size; QLoRA, Sec. 4, finds NF4 better).
        compute_dtype: The dtype each weight is dequantised to and its matmul runs in (``float64`` too, as
            transformers accepts it).
        double_quant: Quantise the per-block scales too (8-bit, per output row): 4.14 instead of 4.5 bits a weight.
        block_size: Weights per scale along a row (64 in QLoRA); a linear layer whose input width does not divide
            by it stays in 16 bits.
        quant_storage: Accepts every ``bnb_4bit_quant_storage`` of transformers; the codes stay uint8 whatever it
            says (one info line when it is not ``uint8``): bitsandbytes' float storage lets flat-parameter wrappers
            (FSDP1, DeepSpeed's flat buffers) hold the codes, and gym_lightning's strategies shard per parameter and
            never cast integers (``quant.nf4``).
        skip_modules: Linear layers kept in full precision, by name or last name component (the LM head by default).
    """

    quant_type: QuantType = "nf4"
    compute_dtype: ComputeDType = "bfloat16"
    double_quant: bool = True
    block_size: int = 64
    quant_storage: QuantStorage = "uint8"
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self) -> None:
        if self.quant_storage != "uint8" and self.quant_storage in QUANT_STORAGES:
            _storage_note(self.quant_storage)

    def problems(self) -> list[str]:
        found = []
        if self.quant_type not in QUANT_TYPES:
            found.append(f"quantization.quant_type must be one of {', '.join(QUANT_TYPES)}, got {self.quant_type!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            found.append(
                f"quantization.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            found.append(f"quantization.block_size must be an even integer >= 2 (64 in QLoRA), got {self.block_size!r}")
        if self.quant_storage not in QUANT_STORAGES:
            found.append(
                f"quantization.quant_storage must be one of {', '.join(QUANT_STORAGES)} (transformers' names), got "
                f"{self.quant_storage!r}"
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


@functools.cache
def _storage_note(storage: str) -> None:
    """Say once per process and value that a float/int8 storage changes nothing (``QuantizationArgs`` is built
    again for every module and checkpoint load: one line, not one per build)."""
    rank_zero_info(
        f"quantization.quant_storage {storage} (--bnb_4bit_quant_storage) changes nothing here: the 4-bit codes stay "
        "uint8, since gym_lightning's strategies shard per parameter and need no float storage for them (bitsandbytes "
        "offers it for FSDP1/DeepSpeed flat buffers)."
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


__all__ = [
    "COMPUTE_DTYPES",
    "QUANT_STORAGES",
    "QUANT_TYPES",
    "ComputeDType",
    "QuantStorage",
    "QuantType",
    "QuantizationArgs",
    "check_strategy",
]
