"""Exit status of finished 2-rank ``gym fit`` runs on CPU ranks, run after run: every rank must exit 0.

    python -m benchmarks.exit_loop                      # 20 runs of gym_fsdp, quickstart shortened to 2 steps
    python -m benchmarks.exit_loop --runs 20 --strategy gym_ddp
    python -m benchmarks.exit_loop --pythonpath /tmp/old-checkout   # the same loop on another checkout's code

Each run is ``torchrun --nproc_per_node 2 -m gym_lightning fit --config configs/quickstart.yaml`` with the strategy,
2 optimizer steps, a step checkpoint, a CSV logger and the end-of-fit export, as a user runs it; torchrun reports
each rank's exit code. A finished run once exited -6 now and then ("terminate called without an active
exception": gloo's threads outliving the process group while the interpreter finalised); ``cli.end_process`` ends
such a process after its exit handlers instead. Prints one line per run and a summary (exit codes counted, runs
whose CSV log or export is missing); the exit code is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.launch import child_env, free_port
from benchmarks.common.paths import CONFIGS, REPO_ROOT

# torchrun's failure report: "exitcode  : -6 (pid: 123)" per failed rank.
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def fit_command(strategy: str, root: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
        "-m", "gym_lightning", "fit", "--config", str(CONFIGS / "quickstart.yaml"),
        "--trainer.devices", "2", "--trainer.strategy", strategy, "--trainer.max_steps", "2",
        "--trainer.max_epochs", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(root), "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing",
        "true",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
        '--trainer.callbacks+={"class_path": "gym_lightning.checkpointing.StepCheckpoint", '
        f'"init_args": {{"dirpath": "{root / "checkpoints"}", "every_n_steps": 2}}}}',
        "--data.batch_size", "8", "--export.output_dir", str(root / "hf"),
    ]  # fmt: skip


def one_run(strategy: str, root: Path, env: dict[str, str]) -> tuple[list[int], bool, float]:
    """The ranks' exit codes (``[0]`` when torchrun reports none failed), whether the run's files are all there
    (CSV metrics, export, checkpoint) and its seconds."""
    start = time.perf_counter()
    done = subprocess.run(fit_command(strategy, root), cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (root / "output.log").write_text(done.stdout + done.stderr)
    codes = [int(code) for code in EXITCODE.findall(done.stderr)] if done.returncode else [0]
    files = [*root.glob("lightning_logs/*/metrics.csv"), root / "hf" / "config.json", root / "checkpoints/last.ckpt"]
    return codes, all(path.exists() for path in files), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--strategy", default="gym_fsdp")
    parser.add_argument("--pythonpath", type=Path, default=REPO_ROOT, help="the checkout whose code runs")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-exit-loop")
    args = parser.parse_args()
    # The checkout under test first on the ranks' path (its gym_lightning is the one that runs).
    env = child_env(args.pythonpath, threads=1, PYTHONFAULTHANDLER="1")
    counts: collections.Counter[int] = collections.Counter()
    incomplete = []
    for run in range(1, args.runs + 1):
        root = args.workdir / f"run{run:02d}"
        subprocess.run(["rm", "-rf", str(root)], check=True)
        root.mkdir(parents=True)
        codes, complete, seconds = one_run(args.strategy, root, env)
        counts.update(codes)
        if not complete:
            incomplete.append(run)
        print(f"run {run:2d}: exit codes {codes}, files {'complete' if complete else 'MISSING'}, {seconds:.0f} s")
    print(f"{args.runs} runs of {args.strategy} (code: {args.pythonpath}): exit codes {dict(counts)}; runs with "
          f"missing files: {incomplete or 'none'}")  # fmt: skip
    raise SystemExit(0 if set(counts) == {0} and not incomplete else 1)


if __name__ == "__main__":
    main()
