"""The device check's correctness part on one CUDA GPU, one test per check (skipped without CUDA).

Run on a GPU machine: ``python -m pytest tests/gpu -q`` (at most 4 minutes: the checks and the shipped configs'
fits). It runs benchmarks/workers/gpu_check.py, the worker benchmarks/gpu.sh runs before its benchmark round: one
process, every strategy (gym_ddp, gym_fsdp, zero1-3) in bf16-mixed against an fp32 run of the same batches,
gym_fsdp's CPU offload, validation metrics, the HF export, equal initial weights, the chunked loss and the DDP
compression hooks (the worker's docstring says how each check decides). No DeepSpeed op is built
(tests/gpu/conftest.py); the ZeRO offload variants, which need DeepSpeed's CPU Adam, are not run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

# tests/ holds the shared launch helpers; pytest only puts tests/gpu on sys.path for this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from helpers.dist import REPO_ROOT, rank_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKER = REPO_ROOT / "benchmarks" / "workers" / "gpu_check.py"


def _worker_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", WORKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out: Path = tmp_path_factory.mktemp("gpu")
    command = [sys.executable, str(WORKER), "--out", str(out / "checks.jsonl"), "--work", str(out / "work")]
    done = subprocess.run(command, cwd=REPO_ROOT, env=rank_env(), capture_output=True, text=True, timeout=600)
    lines = (out / "checks.jsonl").read_text().splitlines() if (out / "checks.jsonl").is_file() else []
    found = {record["check"]: record for record in map(json.loads, lines)}
    assert found, f"gpu_check.py wrote nothing (exit {done.returncode})\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return found


@pytest.mark.parametrize("name", _worker_module().check_names())
def test_check_passes_on_one_gpu(records: dict[str, dict], name: str) -> None:
    assert name in records, f"{name} was not recorded: the worker stopped before it"
    assert records[name]["ok"], json.dumps(records[name], indent=1)[:4000]
