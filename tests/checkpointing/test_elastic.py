"""Elastic restarts: under ``torchrun --max-restarts 1`` a run whose worker dies resumes from ``last`` by itself.

This file is also the worker: torchrun starts ``python tests/checkpointing/test_elastic.py SPEC.json`` once per rank
(Lightning detects the torchelastic environment and does not launch ranks itself). Every attempt runs the SAME
command, ``fit(ckpt_path="last")``, which starts from scratch when there is no checkpoint yet; on the first attempt
(``TORCHELASTIC_RESTART_COUNT == "0"``) rank 1 SIGKILLs itself in the middle of the 5th optimizer step, one
micro-batch after the step-4 checkpoint. torchrun then tears the group down and starts attempt 1, which must pick up
the step-4 checkpoint on its own and finish with the weights of an uninterrupted run (same scenario, data, model and
tolerance as tests/checkpointing/test_resume.py, whose worker pieces are reused; DDP only, the strategy-specific
resume paths are covered there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"


# ------------------------------------------------------------------------------------------------------ worker
class RecordAttempt(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """Write a marker per attempt and rank with the step training (re)started from (after any checkpoint restore)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: Any, module: Any) -> None:
        attempt = os.environ.get(ATTEMPT_ENV, "none")
        marker = {"attempt": attempt, "start_step": trainer.global_step, "world_size": trainer.world_size}
        (self.out / f"attempt-{attempt}-rank{trainer.global_rank}.json").write_text(json.dumps(marker))


def run_attempt(spec: dict[str, Any]) -> None:
    """One torchrun attempt: the same ``fit(ckpt_path="last")`` every time; attempt 0 may kill rank 1."""
    import lightning.pytorch as pl
    from helpers.strategy_worker import RecordLosses
    from test_resume import KILL_AT_BATCH, KILL_AT_STEP, KillRank, build_strategy, seeded_module_and_data

    from gym_lightning.checkpointing import StepCheckpoint

    out = Path(spec["out"])
    module, data = seeded_module_and_data(spec)
    recorder = RecordLosses()
    callbacks = [recorder, RecordAttempt(out), StepCheckpoint(dirpath=out / "ckpt", every_n_steps=1, keep_last=2)]
    if spec["kill"] and os.environ[ATTEMPT_ENV] == "0":
        callbacks.append(KillRank(1, KILL_AT_STEP, KILL_AT_BATCH))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=build_strategy("gym_ddp"), precision="32-true", max_epochs=2,
        accumulate_grad_batches=2, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last")
    if trainer.is_global_zero:
        attempt = os.environ[ATTEMPT_ENV]
        torch.save({k: v.detach().cpu() for k, v in module.model.state_dict().items()}, out / "final.pt")
        result = {"attempt": attempt, "losses": recorder.losses, "global_step": trainer.global_step}
        (out / "result.json").write_text(json.dumps(result))
    trainer.strategy.barrier()


# ------------------------------------------------------------------------------------------------------ tests
def torchrun(spec: dict[str, Any], timeout: float = 240) -> subprocess.CompletedProcess:
    from helpers.dist import free_port, rank_env

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.5", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"127.0.0.1:{free_port()}", __file__, str(spec_path),
    ]  # fmt: skip
    # torchrun's c10d rendezvous shares ONE agent TCPStore across restarts, and workers write their gloo addresses
    # into it without a per-attempt prefix (torch/distributed/rendezvous.py assumes a new store per retry): the
    # restarted rank 0 read rank 1's dead address from attempt 0 and failed in connectFullMesh. Opting out of the
    # shared store makes rank 0 host a fresh store on a fresh port each attempt. Users need the same setting.
    return subprocess.run(
        command, env=rank_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), capture_output=True, text=True, timeout=timeout
    )


def markers(out: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("attempt-*.json"))}


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_resumes_from_last(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    from test_resume import KILL_AT_STEP, LOSS_ATOL, LOSS_RTOL, assert_same_weights

    model_dir, train_file = pretrained
    spec = {"model_dir": str(model_dir), "train_file": str(train_file)}
    elastic = torchrun({**spec, "out": str(tmp_path / "elastic"), "kill": True})
    log = f"\n--- stdout ---\n{elastic.stdout[-3000:]}\n--- stderr ---\n{elastic.stderr[-8000:]}"
    assert elastic.returncode == 0, f"torchrun should recover from the killed worker (exit {elastic.returncode}){log}"

    # Two attempts on both ranks: the first started from scratch, the restart from the step-4 checkpoint.
    started = {name: marker["start_step"] for name, marker in markers(tmp_path / "elastic").items()}
    expected = {f"attempt-{a}-rank{r}": KILL_AT_STEP if a else 0 for a in (0, 1) for r in (0, 1)}
    assert started == expected, f"attempts and start steps: {started}{log}"
    resumed = json.loads((tmp_path / "elastic" / "result.json").read_text())
    assert resumed["attempt"] == "1" and resumed["global_step"] == 6
    assert len(resumed["losses"]) == 4, "the restart trains micro-batches 2..5 of epoch 1, not the whole epoch"

    full_run = torchrun({**spec, "out": str(tmp_path / "full"), "kill": False})
    assert full_run.returncode == 0, f"uninterrupted run failed\n{full_run.stderr[-8000:]}"
    assert sorted(markers(tmp_path / "full")) == ["attempt-0-rank0", "attempt-0-rank1"], "no restart without a kill"
    full = json.loads((tmp_path / "full" / "result.json").read_text())
    assert full["global_step"] == 6 and len(full["losses"]) == 12
    torch.testing.assert_close(resumed["losses"], full["losses"][-4:], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    final = torch.load(tmp_path / "elastic" / "final.pt", weights_only=True)
    assert_same_weights(final, torch.load(tmp_path / "full" / "final.pt", weights_only=True))


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_attempt(json.loads(Path(sys.argv[1]).read_text()))
