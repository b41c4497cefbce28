"""Each strategy trains the tiny Llama on one CUDA GPU in bf16 mixed precision (skipped without CUDA).

Run on a GPU machine: ``python -m pytest tests/gpu -q``. One worker process runs every strategy in turn (nccl
process group of 1), then the bf16 losses are compared loosely with an fp32 single-device run of the same batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/ holds the shared launch helpers; pytest only puts tests/gpu on sys.path for this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.dist import run_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_STRATEGIES = ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from helpers.strategy_worker import save_tiny_pretrained

    out: Path = tmp_path_factory.mktemp("gpu")
    model_dir = str(save_tiny_pretrained(out / "pretrained"))
    phases = [{"name": name, "max_epochs": 2, "strategy": name} for name in GPU_STRATEGIES]
    phases.append({"name": "fp32_reference", "max_epochs": 2, "strategy": "auto", "precision": "32-true"})
    spec = {
        "model": "causal",
        "model_dir": model_dir,
        "accelerator": "cuda",
        "devices": 1,
        "precision": "bf16-mixed",
        "dataset_size": 24,
        "batch_size": 8,
        "accumulate": 2,
        "phases": phases,
    }
    return run_worker(spec, out, timeout=900)


@pytest.mark.parametrize("name", GPU_STRATEGIES)
def test_strategy_trains_on_one_gpu_in_bf16(gpu_runs: dict, name: str) -> None:
    result, reference = gpu_runs[name], gpu_runs["fp32_reference"]
    assert result["global_step"] == reference["global_step"] == 4
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    # bf16 compute rounds activations to ~3 significant digits; the trajectory stays within a few percent.
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=5e-2, atol=5e-2)
