"""benchmarks/gpu.sh --cpu-smoke end to end, where it runs: in the GPU image's environment.

gpu.sh runs only on the device machine, at the image's versions, so this test runs in .ci/run's image-like stage
(torch 2.11, transformers 5.17, the wheel bundle), which sets ``GYM_IMAGE_STAGE=1`` and ``GYM_SMOKE_WHEELS`` to the
bundle: gpu.sh installs it into a folder of its own as on the device. The README's suite skips it (its newest
versions are not the image's; about 2 minutes of the 2 cores). The argument handling and the bench part's budget
are tested in tests/test_benchmarks.py, in every environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.paths import BENCH_DIR

GPU_SH = BENCH_DIR / "gpu.sh"
IMAGE_VAR, WHEELS_VAR = "GYM_IMAGE_STAGE", "GYM_SMOKE_WHEELS"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get(IMAGE_VAR), reason=f"runs in .ci/run's image-like stage ({IMAGE_VAR}=1), where gpu.sh runs"
)
def test_gpu_script_cpu_smoke_layout(tmp_path: Path) -> None:
    """benchmarks/gpu.sh --cpu-smoke (both parts) passes and hands back what the device tool returns: at most 8
    files (gpu.sh keeps to 7) in $OUT/gpu/, plain names, nothing deeper; every test of tests/gpu recorded, passed or
    skipped with why (what needs CUDA), the gym fit of each shipped config and the host-sync cells among them; every
    run measured but Lightning's CUDA-only peers, which are skipped; the routed forward at its tiny size."""
    out, wheels = tmp_path / "out", os.environ.get(WHEELS_VAR) or str(tmp_path / "no_wheels")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GYM_WHEELS": wheels}
    env |= {"GPU_WORK_DIR": str(tmp_path / "work"), "SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(GPU_SH), "--cpu-smoke"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    names = ["env.txt", "checks.jsonl", "bench.jsonl", "routed.jsonl", "log.txt", "results.json", "host_syncs.md"]
    assert files == sorted(f"gpu/{name}" for name in names)
    results = json.loads((out / "gpu" / "results.json").read_text())
    checks = {c["check"]: c for c in results["checks"]}
    assert all(c["ok"] or (c["ok"] is None and c["skipped"]) for c in checks.values()), results["checks"]
    expected = {f"gym_fit/{name}" for name in ("ddp", "fsdp", "zero1", "zero2", "zero3", "qlora")}
    expected |= {"train/fp32_reference", "train/zero3", "export/gym_fsdp", "val_metrics", "init_weights", "op_builds"}
    expected |= {"host_syncs/gym_ddp/bf16-mixed", "host_syncs/zero3/bf16-mixed"}
    assert expected <= {name for name, c in checks.items() if c["ok"]}, sorted(checks)
    assert checks["host_syncs/zero3/16-mixed"]["ok"] is None and results["host_syncs"]["zero3"]["bf16-mixed"]["ok"]
    assert [r["key"] for r in results["routed"] if r["ok"]] == ["tiny/64"]
    assert results["failed"] == [] and results["meta"]["parts"] == "checks bench"
    for name, run in results["runs"].items():
        if name.startswith("lightning_") or name == "gym_fsdp_liger":
            assert run["skipped"].startswith("needs CUDA")
        else:
            assert run["tokens_per_sec"] > 0, (name, run)
    runs = results["runs"]
    assert [len(runs[name]["rounds"]) for name in ("plain", "gym_ddp", "gym_fsdp")] == [2, 2, 2]
    assert runs["gym_fsdp"]["vs_plain"]["paired_rounds"] == 2
    compiled = runs["gym_fsdp_compiled"]
    assert compiled["compiled_layers"] == 2 and compiled["compile_seconds"] > 0  # the tiny Qwen3's two layers
    assert runs["gym_fsdp"]["compiled_layers"] == 0 and runs["gym_fsdp"]["cpu_draws"]["reused"] >= 1
    assert "gpu.sh: done" in (out / "gpu" / "log.txt").read_text()
