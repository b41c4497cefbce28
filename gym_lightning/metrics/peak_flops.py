"""Dense peak FLOP/s per chip and dtype, for MFU (pure lookups, no Lightning).

Every figure is the DENSE tensor-core (or, for fp32, the plain CUDA-core) peak from NVIDIA's datasheet; datasheets
print 2:4-structured-sparsity figures next to (or instead of) them, marked with an asterisk, which are exactly twice
as large and must not be used for MFU (Lightning's ``_CUDA_FLOPS`` lists some sparse ones, e.g. H100 NVL and H200).
fp16/bf16 figures are with fp32 accumulation, which is what PyTorch's matmuls use; "tf32" is the fp32 peak when
``torch.backends.cuda.matmul.allow_tf32`` (or ``torch.set_float32_matmul_precision("high")``) lets matmuls use TF32.

Sources (dense column, or sparse divided by 2 where only that is printed):
* A100 SXM4 / PCIe (same peak): https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
* H100 SXM5 / PCIe / NVL, H200 SXM / NVL: https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  and https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446 (sparse figures, halved)
* L40S: https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 ; L40 and L4: their datasheets
* RTX 4090: NVIDIA Ada GPU architecture whitepaper v2.1, table 2 (FP16/BF16 tensor with FP32 accumulate)
* V100: https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf

A chip that is not in the table gives ``None``, so MFU reads "n/a": a guess would be a wrong number with a decimal.
"""

from __future__ import annotations

import re
from typing import Literal

PeakDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]

_T = 1e12
# chip key -> dtype -> dense peak FLOP/s
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100": {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
    "h100-sxm": {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T},
    "h100-pcie": {"fp32": 51 * _T, "tf32": 378 * _T, "bf16": 756.5 * _T, "fp16": 756.5 * _T, "fp8": 1513 * _T},
    "h100-nvl": {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp8": 1670.5 * _T},
    "h200-sxm": {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T, "fp8": 1979 * _T},
    "h200-nvl": {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp8": 1670.5 * _T},
    "l40s": {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362.05 * _T, "fp16": 362.05 * _T, "fp8": 733 * _T},
    "l40": {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181.05 * _T, "fp16": 181.05 * _T, "fp8": 362 * _T},
    "l4": {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T},
    "rtx-4090": {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "bf16": 165.2 * _T, "fp16": 165.2 * _T, "fp8": 330.3 * _T},
    "v100-sxm": {"fp32": 15.7 * _T, "fp16": 125 * _T},
    "v100-pcie": {"fp32": 14 * _T, "fp16": 112 * _T},
}

# (pattern on the lower-cased torch.cuda.get_device_name(), chip key); first match wins, so specific names go first.
# Names as CUDA reports them, e.g. "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
# "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA GeForce RTX 4090".
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bgh200\b", ""),  # Grace Hopper: its own power envelope; not in the table rather than a guess
    (r"\bh200\b.*\bnvl\b", "h200-nvl"),
    (r"\bh200\b", "h200-sxm"),
    (r"\bh100\b.*\bnvl\b", "h100-nvl"),
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),
    (r"\bh100\b.*\b(sxm|hbm3)", "h100-sxm"),
    (r"\ba100\b", "a100"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\brtx 4090\b(?! d)", "rtx-4090"),
    (r"\bv100\b.*\bsxm", "v100-sxm"),
    (r"\bv100\b.*\bpcie", "v100-pcie"),
)


def chip_key(device_name: str) -> str | None:
    """Table key for a CUDA device name, or ``None`` if the chip is not in the table."""
    name = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name):
            return key or None
    return None


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
