"""What the checkpoint manifest costs at 250M parameters: hashing on save and checking on load, beside the write.

    python -m benchmarks.checkpoint_manifest                        # gym_ddp, gym_fsdp, zero3; ~15 min on 2 cores
    python -m benchmarks.checkpoint_manifest --strategies gym_fsdp --repeats 5
    python -m benchmarks.checkpoint_manifest --write-docs           # also replaces the section in docs/benchmarks.md

Trains the 250M Llama folder of ``benchmarks.common.models`` (built once under ``--workdir``) for one optimizer step
through the real CLI on 2 CPU ranks (``bf16-mixed``: fp32 master weights and AdamW state, a 3.3 GB checkpoint),
then, at the end of training, ``ManifestCost`` saves the checkpoint ``--repeats`` times and times, on every rank,
the three parts of a ``StepCheckpoint`` save and of a resume's check, side by side in one process:

- ``write``: ``trainer.save_checkpoint`` (every rank writes its files; ends with a barrier), less the time spent
  hashing the bytes as they went out (single-file and DeepSpeed checkpoints are hashed while written,
  ``manifest.HashingFile``);
- ``hash on save``: the seconds spent hashing, inline and reading back the files that were not hashed inline
  (FSDP's, whose torch distributed checkpoint writer is not ours);
- ``manifest + flush``: the rest of the manifest step (``StepCheckpoint._write_manifest``: the records gathered,
  rank 0 writing and fsyncing the manifest, the barrier after it). The fsync is where a DeepSpeed checkpoint,
  which DeepSpeed writes without one, reaches the disk (ext4 flushes the file system's dirty data with it); DDP's
  single file and FSDP's shards were fsynced by their writers, inside ``write``;
- ``check on load``: every rank checks its files against the manifest (``manifest.verify_checkpoint``: size, then
  XXH3-128 of the bytes; the in-process cache is cleared first) and the ranks agree.

The files were just written, so they are read back from the page cache, as at the end of a real save; a resume days
later reads them from disk, as the load itself must. Each figure is the slowest rank's, median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from benchmarks.common.docs import replace_section
from benchmarks.common.models import ensure_folder
from benchmarks.common.paths import DOCS, REPO_ROOT

SECTION = "## Checkpoint manifests: hashing on save and checking on load at 250M"
STRATEGIES = ("gym_ddp", "gym_fsdp", "zero3")


class ManifestCost(Callback):
    """At the end of training, time ``repeats`` checkpoint saves split into write / hash / check (see the module
    docstring); each rank writes ``<out>/rank<r>.json``.

    Args:
        out: Folder for the per-rank JSON files and the checkpoints (deleted after each repeat).
        repeats: Saves to time.
    """

    def __init__(self, out: str, repeats: int = 3) -> None:
        self.out, self.repeats = Path(out), repeats

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from gym_lightning.atomic import remove_path
        from gym_lightning.checkpointing import StepCheckpoint
        from gym_lightning.checkpointing.callback import publish
        from gym_lightning.checkpointing.manifest import (
            checkpoint_files,
            forget_checked_files,
            hashing_seconds,
            verify_checkpoint,
        )

        rows = []
        for repeat in range(self.repeats):
            staging, final = self.out / f".ckpt-{repeat}.partial", self.out / f"ckpt-{repeat}"
            trainer.strategy.barrier()
            before = hashing_seconds()
            start = time.perf_counter()
            trainer.save_checkpoint(str(staging))
            wrote, inline = time.perf_counter(), hashing_seconds() - before
            StepCheckpoint._write_manifest(trainer, staging, str(final))
            trainer.strategy.barrier()
            hashed, hashing = time.perf_counter(), hashing_seconds() - before
            if trainer.is_global_zero:
                publish(staging, final)
            trainer.strategy.barrier()
            forget_checked_files()  # as a resuming process: nothing remembered, every owned file read and hashed
            checked = time.perf_counter()
            verify_checkpoint(final, trainer.global_rank, trainer.world_size)
            done = time.perf_counter()
            root = final if final.is_dir() else final.parent
            size = sum((root / name).stat().st_size for name in checkpoint_files(final))
            # The digest taken while writing is part of the write's time; it is counted as hashing, not writing.
            row = {"write": wrote - start - inline, "hash": hashing, "manifest": hashed - wrote - (hashing - inline)}
            rows.append({**row, "check": done - checked, "inline": inline, "bytes": size})
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                remove_path(final)
                remove_path(self.out / f"ckpt-{repeat}.manifest.json", missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(rows))


def fit_command(folder: Path, strategy: str, run: Path, repeats: int) -> list[str]:
    callback = {"class_path": "benchmarks.checkpoint_manifest.ManifestCost",
                "init_args": {"out": str(run / "cost"), "repeats": repeats}}  # fmt: skip
    return [
        sys.executable, "-m", "gym_lightning", "fit", "--config", str(REPO_ROOT / "configs" / "quickstart.yaml"),
        "--trainer.devices", "2", "--trainer.strategy", strategy, "--trainer.precision", "bf16-mixed",
        "--trainer.max_steps", "1", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(run), "--trainer.logger", "false",
        f"--trainer.callbacks+={json.dumps(callback)}", "--trainer.enable_progress_bar", "false",
        "--model.model", str(folder), "--model.config_overrides", "null", "--model.val_exact_match", "false",
        "--model.lr", "1e-5", "--model.scheduler", "constant",
        "--data.packing", "true", "--data.max_seq_length", "4", "--data.batch_size", "1", "--data.mask_prompt", "false",
        "--export.output_dir", "null",
    ]  # fmt: skip


def run_one(workdir: Path, strategy: str, repeats: int) -> dict[str, Any]:
    run = workdir / "runs" / f"manifest-{strategy}"
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    folder = workdir / "models" / "llama-250m"
    done = subprocess.run(fit_command(folder, strategy, run, repeats), env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True)  # fmt: skip
    (workdir / f"manifest-{strategy}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"{strategy} failed (rc {done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return {"failed": done.returncode}
    ranks = [json.loads((run / "cost" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    shutil.rmtree(run, ignore_errors=True)
    return {"ranks": ranks}


def summary(result: dict[str, Any]) -> dict[str, float]:
    """Median over repeats of the slowest rank's seconds per part; the checkpoint's bytes."""
    ranks = result["ranks"]
    parts = {}
    for part in ("write", "hash", "manifest", "check"):
        parts[part] = statistics.median(max(rank[i][part] for rank in ranks) for i in range(len(ranks[0])))
    parts["bytes"] = ranks[0][0]["bytes"]  # every rank sums the sizes of all the checkpoint's files
    return parts


def render(results: dict[str, Any]) -> str:
    lines = [
        SECTION, "",
        "`python -m benchmarks.checkpoint_manifest` (2 CPU ranks, the 250M Llama folder of scale.py, bf16-mixed, "
        "fp32 AdamW state). Seconds of the slowest rank, median of the repeats; the files are read back from the "
        "page cache right after the write. Target: hashing small against the write.", "",
        "| strategy | checkpoint | write | hash on save | manifest + flush | check on load | hash / write "
        "| check / write |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for strategy, result in results.items():
        if "ranks" not in result:
            lines.append(f"| {strategy} | failed (exit {result.get('failed')}) | | | | | | |")
            continue
        s = summary(result)
        lines.append(
            f"| {strategy} | {s['bytes'] / 1e9:.2f} GB | {s['write']:.2f} s | {s['hash']:.2f} s | "
            f"{s['manifest']:.2f} s | {s['check']:.2f} s | {s['hash'] / s['write']:.2f} "
            f"| {s['check'] / s['write']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-scale")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    ensure_folder(args.workdir, "250m")
    results = {}
    for strategy in args.strategies:
        print(f"{strategy} ...", file=sys.stderr, flush=True)
        results[strategy] = run_one(args.workdir, strategy, args.repeats)
    (args.workdir / "manifest-results.json").write_text(json.dumps(results, indent=1))
    section = render(results)
    print(section)
    if args.write_docs:
        DOCS.write_text(replace_section(DOCS.read_text(), SECTION, section))


if __name__ == "__main__":
    main()
