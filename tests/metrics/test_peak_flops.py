"""Dense peak-FLOPs table: CUDA device names, dtypes, unknown chips."""

from __future__ import annotations

import pytest

from gym_lightning.metrics.peak_flops import DENSE_PEAK_FLOPS, chip_key, dense_peak_flops, precision_to_dtype


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA B200", "b200"),
        ("Tesla V100-SXM2-16GB", "v100-sxm"),
    ],
)
def test_cuda_names_map_to_chips(name: str, key: str) -> None:
    assert chip_key(name) == key


@pytest.mark.parametrize(
    "name", ["NVIDIA GeForce RTX 4090 D", "NVIDIA GH200 480GB", "NVIDIA GB200", "NVIDIA H800", "cpu", "AMD MI300X"]
)
def test_unknown_chips_give_none_not_a_guess(name: str) -> None:
    assert chip_key(name) is None
    assert dense_peak_flops(name, "bf16") is None


def test_dense_not_sparse_figures() -> None:
    # Datasheets print 2:4-sparse next to dense; the sparse ones are exactly 2x these.
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert dense_peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.5e12)  # Lightning lists 2.0e15 (sparse)
    assert dense_peak_flops("NVIDIA H100 NVL", "bf16") == pytest.approx(835.5e12)  # Lightning lists 1978.8e12
    assert dense_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert dense_peak_flops("NVIDIA GeForce RTX 4090", "bf16") == pytest.approx(165.2e12)
    assert dense_peak_flops("NVIDIA L40S", "fp8") == pytest.approx(733e12)
    assert dense_peak_flops("NVIDIA B200", "bf16") == pytest.approx(2250e12)  # HGX B200 sheet: 36 PF sparse / 8 / 2


def test_every_chip_orders_dtypes_sensibly() -> None:
    for chip, peaks in DENSE_PEAK_FLOPS.items():
        assert peaks.get("bf16", peaks["fp16"]) >= peaks["fp32"], chip
        if "fp8" in peaks:
            assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.02), chip  # L40S sheet: 733 vs 2x362


def test_dtype_missing_for_chip_is_none() -> None:
    assert dense_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # Volta has no bf16 tensor cores


@pytest.mark.parametrize(
    ("precision", "matmul", "dtype"),
    [
        ("bf16-mixed", "highest", "bf16"),
        ("bf16-true", "highest", "bf16"),
        ("16-mixed", "highest", "fp16"),
        ("32-true", "highest", "fp32"),
        ("32-true", "high", "tf32"),
        ("64-true", "highest", None),
        ("transformer-engine", "highest", "fp8"),
    ],
)
def test_precision_to_dtype(precision: str, matmul: str, dtype: str | None) -> None:
    assert precision_to_dtype(precision, matmul) == dtype
