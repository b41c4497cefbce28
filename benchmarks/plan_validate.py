"""Calibrate the planner's step-time model on this CPU, then validate it against measured 2-rank CPU runs over gloo.

    python -m benchmarks.plan_validate --out /tmp/plan_validate.md           # ~10 min on a 2-core CPU
    python -m benchmarks.plan_validate --sizes 10m --batches 1x256 --strategies gym_ddp   # a smoke run

1. **Calibration** (this process, one thread: each of the 2 ranks gets one core of this 2-core machine): the matmul
   FLOP/s of each model's width (``metrics.calibrate.matmul_flops``, fp32) and a plain PyTorch loop (forward, summed
   cross-entropy, backward, torch AdamW, no Lightning) of ONE reference size and batch (``--reference``). The CPU
   kernel efficiency is what makes the model's one-rank step (``planner.compute``'s roofline on the measured matmul
   rate and memory bandwidth, + the optimizer step) last the measured step (``planner.compute.calibrated_efficiency``).
2. **gloo and memory**: 2 processes measure ``all_reduce_figures`` and ``memory_bandwidth`` at the same time (what
   the ranks see while training together).
3. **Measured runs**: the real CLI on 2 CPU ranks (``python -m gym_lightning fit``, ``32-true``, the tiny-llama
   preset widened with ``--model.config_overrides``, packed rows of the bundled addition set), one per size, batch
   shape and strategy. :class:`StepTimer` (a callback) times each optimizer step from the end of one to the end of
   the next after a barrier; the median of the timed steps after ``--warmup`` is the measured step.
4. **Prediction**: ``planner.timing.speed`` with the run's ``RunSpec`` and ``planner.machines.cpu_hardware`` of the
   figures above; error = predicted / measured - 1. A markdown table goes to stdout and ``--out``, the raw figures
   to ``--out`` with ``.json``.
5. **ZeRO-3's hooks** (``--hooks``): a 12-layer, 256-wide model under ZeRO-3 with and without decoder-layer leaves,
   alternated ``--repeats`` times; a fetch's host seconds are the step's difference, less the model's difference in
   collective latency, over the difference in fetches (``families.zero.ZeRO.fetched_modules``, both passes).

Precision is ``32-true`` throughout: on AVX2-class CPUs a bf16 matmul whose second operand is not transposed takes a
slow path (benchmarks/scale.py measured 27-33 s against 0.6 s), which no FLOP count would predict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from benchmarks.common.docs import replace_section
from benchmarks.common.launch import spawn_gloo
from benchmarks.common.paths import PLANNER_DOC, REPO_ROOT
from benchmarks.common.records import measured_or_saved

MIB = 2**20
# Llama decoders on the shipped 512-token vocabulary (tiny-llama's, so the embedding is < 1 % of the model):
# layer parameters ~ 4h^2 (attention, 1 key/value head per query head) + 3hi (SwiGLU, i = 3h) = 13h^2.
SIZES: dict[str, dict[str, int]] = {
    "9m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 3, "num_attention_heads": 8},
    "26m": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 4, "num_attention_heads": 12},
    "47m": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 16},
    # Many small modules, little compute: what ZeRO-3's per-module hooks cost (--hooks).
    "hooks": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 12, "num_attention_heads": 4},
}
# Batch shapes: micro-batch x sequence length, "a2" = accumulate_grad_batches 2. 256 tokens per rank and step: the
# 47m model's step takes ~3 s per rank on one busy core, and 24 runs of ~25 s start-up each must fit ~15 minutes.
BATCHES = ("1x256", "2x64a2")
STRATEGIES = ("gym_ddp", "gym_fsdp", "zero2", "zero3")
# ZeRO-3 with decoder-layer leaves (gym's rule) and without (a hook on every submodule), for --hooks.
HOOK_RUNS = {
    "zero3": "zero3",
    "zero3_modules": json.dumps(
        {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": {"stage": 3, "leaf_decoder_layers": False}}
    ),
}
HOOK_BATCH = "1x128"
PLANNER_KEYS = {"gym_ddp": "ddp", "gym_fsdp": "fsdp_full", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}


def overrides(size: str) -> dict[str, Any]:
    """``config_overrides`` of the tiny-llama preset for ``size`` (key/value heads = query heads)."""
    fields = SIZES[size]
    return {**fields, "num_key_value_heads": fields["num_attention_heads"], "max_position_embeddings": 1024}


def parse_batch(batch: str) -> tuple[int, int, int]:
    """``(micro_batch, seq_length, accumulate_grad_batches)`` of ``"2x128a2"``."""
    shape, _, accumulate = batch.partition("a")
    micro, seq = shape.split("x")
    return int(micro), int(seq), int(accumulate or 1)


def shape_of(size: str) -> Any:
    """The planner's ModelShape of ``size`` (the preset's config with the overrides)."""
    from gym_lightning.models.loading import load_model_config
    from gym_lightning.models.shapes import shape_from_config

    return shape_from_config(load_model_config("tiny-llama", overrides(size), False).to_dict(), f"tiny-llama {size}")


# ---------------------------------------------------------------------------------------------------------------
# 1. calibration (one process)


def plain_loop(size: str, batch: str, warmup: int, steps: int) -> dict[str, float]:
    """Median seconds of a plain training step of ``size`` at ``batch`` (one thread): forward + summed cross-entropy
    + backward, and the module's AdamW step (``build_optimizer("adamw_torch_fused")``: fused where the CPU has the
    kernel, as in the measured runs) timed apart.

    Args:
        size: A key of :data:`SIZES`.
        batch: A batch shape (``"1x256"``; accumulation is not used here).
        warmup: Untimed steps first.
        steps: Timed steps.
    """
    import torch

    from gym_lightning.loss import summed_cross_entropy
    from gym_lightning.models.loading import build_causal_lm
    from gym_lightning.optim import build_optimizer, weight_decay_groups

    micro, seq, _ = parse_batch(batch)
    torch.manual_seed(0)
    model = build_causal_lm("tiny-llama", config_overrides=overrides(size)).train()
    groups = weight_decay_groups(model.named_parameters(), 0.0)
    optimizer = build_optimizer("adamw_torch_fused", groups, lr=1e-5, betas=(0.9, 0.999), eps=1e-8)
    ids = torch.randint(0, model.config.vocab_size, (micro, seq))
    compute, step = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        (summed_cross_entropy(logits, ids) / ids.numel()).backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            compute.append(middle - start)
            step.append(time.perf_counter() - middle)
    return {"compute": statistics.median(compute), "optimizer": statistics.median(step)}


def calibrate(reference: str, sizes: list[str]) -> dict[str, Any]:
    """Matmul FLOP/s of every size's MLP shape, memory bandwidth alone, and the plain loop at ``reference`` (one
    thread); returns them with the compute efficiency."""
    import torch

    from gym_lightning.metrics.calibrate import memory_bandwidth, model_matmul_flops
    from gym_lightning.planner import RunSpec
    from gym_lightning.planner.compute import calibrated_efficiency, flops_per_token
    from gym_lightning.planner.machines import cpu_hardware
    from gym_lightning.planner.timing import PLAIN, step_time

    torch.set_num_threads(1)
    size, batch = reference.split("/")
    micro, seq, _ = parse_batch(batch)
    # The shape the callback's check measures too (metrics.calibrate.measure_host): an MLP projection of the width.
    matmul = {s: model_matmul_flops(SIZES[s]["hidden_size"], torch.float32) for s in sizes}
    bandwidth = memory_bandwidth(repeats=9, budget=1.0)
    loop = plain_loop(size, batch, warmup=2, steps=5)
    shape, setup = shape_of(size), RunSpec(accelerator="cpu", gpus_per_node=1, precision="32-true",
                                           micro_batch_size=micro, seq_length=seq)  # fmt: skip
    step_flops = micro * seq * flops_per_token(shape, setup).model
    peak = matmul[size]
    ideal = step_time(shape, PLAIN, setup, cpu_hardware(peak, bandwidth, 0.0, 0.0, 1.0))
    optimizer = ideal.optimizer
    measured = loop["compute"] + loop["optimizer"]
    return {
        "reference": reference,
        "matmul_flops": matmul,
        "memory_bandwidth_alone": bandwidth,
        "plain_loop": loop,
        "plain_loop_flops": step_flops / loop["compute"],
        "optimizer_predicted": optimizer,
        "efficiency_raw": step_flops / (loop["compute"] + loop["optimizer"]) / peak,
        "efficiency": calibrated_efficiency(ideal.total, measured, optimizer),
    }


# ---------------------------------------------------------------------------------------------------------------
# 2. gloo and memory bandwidth, 2 processes at once


def _collective_seconds(nbytes: int) -> dict[str, float]:
    """Seconds of one all-reduce, all-gather and reduce-scatter whose full tensor is ``nbytes`` of fp32, each once
    after a barrier (diagnostic: the model times all three from the one all-reduce bus bandwidth)."""
    import torch
    import torch.distributed as dist

    full, half = torch.ones(nbytes // 8 * 2), torch.ones(nbytes // 8)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, half),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, full),
    }
    seconds = {}
    for name, call in calls.items():
        dist.barrier()
        start = time.perf_counter()
        call()
        seconds[name] = time.perf_counter() - start
    return seconds


def _comm_worker(rank: int, port: int, out: str, gradient_bytes: list[int]) -> None:
    """One of 2 gloo ranks: all-reduce figures, memory bandwidth and matmul FLOP/s measured beside the other rank,
    and the time of one all-reduce, all-gather and reduce-scatter of each model's fp32 gradient bytes (diagnostic)."""
    import torch
    import torch.distributed as dist

    from gym_lightning.metrics.calibrate import collective_figures, matmul_flops, memory_bandwidth

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    collectives = collective_figures(repeats=9)
    bus, latency = collectives["all_reduce"], collectives["latency"]
    dist.barrier()
    bandwidth = memory_bandwidth(repeats=9, budget=1.0)
    dist.barrier()
    matmul = matmul_flops(768, torch.float32, repeats=9, budget=1.0)
    grads = {str(nbytes): _collective_seconds(nbytes) for nbytes in gradient_bytes}
    figures = {"bus_bandwidth": bus, "latency": latency, "memory_bandwidth": bandwidth, "matmul_768": matmul}
    figures |= {
        "gather_bus_bandwidth": collectives["all_gather"],
        "scatter_bus_bandwidth": collectives["reduce_scatter"],
    }
    Path(out, f"comm{rank}.json").write_text(json.dumps({**figures, "gradient_collectives": grads}))
    dist.destroy_process_group()


def measure_comm(gradient_bytes: list[int]) -> dict[str, Any]:
    """Both ranks' figures of :func:`_comm_worker`; the bandwidths are the slower rank's."""
    with tempfile.TemporaryDirectory() as out:
        spawn_gloo(_comm_worker, 2, (out, gradient_bytes))
        ranks = [json.loads(Path(out, f"comm{r}.json").read_text()) for r in (0, 1)]
    return {
        "bus_bandwidth": min(r["bus_bandwidth"] for r in ranks),
        "gather_bus_bandwidth": min(r["gather_bus_bandwidth"] for r in ranks),
        "scatter_bus_bandwidth": min(r["scatter_bus_bandwidth"] for r in ranks),
        "latency": max(r["latency"] for r in ranks),
        "memory_bandwidth": min(r["memory_bandwidth"] for r in ranks),
        "matmul_768_concurrent": min(r["matmul_768"] for r in ranks),
        "gradient_collectives": {
            nbytes: {name: max(r["gradient_collectives"][nbytes][name] for r in ranks) for name in seconds}
            for nbytes, seconds in ranks[0]["gradient_collectives"].items()
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# 3. measured runs (the real CLI, 2 ranks)


class StepTimer(pl.Callback):
    """Times every optimizer step on rank 0: at the end of the batch that stepped (``global_step`` moved), after a
    barrier (the step ends when the slower rank's does), from the previous such end. Also splits each step, on rank
    0's clock, into forward (batch start -> ``on_before_backward``), backward (-> ``on_after_backward``, FSDP's and
    ZeRO-2/3's reduce-scatters included), optimizer (``on_before_optimizer_step`` -> batch end: the step and, for
    ZeRO-1/2, the parameter all-gather) summed over its micro-batches; the rest of the step is Lightning's loop, data
    and waiting for the other rank. Also rank 0's process CPU seconds per step (``time.process_time``: the host work
    of a rank, what the machine's other load does not inflate). Writes ``{"steps", "cpu_steps", "phases"}``.

    Args:
        out: JSON file rank 0 writes the step seconds to.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.last_step, self.last_time, self.mark, self.last_cpu = 0, 0.0, 0.0, 0.0
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.current = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def _lap(self, phase: str | None) -> None:
        """Add the time since the last mark to ``phase`` (none: just mark)."""
        now = time.perf_counter()
        if phase is not None:
            self.current[phase] += now - self.mark
        self.mark = now

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap(None)

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap("forward")

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap("backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lap(None)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.last_step:
            return  # a micro-batch that did not step (gradient accumulation)
        self._lap("optimizer")
        trainer.strategy.barrier()
        now, cpu = time.perf_counter(), time.process_time()
        if self.last_step > 0:
            self.seconds.append(now - self.last_time)
            self.cpu_seconds.append(cpu - self.last_cpu)
            self.phases.append(self.current)
        self.current = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.last_step, self.last_time, self.last_cpu = trainer.global_step, now, cpu
        if trainer.global_rank == 0:
            found = {"steps": self.seconds, "cpu_steps": self.cpu_seconds, "phases": self.phases}
            self.out.write_text(json.dumps(found))


def fit_command(size: str, batch: str, strategy: str, run: Path, steps: int) -> list[str]:
    """The real CLI on 2 CPU ranks: 32-true, packed rows, no validation, checkpointing, export or logger."""
    micro, seq, accumulate = parse_batch(batch)
    timer = {"class_path": "benchmarks.plan_validate.StepTimer", "init_args": {"out": str(run / "steps.json")}}
    return [
        sys.executable, "-m", "gym_lightning", "fit", "--seed_everything", "0",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", strategy,
        "--trainer.precision", "32-true", "--trainer.max_steps", str(steps), "--trainer.max_epochs", "1",
        "--trainer.accumulate_grad_batches", str(accumulate), "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run), f"--trainer.callbacks+={json.dumps(timer)}",
        "--model.model", "tiny-llama", "--model.config_overrides", json.dumps(overrides(size)),
        "--model.val_exact_match", "false", "--model.lr", "1e-5", "--model.scheduler", "constant",
        "--data.dataset", "addition", "--data.packing", "true", "--data.max_seq_length", str(seq),
        "--data.batch_size", str(micro), "--data.mask_prompt", "false", "--export.output_dir", "null",
    ]  # fmt: skip


def run_one(
    workdir: Path, size: str, batch: str, strategy: str, warmup: int, timed: int, name: str | None = None
) -> dict[str, Any]:
    """One CLI run; ``{"steps": [seconds of each timed step], "wall": ...}`` or ``{"failed": rc}``."""
    run = workdir / f"{size}-{batch}-{name or strategy}"
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    start = time.perf_counter()
    command = fit_command(size, batch, strategy, run, warmup + timed)
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (run / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"{run.name} failed (rc {done.returncode}): {done.stderr[-1500:]}", file=sys.stderr)
        return {"failed": done.returncode, "wall": wall}
    timed = json.loads((run / "steps.json").read_text())
    # The first duration is step 2's (step 1 has no start).
    kept = {key: timed[key][warmup - 1 :] for key in ("steps", "cpu_steps", "phases")}
    return {**kept, "wall": wall}


# ---------------------------------------------------------------------------------------------------------------
# 4. prediction and the table


def sharded_bus_bandwidth(comm: dict[str, Any], size: str) -> float | None:
    """The bus bandwidth gloo's all-gather and reduce-scatter reached on ``size``'s fp32 gradient bytes (one call
    each, the mean of their two times), for the diagnostic column; ``None`` without that measurement."""
    from gym_lightning.planner import RunSpec
    from gym_lightning.planner.estimate import param_counts

    nbytes = str(4 * param_counts(shape_of(size), RunSpec(accelerator="cpu")).trainable)
    measured = comm.get("gradient_collectives", {}).get(nbytes)
    if not measured:
        return None
    seconds = (measured["all_gather"] + measured["reduce_scatter"]) / 2
    return int(nbytes) / 2 / seconds  # (n-1)/n x bytes / time, n = 2


def predict(
    size: str, batch: str, strategy: str, figures: dict[str, Any], bus: float | None = None, leaf: bool = True
) -> Any:
    """``planner.timing.speed`` of one run on the measured CPU figures (``bus``: another bus bandwidth, diagnostic;
    ``leaf``: ZeRO-3 gathers decoder layers whole, gym's rule)."""
    from gym_lightning.planner import RunSpec
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY
    from gym_lightning.planner.machines import cpu_hardware
    from gym_lightning.planner.timing import speed

    micro, seq, accumulate = parse_batch(batch)
    setup = RunSpec(accelerator="cpu", gpus_per_node=2, nodes=1, precision="32-true", micro_batch_size=micro,
                    seq_length=seq, accumulate_grad_batches=accumulate, optimizer="adamw",
                    zero3_leaf_layers=leaf)  # fmt: skip
    calibration, comm = figures["calibration"], figures["comm"]
    hw = cpu_hardware(
        matmul_flops=calibration["matmul_flops"][size],
        memory_bandwidth=comm["memory_bandwidth"],
        bus_bandwidth=bus or comm["bus_bandwidth"],
        latency=comm["latency"],
        compute_efficiency=calibration["efficiency"],
        gather_bus_bandwidth=0.0 if bus else comm.get("gather_bus_bandwidth", 0.0),
        scatter_bus_bandwidth=0.0 if bus else comm.get("scatter_bus_bandwidth", 0.0),
    )
    return speed(shape_of(size), STRATEGY_BY_KEY[PLANNER_KEYS[strategy]], setup, hw)


def _collective_lines(comm: dict[str, Any]) -> list[str]:
    """One line per gradient size: measured seconds of each collective beside the model's (from the bus bandwidth)."""
    from gym_lightning.planner.comm import Group, Network

    lines = []
    bus, latency = comm["bus_bandwidth"], comm["latency"]
    group = Group(2, 1, Network(bus, bus, latency, latency, overlap=False))
    for nbytes, seconds in comm.get("gradient_collectives", {}).items():
        model = {"all_reduce": group.all_reduce(int(nbytes))}
        model["all_gather"] = model["reduce_scatter"] = group.all_gather(int(nbytes))
        shown = ", ".join(f"{name} {s * 1e3:.0f} ms (model {model[name] * 1e3:.0f})" for name, s in seconds.items())
        busbw = int(nbytes) / 2 / ((seconds["all_gather"] + seconds["reduce_scatter"]) / 2) / 1e9
        lines.append(f"gloo, {int(nbytes) / 1e6:.0f} MB fp32 gradients, one call each: {shown}; all-gather / "
                     f"reduce-scatter busbw {busbw:.2f} GB/s.")  # fmt: skip
    return lines


def render(figures: dict[str, Any]) -> str:
    """The markdown report: the calibrated figures, then one row per run."""
    cal, comm = figures["calibration"], figures["comm"]
    loop = cal["plain_loop"]
    lines = [
        *([figures["note"], ""] if figures.get("note") else []),
        f"Calibration ({cal['reference']}, 1 thread, 32-true): matmul "
        + ", ".join(f"{s} {v / 1e9:.1f}" for s, v in cal["matmul_flops"].items())
        + f" GFLOP/s; plain loop fwd+bwd {loop['compute'] * 1e3:.0f} ms ({cal['plain_loop_flops'] / 1e9:.1f} "
        f"GFLOP/s), AdamW step {loop['optimizer'] * 1e3:.1f} ms measured / {cal['optimizer_predicted'] * 1e3:.1f} "
        f"ms predicted; CPU compute efficiency {cal['efficiency']:.3f} "
        f"(raw achieved/matmul {cal['efficiency_raw']:.3f}).",
        f"2 ranks at once: gloo bus bandwidth {comm['bus_bandwidth'] / 1e9:.2f} GB/s (all-gather "
        f"{comm.get('gather_bus_bandwidth', 0) / 1e9:.2f}, reduce-scatter "
        f"{comm.get('scatter_bus_bandwidth', 0) / 1e9:.2f}, 32 MiB), latency "
        f"{comm['latency'] * 1e6:.0f} us, memory bandwidth {comm['memory_bandwidth'] / 1e9:.1f} GB/s per rank "
        f"(alone {cal['memory_bandwidth_alone'] / 1e9:.1f}), matmul(768) {comm['matmul_768_concurrent'] / 1e9:.1f} "
        "GFLOP/s per rank.",
        *_collective_lines(comm),
        "",
        "| size | params | batch | strategy | measured s (min) | predicted s | error | compute | exposed comm | "
        "optimizer | diagnostic: error with all-gather/reduce-scatter timed at this model's gradient size |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, result in figures["runs"].items():
        size, batch, strategy = key.split("/")
        if strategy not in PLANNER_KEYS:
            continue  # the hooks runs: their own section
        shape = shape_of(size)
        if "steps" not in result:
            lines.append(f"| {size} | {shape.num_params() / 1e6:.1f}M | {batch} | {strategy} | failed | | | | | | |")
            continue
        measured = statistics.median(result["steps"])
        step = predict(size, batch, strategy, figures).step
        sharded_bus = sharded_bus_bandwidth(comm, size) if PLANNER_KEYS[strategy] != "ddp" else None
        other = predict(size, batch, strategy, figures, sharded_bus).step.total if sharded_bus else None
        lines.append(
            f"| {size} | {shape.num_params() / 1e6:.1f}M | {batch} | {strategy} | {measured:.3f} "
            f"({min(result['steps']):.3f}) | {step.total:.3f} | {step.total / measured - 1:+.1%} | "
            f"{step.compute:.3f} | {step.exposed_communication:.3f} | {step.optimizer:.3f} | "
            + (f"{other / measured - 1:+.1%} |" if other else "|")
        )
    return "\n".join(lines + _phase_lines(figures) + _hook_lines(figures)) + "\n"


def _phase_lines(figures: dict[str, Any]) -> list[str]:
    """A second table: the measured step split into phases (rank 0, medians) beside the model's terms."""
    lines = [
        "",
        "Measured phases (rank 0, median seconds per optimizer step, micro-batches summed; other = loop, data, "
        "waiting for the other rank) beside the model's forward (1/3 of compute), backward (2/3 + exposed comm) and "
        "optimizer:",
        "",
        "| size | batch | strategy | forward | model | backward | model | optimizer | model | other |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, result in figures["runs"].items():
        size, batch, strategy = key.split("/")
        if not result.get("phases") or strategy not in PLANNER_KEYS:
            continue
        step = predict(size, batch, strategy, figures).step
        phase = {name: statistics.median(p[name] for p in result["phases"]) for name in result["phases"][0]}
        other = statistics.median(result["steps"]) - sum(phase.values())
        lines.append(
            f"| {size} | {batch} | {strategy} | {phase['forward']:.3f} | {step.compute / 3:.3f} | "
            f"{phase['backward']:.3f} | {step.compute * 2 / 3 + step.exposed_communication:.3f} | "
            f"{phase['optimizer']:.3f} | {step.optimizer:.3f} | {other:.3f} |"
        )
    return lines if len(lines) > 5 else []


def measure_hooks(workdir: Path, repeats: int, warmup: int, timed: int) -> dict[str, list[float]]:
    """ZeRO-3 with and without decoder-layer leaves on the ``hooks`` model, alternated ``repeats`` times: the
    median of each run's timed steps, wall (``<name>``) and rank 0's process CPU seconds (``<name>_cpu``)."""
    found: dict[str, list[float]] = {key: [] for name in HOOK_RUNS for key in (name, f"{name}_cpu")}
    for attempt in range(repeats):
        for name, strategy in HOOK_RUNS.items():
            result = run_one(workdir, "hooks", HOOK_BATCH, strategy, warmup, timed, name=f"{name}-{attempt}")
            if "steps" in result:
                found[name].append(statistics.median(result["steps"]))
                found[f"{name}_cpu"].append(statistics.median(result["cpu_steps"]))
            print(f"hooks {name} {attempt}: {result.get('steps')} cpu {result.get('cpu_steps')}", file=sys.stderr)
    return found


def fetch_seconds(figures: dict[str, Any]) -> dict[str, float] | None:
    """Host seconds of one ZeRO-3 fetch from the ``--hooks`` runs: rank 0's CPU seconds per step with per-module
    hooks less with decoder-layer leaves (the machine's other load inflates wall time, not a process's own CPU
    time), over the difference in fetches per step (forward and backward); the wall difference beside it, less the
    model's difference in gather latencies."""
    from gym_lightning.planner import RunSpec
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY
    from gym_lightning.planner.families import cost_model

    hooks = figures.get("hooks")
    if not hooks or not hooks.get("zero3_cpu") or not hooks.get("zero3_modules_cpu"):
        return None
    shape, zero3 = shape_of("hooks"), STRATEGY_BY_KEY["zero3"]
    counts = [cost_model(zero3, shape, RunSpec(zero3_leaf_layers=leaf)).fetched_modules() for leaf in (True, False)]
    fetches = 2 * (counts[1] - counts[0])
    cpu = statistics.median(hooks["zero3_modules_cpu"]) - statistics.median(hooks["zero3_cpu"])
    measured = statistics.median(hooks["zero3_modules"]) - statistics.median(hooks["zero3"])
    model = predict("hooks", HOOK_BATCH, "zero3", figures, leaf=False).step.total
    model -= predict("hooks", HOOK_BATCH, "zero3", figures).step.total
    wall = (measured - model) / fetches
    return {
        "fetches": fetches,
        "cpu": cpu,
        "measured": measured,
        "model": model,
        "per_fetch": cpu / fetches,
        "wall": wall,
    }


def _hook_lines(figures: dict[str, Any]) -> list[str]:
    """The ZeRO-3 hook measurement, when it ran."""
    found = fetch_seconds(figures)
    if found is None:
        return []
    hooks = figures["hooks"]
    shown = "; ".join(f"{name} " + ", ".join(f"{v:.3f}" for v in values) + " s" for name, values in hooks.items())
    return [
        "",
        f"ZeRO-3 hooks (`--hooks`, {shape_of('hooks').num_params() / 1e6:.1f}M parameters in 12 layers, {HOOK_BATCH}, "
        f"2 CPU ranks, runs alternated; per run the median step, wall and rank 0's CPU seconds): {shown}. Per-module "
        f"hooks add {found['cpu'] * 1e3:.1f} ms of rank 0's CPU time a step for {found['fetches']} more fetches: "
        f"{found['per_fetch'] * 1e6:.0f} us of host work per fetch (the catalog's `host.zero3_fetch_us`). Wall: "
        f"{found['measured'] * 1e3:.1f} ms more a step, of which the model's gather latencies are "
        f"{found['model'] * 1e3:.1f} ms: {found['wall'] * 1e6:.0f} us per fetch.",
    ]


DOC = PLANNER_DOC
HEADING = "## Validation: step time on 2 CPU ranks over gloo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", default=list(BATCHES))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(PLANNER_KEYS))
    parser.add_argument("--reference", default="26m/1x256", help="SIZE/BATCH of the calibration's plain loop")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps")
    parser.add_argument("--timed", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-plan-validate")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (and .json beside it)")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from --out's JSON")
    parser.add_argument("--hooks", action="store_true", help="also measure ZeRO-3's per-module hook cost")
    parser.add_argument("--repeats", type=int, default=3, help="--hooks: alternations of the two runs")
    parser.add_argument("--write", action="store_true", help=f"replace the section {HEADING!r} of docs/planner.md")
    args = parser.parse_args()
    json_out = (args.out or args.workdir / "report.md").with_suffix(".json")
    figures = measured_or_saved(json_out, lambda: measure(args), args.render_only)
    report = render(figures)
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.write:
        day = time.strftime("%Y-%m-%d")
        section = f"{HEADING}\n\nWritten by `python -m benchmarks.plan_validate --write` ({day}).\n\n"
        DOC.write_text(replace_section(DOC.read_text(), HEADING, section + report))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Steps 1-3: calibration, the 2-rank figures, then every run (progress on stderr)."""
    from gym_lightning.planner import RunSpec
    from gym_lightning.planner.estimate import param_counts

    started = time.perf_counter()
    sizes = set(args.sizes) | {args.reference.split("/")[0]} | ({"hooks"} if args.hooks else set())
    figures: dict[str, Any] = {"calibration": calibrate(args.reference, sorted(sizes))}
    gradient_bytes = [4 * param_counts(shape_of(s), RunSpec(accelerator="cpu")).trainable for s in args.sizes]
    figures["comm"] = measure_comm(gradient_bytes)
    print(f"calibrated in {time.perf_counter() - started:.0f} s: {figures}", file=sys.stderr, flush=True)
    figures["runs"] = {}
    if args.hooks:
        figures["hooks"] = measure_hooks(args.workdir, args.repeats, args.warmup, args.timed)
    for size in args.sizes:
        for batch in args.batches:
            for strategy in args.strategies:
                result = run_one(args.workdir, size, batch, strategy, args.warmup, args.timed)
                figures["runs"][f"{size}/{batch}/{strategy}"] = result
                print(
                    f"{size} {batch} {strategy}: {result} ({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return figures


if __name__ == "__main__":
    main()
