"""A damaged shard of a sharded checkpoint made by ``gym fit`` on 2 CPU ranks, resumed the way users resume.

One file of the step-4 checkpoint (rank 1's shard) is cut to half its size or has 4 KiB inverted in the middle,
then ``gym fit --config run.yaml --ckpt_path .../step-00000004.ckpt`` runs on 2 ranks (Lightning's launcher). Before
manifests, gym_fsdp ended in a traceback naming no file, ZeRO-3 in rank 0's "Connection closed by peer", and ZeRO-3
with flipped bytes loaded the damaged optimizer state and diverged two steps later. Now every rank stops before
reading anything, with exit status 2 and one line naming the file, what the manifest records, what was found and
the previous checkpoint; no process of the job is left.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.jobs import run_job
from test_manifest import flip

CASES = {
    "gym_fsdp-truncated": ("gym_fsdp", "__1_0.distcp", "truncated"),
    "zero3-flipped": ("zero3", "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt", "flipped"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_shard_stops_every_rank_with_one_line_naming_it(case: str, cli_run, tmp_path: Path) -> None:
    strategy, shard_name, damage = CASES[case]
    run = cli_run(strategy)
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(run.checkpoints, checkpoints, symlinks=True)
    damaged = checkpoints / "step-00000004.ckpt"
    shard = damaged / shard_name
    size = shard.stat().st_size
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: size // 2])
    else:
        flip(shard, size // 2)

    config = str(run.config)
    job = run_job(["-m", "gym_lightning", "fit", "--config", config, "--ckpt_path", str(damaged)], timeout=300)
    assert job.returncode == 2, f"exit {job.returncode}{job.log()}"
    assert not job.leftovers, f"processes left: {job.leftovers}{job.log()}"
    errors = [line for line in job.stderr.splitlines() if line.startswith("gym_lightning: error:")]
    assert len(errors) == 1, errors
    assert str(shard) in errors[0] and "step-00000004.ckpt is damaged and was not loaded" in errors[0]
    assert f"--ckpt_path {checkpoints / 'step-00000002.ckpt'}" in errors[0]
    expected = f"has {size // 2:,} bytes, the manifest records {size:,}" if damage == "truncated" else "xxh3_128"
    assert expected in errors[0] and "Traceback" not in job.stderr
