"""gym_lightning against what users would pick instead, side by side in one run, as ratios; writes docs/benchmarks.md.

    python -m benchmarks.run --quick      # the short pass (~6 min on 2 idle cores, ~8 at load 7); docs/benchmarks.md
    python -m benchmarks.run              # the full pass (about 55 minutes): more repeats, steps and model sizes
    python -m benchmarks.run --sections zero fsdp --out /tmp/b.md   # a subset (this script's other sections of
                                                                     # an existing --out are kept as they were)

The verdict runs: three separate full passes of the same code on a quiet machine, each to its own file,
then compare the verdict column (✅ / ❌ / ≈) of sections 1 and 2-3 across the three:

    for i in 1 2 3; do python -m benchmarks.run --sections fit zero fsdp overhead --out /tmp/verdict$i.md; done

Sections (each wrapper/peer comparison runs both sides in one run, stepping alternately; scaling runs interleave):

1. ``fit``: ``Trainer.fit`` vs a plain PyTorch loop, 1 process (benchmarks/fit_vs_plain.py's functions).
2. ``zero``: ``ZeROStrategy`` stage 1/2/3 vs DeepSpeed's engine in a minimal loop, same JSON config, 2 ranks.
3. ``fsdp``: ``GymFSDPStrategy`` vs a plain FSDP2 loop (``fully_shard`` per decoder layer + root), 2 ranks.
   (``gym_ddp`` vs a plain DDP loop rides along in the same job.)
4. ``ddp``: DDP scaling, 2 ranks x 1 thread vs 1 rank x 1 thread, and the share of step time spent communicating.
5. ``memory``: per-rank memory of every strategy (MemoryCallback) next to the planner's prediction.
6. ``overhead``: the overhead budget, every per-step cost the wrappers add (benchmarks/overhead.py); with ``fsdp``
   and ``zero`` in the same pass it also shows each wrapper's measured gap to its plain loop.

Ratios come from per-step timings (rank 0's clock, every timed step of every repeat): the median over steps of the
peer's step time over gym_lightning's at the same step (the two sides step alternately), with a 95% hierarchical
bootstrap interval; the verdict is read from the interval
(``verdict``: ✅ lower bound >= target, ❌ upper bound < target, ≈ undecided), not from the median alone.

2-rank jobs run benchmarks/workers/dist_bench.py under torchrun on a free port with ``OMP_NUM_THREADS=1``. The GPU
section is rendered from ``--gpu-results`` (written by benchmarks/gpu.sh; ``benchmarks.gpu_results``) when the
folder holds results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common.docs import replace_section
from benchmarks.common.launch import child_env, torchrun_command
from benchmarks.common.paths import DOCS, REPO_ROOT
from benchmarks.common.ratios import BOOTSTRAP_SAMPLES, CONFIDENCE, speed_ratio, verdict
from benchmarks.gpu_results import DEFAULT_DIR as GPU_RESULTS_DIR
from benchmarks.gpu_results import gpu_section
from gym_lightning.callbacks.reports import markdown_table

SECTIONS = ("fit", "zero", "fsdp", "ddp", "memory", "overhead")
TARGET = 0.95  # wrapper / peer at the small step (where a fixed per-step cost weighs most)
LARGE_TARGET = 0.97  # wrapper / peer at the 4x larger step
DDP_TARGET = 0.9
DEFAULT_GPU_RESULTS = GPU_RESULTS_DIR / "results.json"


@dataclass(frozen=True)
class Settings:
    """How long each section runs; ``--quick`` picks the small column."""

    repeats: int
    # Section 1's runs are short (about 10 s each): its interval at batch 64 sat 0.000-0.006 above the target with 5
    # (three passes of 1 Dec 2026), so it gets twice the repeats rather than steps (120 + 20 fill the epoch).
    fit_repeats: int
    fit_steps: int
    fit_warmup: int
    strategy_steps: int
    strategy_warmup: int
    strategy_model: dict[str, int]
    strategy_batch: tuple[int, int]
    # A second, 4x larger step (batch, timed steps): the wrappers' fixed per-step cost against a bigger step.
    strategy_large: tuple[int, int] | None
    ddp_sizes: tuple[tuple[int, int, int], ...]  # (hidden, layers, batch per rank)
    ddp_batch: tuple[int, int]
    ddp_steps: int
    ddp_warmup: int
    memory_steps: int
    memory_warmup: int


QUICK = Settings(
    repeats=3,
    fit_repeats=3,
    fit_steps=50,
    fit_warmup=10,
    strategy_steps=10,
    strategy_warmup=3,
    strategy_model={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4},
    strategy_batch=(4, 64),
    strategy_large=None,
    ddp_sizes=((128, 2, 4), (512, 4, 4)),
    ddp_batch=(4, 128),
    ddp_steps=6,
    ddp_warmup=2,
    memory_steps=3,
    memory_warmup=1,
)
FULL = Settings(
    repeats=5,
    fit_repeats=10,
    fit_steps=120,
    fit_warmup=20,
    # 80 and 48 timed steps: with 30 and 24, three passes of the same code (1 Dec 2026) left the 95 % interval
    # straddling the target in 1-2 of 3 runs for fsdp at the small step and ZeRO-2/3 at the larger one (half-widths
    # 1.3-4.1 %); pooling two of those passes (twice the steps) decided all but one of those nine cells. With 40 and
    # 48, 35 of 36 cells were decided; the small step's half-widths (1.3-2.8 %, the per-step ratio's sd ~10 %) still
    # left fsdp there once at 0.970 [0.943, 0.996], so it gets twice the steps: sqrt(2) narrower.
    strategy_steps=80,
    strategy_warmup=5,
    strategy_model={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4},
    strategy_batch=(4, 64),
    strategy_large=(16, 48),
    # Weak scaling: compute and all-reduce bytes both grow with the parameter count, so their ratio is set by the
    # tokens per rank per step (6·Ψ·T FLOPs against ~2·Ψ·4 bytes); hence the two 4x-batch rows.
    ddp_sizes=((128, 2, 4), (256, 4, 4), (512, 4, 4), (768, 6, 4), (256, 4, 16), (512, 4, 16)),
    ddp_batch=(4, 128),
    ddp_steps=10,
    ddp_warmup=3,
    memory_steps=6,
    memory_warmup=2,
)


@dataclass
class Report:
    """Markdown sections collected while the benchmarks run."""

    settings: Settings
    argv: list[str]
    sections: dict[str, str] = field(default_factory=dict)
    # run name -> wrapper minus peer median step (ms, guard off), from the strategy comparison, for the overhead budget
    gaps: dict[str, float] = field(default_factory=dict)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------------- statistics
def summary(values: list[float], digits: int = 0) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def ratio_cell(
    ours: list[list[float]], peer: list[list[float]], target: float | None = TARGET, paired_steps: bool = False
) -> str:
    """``**ratio** [low, high] verdict`` from per-step seconds (``speed_ratio``); no verdict when ``target`` is None."""
    ratio, low, high = speed_ratio(ours, peer, paired_steps=paired_steps)
    mark = "" if target is None else " " + verdict(low, high, target)
    return f"**{ratio:.3f}** [{low:.3f}, {high:.3f}]{mark}"


# ---------------------------------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    import deepspeed
    import lightning
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
    }


def machine_section(report: Report) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    vers = ", ".join(f"{name} {value}" for name, value in versions().items())
    load = " / ".join(f"{x:.2f}" for x in report.load_before)
    load_end = " / ".join(f"{x:.2f}" for x in report.load_after)
    return (
        f"- CPU: {cpu_model()}, {cores} cores usable by this process ({os.cpu_count()} online), "
        f"{platform.system()} {platform.release()}\n- Software: {vers}\n"
        f"- Load average (1/5/15 min) at start: {load}; at end: {load_end}. The cores are shared with other jobs: "
        "absolute figures are noisy, the ratios (both sides in the same job, repeats interleaved) are what counts.\n"
        f"- Command: `{' '.join(shlex.quote(a) for a in report.argv)}` (took {report.seconds / 60:.1f} min)"
    )


# ---------------------------------------------------------------------------------------------------- 1. fit
def fit_workloads(settings: Settings) -> list[tuple[int, int, int, float]]:
    """(batch, timed steps, warm-up steps, target) of each step size compared; the full pass adds a 4x larger step."""
    workloads = [(64, settings.fit_steps, settings.fit_warmup, TARGET)]
    if settings.strategy_large is not None:
        workloads.append((256, 25, 5, LARGE_TARGET))  # 35 batches of 256 per epoch of the addition set
    return workloads


def fit_pair(
    settings: Settings, batch: int, steps: int, warmup: int, logdir: str
) -> tuple[list[list[float]], list[list[float]], int]:
    """Per-step seconds of the plain loop and of Trainer.fit (one list per repeat: ``settings.fit_repeats`` runs, each
    stepping both sides alternately, see fit_vs_plain.InterleavedSteps), and the non-padding tokens of the
    timed steps."""
    import lightning.pytorch as pl

    from benchmarks.fit_vs_plain import make_datamodule, paired_run, timed_tokens
    from gym_lightning.models.loading import build_causal_lm

    args = argparse.Namespace(dataset="addition", batch_size=batch, seed=42, model="tiny-llama")
    pl.seed_everything(args.seed, verbose=False)
    init, dm = build_causal_lm(args.model), make_datamodule(args)
    tokens, fingerprint = timed_tokens(dm, warmup, steps)
    plain, fit = [], []
    for _ in range(settings.fit_repeats):
        plain_seconds, fit_seconds = paired_run(init, dm, warmup, steps, logdir, fingerprint)
        plain.append(plain_seconds)
        fit.append(fit_seconds)
    return plain, fit, tokens


def fit_section(settings: Settings) -> str:
    """Trainer.fit vs the plain loop of benchmarks/fit_vs_plain.py, stepping alternately, in this process."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    rows, runs = [], []
    with tempfile.TemporaryDirectory() as logdir:
        for batch, steps, warmup, target in fit_workloads(settings):
            plain, fit, tokens = fit_pair(settings, batch, steps, warmup, logdir)
            plain_tps, fit_tps = ([tokens / sum(r) for r in side] for side in (plain, fit))
            rows.append(
                [
                    f"batch {batch} (>= {target})",
                    summary(plain_tps),
                    summary(fit_tps),
                    ratio_cell(fit, plain, target, paired_steps=True),
                ]
            )
            runs.append(f"batch {batch}: {steps} timed steps after {warmup} warm-up steps")
    header = ["step (target)", "plain PyTorch loop, tokens/s", "`Trainer.fit`, tokens/s", RATIO_HEADER]
    return (
        f"tiny-llama preset (0.49M parameters), `addition` data ({'; '.join(runs)}), {settings.fit_repeats} "
        "runs, 1 process x 1 thread; in each run the two sides step alternately (one plain step just before each even "
        "fit step and just after each odd one, `fit_vs_plain.InterleavedSteps`), and the bootstrap draws step k "
        "of both sides together. Both sides: same initial weights, same collated batches in the "
        "same order, same AdamW (the module's fused kernel, same groups) and schedule. fit: no validation/"
        "checkpointing, progress bar and CSV logging every 50 steps, `self.log` of the loss every step; no "
        "non-finite guard (the plain loop checks nothing; the overhead budget gives the guard's cost as its own "
        "lines, measured on 2 ranks; on 1 process its flag reduction is a no-op).\n\n"
        + markdown_table(header, rows)
        + "\n\n"
        + RATIO_NOTE
    )


# ---------------------------------------------------------------------------------------------------- 2-4. torchrun
def torchrun(spec: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """Run benchmarks/workers/dist_bench.py on 2 ranks; rank 0's results, one dict per run."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.jsonl").unlink(missing_ok=True)  # the worker appends: a kept folder may hold a former job's
    (workdir / "spec.json").write_text(json.dumps({**spec, "out": str(workdir)}))
    cmd = torchrun_command(2, "benchmarks.workers.dist_bench", workdir / "spec.json")
    done = subprocess.run(cmd, env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]


def zero_config(stage: int, micro_batch: int) -> dict[str, Any]:
    """The JSON config both ZeRO sides get (ZeROStrategy's own defaults for the stage, written out)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": stage >= 2,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 200_000_000,
            "reduce_bucket_size": 200_000_000,
        },
    }


PAIRS: dict[str, tuple[str, str]] = {
    # name: (gym_lightning side, the peer), as dist_bench.py kinds
    "zero1": ("gym_zero", "ds_engine"),
    "zero2": ("gym_zero", "ds_engine"),
    "zero3": ("gym_zero", "ds_engine"),
    "fsdp": ("gym_fsdp", "fsdp2"),
    "ddp": ("gym_ddp", "ddp"),
}


def strategy_workloads(settings: Settings) -> list[tuple[str, int, int]]:
    """(suffix of the run name, batch per rank, timed steps) of each step size compared."""
    workloads = [("", settings.strategy_batch[0], settings.strategy_steps)]
    if settings.strategy_large is not None:
        workloads.append((f"@{settings.strategy_large[0]}", *settings.strategy_large))
    return workloads


def strategy_runs(settings: Settings, names: list[str]) -> list[dict[str, Any]]:
    seq = settings.strategy_batch[1]
    runs = []
    for _ in range(settings.repeats):
        for suffix, batch, steps in strategy_workloads(settings):
            base = {"batch_size": batch, "seq_len": seq, "steps": steps}
            base |= {"warmup": settings.strategy_warmup, "overrides": settings.strategy_model}
            for name in names:
                gym, peer = PAIRS[name]
                run = {**base, "name": name + suffix, "kind": gym, "peer": peer}  # one run, steps interleaved
                if name.startswith("zero"):
                    run["ds_config"] = zero_config(int(name[-1]), batch)
                runs.append(run)
    return runs


def tokens_per_sec(results: list[dict[str, Any]], name: str, kind: str) -> list[float]:
    return [r["tokens"] / r["seconds"] for r in results if r["name"] == name and r["kind"] == kind]


def step_seconds(results: list[dict[str, Any]], name: str, kind: str) -> list[list[float]]:
    """Per-step seconds of every repeat of one side (rank 0's clock)."""
    return [r["step_seconds"] for r in results if r["name"] == name and r["kind"] == kind]


def median_step(repeats: list[list[float]]) -> float:
    """Median over every step of every repeat."""
    return statistics.median(seconds for steps in repeats for seconds in steps)


RATIO_HEADER = f"ratio [{CONFIDENCE:.0%} interval] verdict"
RATIO_NOTE = (
    "Ratio: the median, over every timed step of every repeat, of the peer's step time / gym_lightning's step time "
    "at the same step (step k of both sides ran back to back; = tokens/s ratio: both sides run the same tokens per "
    f"step), with a {CONFIDENCE:.0%} hierarchical bootstrap interval ({BOOTSTRAP_SAMPLES} samples: repeats drawn "
    "with replacement, then step pairs within them). A slowdown that hits both steps of a pair cancels in its ratio. "
    "Verdict: ✅ when the interval's lower bound reaches the target, ❌ when its upper bound is below it, ≈ when the "
    "interval straddles it (undecided at this noise: not a pass). Three runs of the same code can only disagree ✅ "
    "against ❌ when an interval misses the true ratio."
)


def strategy_sections(settings: Settings, names: list[str], workdir: Path, gaps: dict[str, float]) -> dict[str, str]:
    """The comparison table; fills ``gaps`` (run name -> wrapper minus peer median step, ms) for the overhead budget."""
    results = torchrun({"runs": strategy_runs(settings, names)}, workdir, timeout=3600)
    labels = {"gym_zero": "`ZeROStrategy`", "ds_engine": "DeepSpeed engine loop", "gym_fsdp": "`GymFSDPStrategy`"}
    labels |= {"fsdp2": "plain FSDP2 loop", "gym_ddp": "`GymDDPStrategy`", "ddp": "plain DDP loop"}
    rows = []
    for suffix, batch, _ in strategy_workloads(settings):
        target = LARGE_TARGET if suffix else TARGET
        for name in names:
            ours, peer = (tokens_per_sec(results, name + suffix, kind) for kind in PAIRS[name])
            steps = [step_seconds(results, name + suffix, kind) for kind in PAIRS[name]]
            gaps[name + suffix] = 1000 * (median_step(steps[0]) - median_step(steps[1]))
            rows.append(
                [
                    f"{name}, batch {batch} x {settings.strategy_batch[1]} (>= {target})",
                    f"{labels[PAIRS[name][0]]}: {summary(ours)}",
                    f"{labels[PAIRS[name][1]]}: {summary(peer)}",
                    ratio_cell(*steps, target, paired_steps=True),
                ]
            )
    o = settings.strategy_model
    batch, seq = settings.strategy_batch
    intro = (
        f"2 ranks x 1 thread (gloo), tiny-llama shape with hidden {o['hidden_size']}, {o['num_hidden_layers']} "
        f"layers ({param_count(o) / 1e6:.1f}M parameters), fp32, batch {batch} x {seq} tokens per rank "
        f"({settings.strategy_steps} timed steps){large_text(settings)} after {settings.strategy_warmup} warm-up, "
        f"{settings.repeats} "
        "runs in one torchrun job; in each, `Trainer.fit` with the wrapper and its plain loop step alternately (a "
        "plain step just before each even fit step and just after each odd one, `fit_vs_plain.InterleavedSteps`; the "
        "bootstrap draws step k of both sides together). Same synthetic batches, same AdamW with the same two "
        "parameter groups (matrices / biases and norms); gym_lightning runs `Trainer.fit(CausalLMModule)` (no "
        "validation, no checkpoints, no progress bar, logging every 50 steps). Same mathematics on both sides: the "
        "loss is the step's summed token cross-entropy over the step's target tokens summed over ranks, so every loop "
        "all-reduces the token count once per step (launched before the forward, waited for after it; the HF Trainer's "
        "`num_items_in_batch`), and both use the module's default fused AdamW. The non-finite guard, which the plain "
        "loops lack, is off here; its cost is its own line in the overhead budget below. ZeRO: both sides get the JSON "
        "config below; ZeROStrategy adds `managed_gradient_accumulation: false` and "
        "`engine.backward(scale_wrt_gas=False)`.\n\n"
    )
    header = ["comparison (target)", "gym_lightning, tokens/s median (min-max)", "peer, tokens/s", RATIO_HEADER]
    config = json.dumps(zero_config(3, batch))
    note = "stage 3 shown; stages 1 and 2 differ only in `stage`, and stage 1 has `overlap_comm: false`"
    table = markdown_table(header, rows)
    return {"strategies": intro + table + f"\n\n{RATIO_NOTE}\n\nZeRO config ({note}): `{config}`"}


def overhead_section(settings: Settings, workdir: Path, gaps: dict[str, float]) -> str:
    """benchmarks/overhead.py's per-strategy tables from one probed run per strategy and step size."""
    from benchmarks import overhead

    seq = settings.strategy_batch[1]
    base = {"seq_len": seq, "warmup": settings.strategy_warmup, "overrides": settings.strategy_model}
    kinds = {name: sides[0] for name, sides in PAIRS.items()}
    runs = overhead.probe_runs(strategy_workloads(settings), base, kinds, zero_config)
    load = os.getloadavg()
    results = torchrun({"runs": runs}, workdir, timeout=1800)
    load_end = os.getloadavg()
    text = overhead.render(results, strategy_workloads(settings), seq, gaps)
    loads = f"load average (1 min) {load[0]:.2f} at the start of these runs, {load_end[0]:.2f} at the end"
    return f"{overhead.INTRO} This pass: {loads}.\n\n{text}"


def large_text(settings: Settings) -> str:
    if settings.strategy_large is None:
        return ""
    batch, steps = settings.strategy_large
    return (
        f" and batch {batch} x {settings.strategy_batch[1]} ({steps} timed steps: 4x the tokens per step, so a "
        "fixed per-step cost weighs a quarter as much)"
    )


def ddp_runs(settings: Settings) -> list[dict[str, Any]]:
    seq = settings.ddp_batch[1]
    # step_tokens off: the 1-rank reference has no count to all-reduce; this section measures DDP's gradient traffic.
    base = {"seq_len": seq, "steps": settings.ddp_steps, "warmup": settings.ddp_warmup, "step_tokens": False}
    runs = []
    for repeat in range(settings.repeats):
        for hidden, layers, batch in settings.ddp_sizes:
            overrides = {"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers}
            kinds = ["single", "ddp", "ddp_nosync"]
            for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                name = f"h{hidden}_l{layers}_b{batch}"
                runs.append({**base, "batch_size": batch, "name": name, "kind": kind, "overrides": overrides})
    return runs


def ddp_section(settings: Settings, workdir: Path) -> str:
    results = torchrun({"runs": ddp_runs(settings)}, workdir, timeout=3600)
    rows, efficiencies = [], {}
    for hidden, layers, batch in settings.ddp_sizes:
        name = f"h{hidden}_l{layers}_b{batch}"
        one, two, free = (tokens_per_sec(results, name, kind) for kind in ("single", "ddp", "ddp_nosync"))
        efficiency = [t / (2 * s) for s, t in zip(one, two, strict=True)]
        # Two ranks that never communicate: how far this machine scales at all (shared caches, memory bandwidth,
        # other jobs). DDP's efficiency cannot exceed it; efficiency / ceiling = 1 - comm share is DDP's own part.
        ceiling = [f / (2 * s) for s, f in zip(one, free, strict=True)]
        own = [t / f for t, f in zip(two, free, strict=True)]
        size = param_count({"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers})
        label = f"hidden {hidden}, {layers} layers ({size / 1e6:.1f}M), batch {batch} x {settings.ddp_batch[1]}"
        efficiencies[label] = (statistics.median(efficiency), statistics.median(own))
        verdict = " ✅" if statistics.median(efficiency) >= DDP_TARGET else " ❌"
        rows.append(
            [
                label,
                summary(one),
                summary(two),
                f"**{statistics.median(efficiency):.2f}** ({min(efficiency):.2f}-{max(efficiency):.2f}){verdict}",
                f"{statistics.median(ceiling):.2f} ({min(ceiling):.2f}-{max(ceiling):.2f})",
                f"{statistics.median(own):.2f} ({min(own):.2f}-{max(own):.2f})",
            ]
        )
    intro = (
        "Plain torch loops, the batch per rank given in each row (weak scaling), fp32 AdamW, "
        f"{settings.ddp_steps} timed steps after {settings.ddp_warmup} warm-up, {settings.repeats} repeats "
        "interleaved in one torchrun job. T1: rank 0 alone, no wrapper (rank 1 sleeps); T2: "
        "`DistributedDataParallel` on 2 ranks; efficiency = T2 / (2·T1) on tokens/s. Machine ceiling = "
        "T2(no_sync) / (2·T1), where both ranks train under `no_sync()` (no gradient all-reduce, nothing shared but "
        "the machine): the most any data-parallel scheme can reach here. DDP's own efficiency = T2 / T2(no_sync) = "
        "efficiency / ceiling = 1 - the share of step time the all-reduce adds (what backward does not hide). "
        "On CPU ranks gloo's all-reduce runs on the same cores as the compute, so backward cannot hide it; its share "
        "is set by the tokens per rank per step (compute 6·Ψ·T FLOPs against about 8·Ψ bytes reduced), not by the "
        "model size alone.\n\n"
    )
    header = ["model", "T1 tokens/s (1 rank)", "T2 tokens/s (2 ranks)", "efficiency", "machine ceiling", "DDP's own"]
    return intro + markdown_table(header, rows) + "\n\n" + scaling_verdict(efficiencies)


def scaling_verdict(efficiencies: dict[str, tuple[float, float]]) -> str:
    """Which model size first reaches the efficiency target, and if none does, whether DDP or the machine is why.

    ``efficiencies`` maps a row label to (efficiency, DDP's own efficiency), in table order.
    """
    reached = [name for name, (total, _) in efficiencies.items() if total >= DDP_TARGET]
    if reached:
        return f"First row (table order) reaching efficiency >= {DDP_TARGET} in this run: **{reached[0]}**."
    largest = list(efficiencies)[-1]
    text = (
        f"No size reached efficiency >= {DDP_TARGET} in this run (last row: {largest}, {efficiencies[largest][0]:.2f})."
    )
    own = [name for name, (_, ddp_own) in efficiencies.items() if ddp_own >= DDP_TARGET]
    if own:
        text += (
            f" DDP's own efficiency (communication only) reaches {DDP_TARGET} from **{own[0]}** on: what is missing "
            "is the machine ceiling, i.e. two processes on these 2 cores do not run twice as fast as one even "
            "without communicating (shared memory bandwidth and caches, other jobs on the host); no model size "
            "fixes that."
        )
    else:
        text += f" Even DDP's own efficiency stays below {DDP_TARGET}: the all-reduce is not hidden by backward."
    return text


def param_count(overrides: dict[str, int]) -> int:
    """Parameters of the tiny-llama preset with ``overrides`` (built on the meta device: no memory, no init)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gym_lightning.models.loading import load_model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_model_config("tiny-llama", overrides, False))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- 5. memory
PLANNER_KEYS = {"gym_ddp": "ddp", "gym_fsdp": "fsdp_full", "zero3_persist0": "zero3"}


def predicted(name: str) -> Any:
    """The planner's estimate for strategies_table.py's run: tiny-llama, 2 ranks, fp32 AdamW, batch 16 x 32."""
    from gym_lightning.planner import STRATEGIES, Setup, estimate, resolve_shape

    threshold = 0 if name == "zero3_persist0" else None  # None: ZeROStrategy's rule
    setup = Setup(
        gpus_per_node=2,
        precision="32-true",
        micro_batch_size=16,
        seq_length=32,
        zero3_param_persistence_threshold=threshold,
    )
    strategy = next(s for s in STRATEGIES if s.key == PLANNER_KEYS.get(name, name))
    return estimate(resolve_shape("tiny-llama"), strategy, setup)


def memory_section(settings: Settings, workdir: Path) -> str:
    from benchmarks import strategies_table as st
    from gym_lightning.callbacks.reports import format_bytes

    results = {}
    for name in st.STRATEGIES:
        print(f"  memory: {name}", file=sys.stderr, flush=True)
        results[name] = st.launch(name, workdir / name, settings.memory_steps, settings.memory_warmup)
    rows = []
    for name, (_, memory) in results.items():
        got = {c: st._max_rank(memory, c) for c in st.MEMORY_COLUMNS}
        plan = predicted(name)
        states = got["params"] + got["grads"] + got["master_params"] + got["optimizer_state"]
        cells = [(got["params"], plan.params), (got["grads"], plan.grads)]
        cells += [(got["master_params"] + got["optimizer_state"], plan.optimizer_state), (states, plan.model_states)]
        row = [st.LABELS.get(name, name)]
        row += [
            f"{format_bytes(m)} / {format_bytes(p)} ({m / p:.2f})" if p else f"{format_bytes(m)} / 0" for m, p in cells
        ]
        row.append(f"{format_bytes(got['comm_buffers'])} / {format_bytes(plan.buffers)}")
        rows.append(row)
    header = ["strategy", "params", "grads", "master + optimizer", "model states", "comm buffers"]
    return (
        "Measured by `MemoryCallback` (largest rank, around the last optimizer step) / predicted by "
        "`gym_lightning.planner` (`Setup(gpus_per_node=2, precision='32-true', micro_batch_size=16, "
        "seq_length=32)`), (measured / predicted). Runs: `benchmarks/strategies_table.py` (tiny-llama, 2 CPU "
        f"ranks, `addition`, batch 16 x 32, {settings.memory_steps} steps); the planner's `zero3` for "
        "`zero3 (persist 0)` uses `zero3_param_persistence_threshold=0`.\n\n" + markdown_table(header, rows)
    )


# ---------------------------------------------------------------------------------------------------- document
def document(report: Report, kept: dict[str, str] | None = None) -> str:
    """The markdown of this pass; ``kept`` (title -> body, ``previous_own_sections``) fills the sections of this
    script that the pass did not run, as an earlier pass wrote them, in their usual place."""
    s, kept, parts = report.sections, kept or {}, ["# Benchmarks", ""]
    parts.append(
        "Generated by `python -m benchmarks.run`; do not edit by hand. Every comparison runs gym_lightning and the "
        "peer side by side in one run, stepping alternately; figures are medians with (min-max) over repeats, ratios "
        f"are gym_lightning / peer (targets: >= {TARGET} for the wrappers at the small step, >= {LARGE_TARGET} at "
        f"the larger one, DDP efficiency >= {DDP_TARGET})."
    )
    machine = machine_section(report)
    earlier = [title for key, title in TITLES.items() if key not in s and title in kept]
    if earlier:
        machine += "\n- Sections not run by this command, kept as an earlier pass wrote them: " + "; ".join(earlier)
    parts += ["", "## Machine", "", machine]
    for key, title in TITLES.items():
        if key in s:
            parts += ["", f"## {title}", "", s[key]]
        elif title in kept:
            parts += ["", f"## {title}", "", kept[title]]
    return "\n".join(parts) + "\n"


def previous_own_sections(previous: str) -> dict[str, str]:
    """This script's ``## `` sections of the previous document (title -> body), Machine excepted."""
    own, kept = set(TITLES.values()), {}
    for chunk in previous.split("\n## ")[1:]:
        head, _, body = chunk.partition("\n")
        if head.strip() in own:
            kept[head.strip()] = body.strip("\n")
    return kept


TITLES = {
    "fit": "1. `Trainer.fit` vs a plain PyTorch loop (1 process)",
    "strategies": "2-3. ZeRO, FSDP (and DDP) strategies vs their plain loops (2 ranks)",
    "overhead": "Overhead budget: what each wrapper adds per optimizer step (2 ranks)",
    "ddp": "4. DDP scaling on this machine",
    "memory": "5. Per-rank memory: measured vs the planner",
    "gpu": "GPU: checks and the Qwen3-1.7B shape on 1 x H200 vs a plain loop, the HF Trainer and Lightning's built-ins",
}


def updated_document(previous: str, report: Report) -> str:
    """``previous`` with this script's sections (Machine and ``TITLES``) replaced in place by this pass's, every other
    line (the introduction, the summary of claims, the sections other scripts or people wrote) kept where it is; a new
    document (``document``) when there is no previous one."""
    if not previous.strip():
        return document(report)
    fresh = document(report, previous_own_sections(previous))
    for chunk in fresh.split("\n## ")[1:]:
        previous = replace_section(previous, "## " + chunk.split("\n", 1)[0], "## " + chunk)
    return previous


def run_sections(report: Report, sections: list[str], gpu_results: Path, keep: Path | None = None) -> None:
    """Run the chosen sections into ``report``; ``keep``: the torchrun jobs' folders (spec.json, the per-step
    results.jsonl) go there and stay, to look at the raw timings later (default: a temporary folder)."""
    settings = report.settings
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        if "fit" in sections:
            print("section fit ...", file=sys.stderr, flush=True)
            report.sections["fit"] = fit_section(settings)
        names = [
            n for n in PAIRS if (n.startswith("zero") and "zero" in sections) or (n == "fsdp" and "fsdp" in sections)
        ]
        if "fsdp" in sections:
            names.append("ddp")
        if names:
            print(f"section strategies {names} ...", file=sys.stderr, flush=True)
            report.sections.update(strategy_sections(settings, names, Path(tmp) / "strategies", report.gaps))
        if "overhead" in sections:
            print("section overhead ...", file=sys.stderr, flush=True)
            report.sections["overhead"] = overhead_section(settings, Path(tmp) / "overhead", report.gaps)
        if "ddp" in sections:
            print("section ddp ...", file=sys.stderr, flush=True)
            report.sections["ddp"] = ddp_section(settings, Path(tmp) / "ddp")
        if "memory" in sections:
            print("section memory ...", file=sys.stderr, flush=True)
            report.sections["memory"] = memory_section(settings, Path(tmp) / "memory")
    report.sections["gpu"] = gpu_section(gpu_results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the short pass (~6 min on 2 idle cores)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=[*SECTIONS, "gpu"])
    parser.add_argument("--repeats", type=int, help="interleaved repeats per comparison (default: 3 quick, 5 full)")
    parser.add_argument("--out", type=Path, default=DOCS, help="markdown to write")
    parser.add_argument("--gpu-results", type=Path, default=DEFAULT_GPU_RESULTS, help="benchmarks/gpu.sh output")
    parser.add_argument("--keep", type=Path, help="keep the 2-rank jobs' per-step timings (results.jsonl) here")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.repeats is not None:
        settings = Settings(**{**settings.__dict__, "repeats": args.repeats, "fit_repeats": args.repeats})
    report = Report(settings, ["python", "-m", "benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    report.load_before = os.getloadavg()
    start = time.perf_counter()
    run_sections(report, args.sections, args.gpu_results, args.keep)
    report.seconds, report.load_after = time.perf_counter() - start, os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(updated_document(previous, report))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
