"""Dense peak FLOP/s per chip and dtype, for MFU (pure lookups, no Lightning).

Every figure is the DENSE tensor-core (or, for fp32, the plain CUDA-core) peak from NVIDIA's datasheet; datasheets
print 2:4-structured-sparsity figures next to (or instead of) them, marked with an asterisk, which are exactly twice
as large and must not be used for MFU (Lightning's ``_CUDA_FLOPS`` lists some sparse ones, e.g. H100 NVL and H200).
fp16/bf16 figures are with fp32 accumulation, which is what PyTorch's matmuls use; "tf32" is the fp32 peak when
``torch.backends.cuda.matmul.allow_tf32`` (or ``torch.set_float32_matmul_precision("high")``) lets matmuls use TF32.

The figures and the CUDA-name patterns live in the hardware catalog (``gym_lightning/assets/hardware.yaml``, read by
:mod:`gym_lightning.metrics.hardware`), each GPU with its datasheet under ``source``: NVIDIA's A100, H100 (SXM5 /
PCIe / NVL), H200 (SXM / NVL), HGX B200, L40S, L40, L4 and V100 datasheets, and the Ada architecture whitepaper v2.1
(table 2) for the RTX 4090. This module is that table seen by chip key, so there is one table.

A chip that is not in the table gives ``None``, so MFU reads "n/a": a guess would be a wrong number with a decimal.
"""

from __future__ import annotations

from typing import Literal

from gym_lightning.metrics.hardware import GPUS, gpu_for_device_name

PeakDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]

# chip key -> dtype -> dense peak FLOP/s, from the catalog. CUDA names map to keys through each GPU's cuda_names
# patterns, e.g. "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA B200", "NVIDIA GeForce RTX 4090".
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {key: dict(chip.dense_peak) for key, chip in GPUS.items()}


def chip_key(device_name: str) -> str | None:
    """Table key for a CUDA device name, or ``None`` if the chip is not in the table."""
    chip = gpu_for_device_name(device_name)
    return chip.key if chip is not None else None


def dense_peak_flops(device_name: str, dtype: PeakDtype) -> float | None:
    """Dense peak FLOP/s of one device for matmuls in ``dtype``; ``None`` when chip or dtype is unknown."""
    key = chip_key(device_name)
    return DENSE_PEAK_FLOPS.get(key, {}).get(dtype) if key else None


def precision_to_dtype(precision: str, float32_matmul_precision: str = "highest") -> PeakDtype | None:
    """Matmul dtype of a Lightning precision setting (``"bf16-mixed"``, ``"16-true"``, ``"32-true"``, ...).

    Args:
        precision: ``str(trainer.precision)``; ``transformer-engine`` variants map to fp8.
        float32_matmul_precision: ``torch.get_float32_matmul_precision()``; anything but ``"highest"`` means TF32.
    """
    if "transformer-engine" in precision:
        return "fp8"
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        return "fp32" if float32_matmul_precision == "highest" else "tf32"
    return None  # fp64 and anything unknown: no peak in the table
