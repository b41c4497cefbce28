"""Peak host memory per rank in each phase (load, training step, checkpoint save, export) at real model sizes.

    python -m benchmarks.scale                         # 250M and 1B, every strategy that fits, ~1 h on 2 cores
    python -m benchmarks.scale --sizes 250m --strategies gym_fsdp zero3
    python -m benchmarks.scale --write-docs            # also replaces the section in docs/benchmarks.md

Builds (once, cached under ``--workdir``/models; ``benchmarks.common.models``) random-init Llama-shaped folders of
about 250M and 1B parameters and a 0.4B Qwen3-MoE (``--sizes moe-400m``),
saved as sharded bf16 safetensors (``max_shard_size="500MB"``, the shipped tokenizer), like a downloaded checkpoint.
For each size and strategy it runs the real CLI on 2 CPU ranks (``python -m gym_lightning fit --config
configs/quickstart.yaml --trainer.devices 2 --trainer.strategy S --model.model FOLDER``, ``bf16-mixed``, packed rows
of 1 x ``--seq`` tokens, a few optimizer steps), with :class:`PhasePeaks` added as a callback: it saves a checkpoint
at the end of training (``trainer.save_checkpoint``, what ``ModelCheckpoint`` calls) and records each rank's peak
resident memory in each phase; the run's HF export (``export.output_dir``) is the export phase. The table puts each
measured peak beside the planner's prediction (``gym_lightning.planner.phases.phase_peaks``) and the theory
(baseline process + model states / N + one decoder layer + one file). Checkpoints and exports are deleted after
each run; the model folders are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from benchmarks.common.docs import replace_section
from benchmarks.common.memory import PeakSampler, rss
from benchmarks.common.models import SIZES, ensure_folder, folder_of
from benchmarks.common.paths import DOCS, MIB, REPO_ROOT

SECTION = "## Peak memory per phase at 250M and 1B parameters"
STRATEGIES = {
    "250m": ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3"],
    "1b": ["gym_fsdp", "zero3"],
    "moe-400m": ["gym_fsdp", "zero3"],
    "long-44m": ["gym_fsdp", "zero3"],
    "246m-untied": ["gym_fsdp", "zero3"],
}
PHASES = ("load", "step", "save", "export")


class PhasePeaks(Callback):
    """Each rank's peak resident memory in each phase, written to ``<out>/rank<r>.json`` (MiB).

    Phases: ``load`` (``setup`` before ``configure_model`` -> ``on_fit_start``, i.e. build, load, shard, optimizer),
    ``step`` (-> the end of the last training step), ``save`` (``trainer.save_checkpoint`` into ``checkpoint``, what
    ``ModelCheckpoint`` calls, at ``on_train_end``) and ``export`` (this callback's ``on_fit_end``, which runs before
    the CLI's ``HFExport``, -> ``teardown``). ``benchmarks.common.memory.PeakSampler``: a thread samples the RSS every
    2 ms; a phase's peak is also exact when the process's peak RSS grew during it (then reached in that phase).

    Args:
        out: Folder for the per-rank JSON files.
        checkpoint: Path the checkpoint is saved to (a file or, for sharded strategies, a folder).
    """

    def __init__(self, out: str, checkpoint: str) -> None:
        self.out, self.checkpoint = Path(out), checkpoint
        self.rows: dict[str, Any] = {}
        self._phase: str | None = None
        self._meter = PeakSampler(observer=self._observe).start()

    def _observe(self, readings: dict[str, int]) -> None:
        """Every sample of the RSS (on the sampling thread): nothing here; a diagnostic subclass looks at what is
        resident at a peak."""

    def _begin(self, phase: str) -> None:
        self._phase = phase
        self._meter.restart()

    def _end(self, trainer: pl.Trainer) -> None:
        self.rows[self._phase] = {"peak": self._meter.peak_bytes() / MIB, "end": rss() / MIB}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rows["baseline"] = rss() / MIB
        self._begin("load")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(trainer)
        self._begin("step")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(trainer)
        if os.environ.get("GYM_SCALE_TRIM") == "1":  # diagnostic: how much of the RSS is freed heap glibc kept
            import ctypes

            status = Path("/proc/self/status").read_text().splitlines()
            self.rows["before_trim"] = [line for line in status if line.startswith(("RssAnon", "RssFile"))]
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            self.rows["after_malloc_trim"] = rss() / MIB
        trainer.strategy.barrier()
        self._begin("save")
        trainer.save_checkpoint(self.checkpoint)
        trainer.strategy.barrier()
        self._end(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._begin("export")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._phase == "export":
            self._end(trainer)


def fit_command(
    folder: Path, strategy: str, run: Path, steps: int, seq: int, precision: str = "bf16-mixed"
) -> list[str]:
    """The real CLI on 2 CPU ranks: ``precision``, packed 1 x ``seq``-token rows, no validation, HF export at the
    end. ``32-true`` trains fp32 weights (``model.torch_dtype``): the bf16 folder would otherwise train in bf16."""
    callback = {
        "class_path": "benchmarks.scale.PhasePeaks",
        "init_args": {"out": str(run / "phases"), "checkpoint": str(run / "checkpoint")},
    }
    return [
        sys.executable, "-m", "gym_lightning", "fit", "--config", str(REPO_ROOT / "configs" / "quickstart.yaml"),
        "--trainer.devices", "2", "--trainer.strategy", strategy, "--trainer.precision", precision,
        "--trainer.max_steps", str(steps), "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(run),
        f"--trainer.callbacks+={json.dumps(callback)}",
        "--model.model", str(folder), "--model.config_overrides", "null", "--model.val_exact_match", "false",
        "--model.lr", "1e-5", "--model.scheduler", "constant",
        "--data.packing", "true", "--data.max_seq_length", str(seq), "--data.batch_size", "1",
        "--data.mask_prompt", "false",  # rows of a few tokens: the prompt would leave no target
        "--export.output_dir", str(run / "hf"), "--export.max_shard_size", "500MB",
        *(["--model.torch_dtype", "float32"] if precision == "32-true" else []),
    ]  # fmt: skip


def run_one(workdir: Path, size: str, strategy: str, steps: int, seq: int, precision: str) -> dict[str, Any]:
    """One CLI run; returns ``{"ranks": [rank0 rows, rank1 rows], "seconds": ...}`` and deletes its outputs."""
    name = f"{size}-{strategy}"
    command = fit_command(folder_of(workdir, size), strategy, workdir / "runs" / name, steps, seq, precision)
    return {**run_cli(workdir, name, command, steps, seq), "precision": precision}


def run_cli(workdir: Path, name: str, command: list[str], steps: int, seq: int) -> dict[str, Any]:
    """Run ``command``, a CLI fit whose ``PhasePeaks`` write under ``workdir/runs/<name>``; its log goes to
    ``workdir/<name>.log``, its outputs are deleted. Returns the ranks' rows, or ``{"failed": rc}``."""
    import time

    run = workdir / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (workdir / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"{name} failed (rc {done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        shutil.rmtree(run, ignore_errors=True)
        return {"failed": done.returncode, "seconds": seconds}
    ranks = [json.loads((run / "phases" / f"rank{r}.json").read_text()) for r in (0, 1)]
    shutil.rmtree(run, ignore_errors=True)
    return {"ranks": ranks, "seconds": seconds, "seq": seq, "steps": steps}


PLANNER_KEYS = {"gym_ddp": "ddp", "gym_fsdp": "fsdp_full", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}


def planner_setup(folder: Path, baseline_mib: float, seq: int, precision: str = "bf16-mixed") -> Any:
    """The planner's settings for these runs: 2 CPU ranks, 1 x ``seq`` tokens, ``precision``, the folder's largest
    file, and the measured baseline of a rank (RSS before ``configure_model``) as the process overhead."""
    from gym_lightning.planner import Setup

    largest_file = max(f.stat().st_size for f in folder.glob("*.safetensors"))
    return Setup(gpus_per_node=2, accelerator="cpu", micro_batch_size=1, seq_length=seq, precision=precision,
                 host_process_overhead=int(baseline_mib * MIB), checkpoint_file_bytes=largest_file)  # fmt: skip


def theory_bytes(shape: Any, strategy_key: str, setup: Any, phase: str) -> float:
    """The reference the sharded strategies are held to (within 1.1x): baseline process + the strategy's model states
    per rank + one decoder layer in fp32 + one checkpoint file; the training step also holds its activations and one
    chunk of logits ("sharded states + one or two gathered layers + activations")."""
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY, activation_bytes, logits_bytes, model_states

    states = model_states(shape, STRATEGY_BY_KEY[strategy_key], setup)
    total = setup.host_process_overhead + states.total + states.host + 4 * shape.layer_params()
    total += setup.checkpoint_file_bytes
    if phase == "step":
        total += activation_bytes(shape, setup, 1) + logits_bytes(shape, setup, 1)
    return total


def render(results: dict[str, Any], workdir: Path) -> str:
    """The markdown section: one row per size, strategy and phase."""
    from gym_lightning.planner import resolve_shape
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY
    from gym_lightning.planner.phases import phase_peaks

    lines = [
        SECTION, "",
        "`python -m benchmarks.scale` (2 CPU ranks, `bf16-mixed`, 1 x 4 packed tokens, 2 optimizer steps, the real "
        "CLI; see the script's docstring). Peak resident memory per rank in each phase, MiB (rank 0 / rank 1); "
        "planner = `gym_lightning.planner.phase_peaks` with the measured baseline; theory = baseline + model states "
        "per rank + one decoder layer (fp32) + one checkpoint file (+ activations and one logits chunk in the step).",
        "",
        "| model | strategy | phase | measured (r0 / r1) | planner | planner error | theory | measured / theory |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for key, result in results.items():
        size, strategy = key.split("/")
        if "ranks" not in result:
            lines.append(f"| {size} | {strategy} | — | failed (exit {result['failed']}) | | | | |")
            continue
        folder = folder_of(workdir, size)
        shape = resolve_shape(str(folder))
        precision = result.get("precision", "bf16-mixed")
        setup = planner_setup(folder, max(r["baseline"] for r in result["ranks"]), result["seq"], precision)
        planned = phase_peaks(shape, STRATEGY_BY_KEY[PLANNER_KEYS[strategy]], setup).by_phase()
        for phase in PHASES:
            peaks = [r[phase]["peak"] for r in result["ranks"] if phase in r]
            if not peaks:
                continue
            plan = planned[phase].host / MIB
            theory = theory_bytes(shape, PLANNER_KEYS[strategy], setup, phase) / MIB
            error = max(abs(p - plan) / p for p in peaks)
            lines.append(
                f"| {size} | {strategy} | {phase} | {' / '.join(f'{p:,.0f}' for p in peaks)} | {plan:,.0f} | "
                f"{error:.1%} | {theory:,.0f} | {max(peaks) / theory:.2f} |"
            )
    return "\n".join(lines) + "\n"


def write_docs(section: str) -> None:
    """Replace (or append) this script's section of docs/benchmarks.md, leaving the others as they are."""
    DOCS.write_text(replace_section(DOCS.read_text() if DOCS.exists() else "", SECTION, section))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # long-44m is long_sequence_peak.py's model (its rows of thousands of tokens are that script's runs).
    parser.add_argument("--sizes", nargs="+", default=["250m", "1b", "moe-400m"], choices=list(SIZES))
    parser.add_argument("--strategies", nargs="+", default=None, help="default: every strategy that fits the size")
    parser.add_argument("--steps", type=int, default=2)
    # 4 tokens, not 128: on this AVX2-only CPU a bf16 matmul whose second operand is not transposed (the input
    # gradient of every Linear in backward) takes a slow path, 27-33 s for 128 x 5632 @ 5632 x 2048 against 0.6 s
    # with the transposed layout (measured); 128 tokens put one 1B training step above an hour. Activations are
    # in the planner's figures at whatever length runs.
    parser.add_argument("--seq", type=int, default=4, help="tokens per packed row (micro-batch 1)")
    parser.add_argument("--precision", default="bf16-mixed", help="trainer.precision (32-true for 246m-untied)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-scale")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from earlier results")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    results_file = args.workdir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for size in [] if args.render_only else args.sizes:
        ensure_folder(args.workdir, size)
        for strategy in args.strategies or STRATEGIES[size]:
            print(f"{size} {strategy} ...", file=sys.stderr, flush=True)
            results[f"{size}/{strategy}"] = run_one(args.workdir, size, strategy, args.steps, args.seq, args.precision)
            results_file.write_text(json.dumps(results, indent=1))
    section = render(results, args.workdir)
    print(section)
    if args.write_docs:
        write_docs(section)


if __name__ == "__main__":
    main()
