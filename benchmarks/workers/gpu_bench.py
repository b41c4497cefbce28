"""One benchmark run of benchmarks/gpu.sh: a Qwen3-1.7B-shaped model, random weights, one strategy, one process.

    python benchmarks/workers/gpu_bench.py write-config --out DIR            # config-only model folder (no weights)
    python benchmarks/workers/gpu_bench.py run --strategy gym_fsdp --model DIR --jsonl bench.jsonl [--batch-size 4]
    python benchmarks/workers/gpu_bench.py collect --checks checks.jsonl --bench bench.jsonl --out results.json
    python benchmarks/workers/gpu_bench.py run --cpu-smoke --strategy gym_zero3 --jsonl /tmp/bench.jsonl  # CPU

Strategies: ``gym_fsdp`` (GymFSDPStrategy, FSDP2), ``gym_zero3`` (ZeROStrategy(stage=3)), ``lightning_fsdp``
(Lightning's FSDPStrategy, FSDP1, one unit per Qwen3DecoderLayer), ``lightning_deepspeed`` (Lightning's
DeepSpeedStrategy(stage=3)); all at world size 1, ``bf16-mixed``, the same ``CausalLMModule`` (fp32 parameters,
SDPA attention, its torch AdamW: no DeepSpeed optimizer, so no op is JIT-built; ``gpu_common.refuse_jit_builds``
makes a build an error) and the same synthetic batches (no padding). tokens/s and MFU come from gym_lightning's
``ThroughputCallback`` (FLOPs convention: 6·N + 12·L·H·Q·T per token, PaLM appendix B; N excludes the input
embedding and counts the tied LM head; dense bf16 peak of the chip from gym_lightning.metrics.peak_flops) over
the steps after ``--warmup``; the measured peak is ``torch.cuda.max_memory_allocated`` of the whole process, beside
the planner's predicted device peak (``gym_lightning.planner``: the larger of its load and step phases for the
matching strategy). Each run appends one JSON line to ``--jsonl`` when it ends. Lightning's two strategies refuse
CPU accelerators: under ``--cpu-smoke`` they are recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import CPU_ONLY_OPS, append_record, read_records, refuse_jit_builds

STRATEGIES = ("gym_fsdp", "gym_zero3", "lightning_fsdp", "lightning_deepspeed")
PEERS = {"gym_fsdp": "lightning_fsdp", "gym_zero3": "lightning_deepspeed"}
# The planner's strategy for each run (Lightning's FSDP1 and DeepSpeed stage 3 hold what gym's counterparts hold).
PLANNER_KEYS = {"gym_fsdp": "fsdp_full", "lightning_fsdp": "fsdp_full", "gym_zero3": "zero3"}
PLANNER_KEYS["lightning_deepspeed"] = "zero3"
MEDIAN_KEYS = ("tokens_per_sec", "clock_tokens_per_sec", "mfu", "device_tflops_per_sec", "peak_memory_bytes")

# Qwen/Qwen3-1.7B config.json (shape as in gym_lightning.planner.catalog.BUNDLED["qwen3-1.7b"]); no weights needed.
QWEN3_1_7B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# The same architecture at a size a CPU trains in seconds (--cpu-smoke).
SMOKE_OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
SMOKE_OVERRIDES |= {"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def write_config(out: Path, smoke: bool = False) -> Path:
    """A config-only Hugging Face folder of the Qwen3-1.7B shape (``pretrained=False`` builds random weights)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**QWEN3_1_7B, **(SMOKE_OVERRIDES if smoke else {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def make_strategy(name: str) -> Any:
    """The strategy object, with the arguments checked against Lightning 2.6.6 / DeepSpeed 0.19.8."""
    if name == "gym_fsdp":
        from gym_lightning.strategies import GymFSDPStrategy

        return GymFSDPStrategy(sharding="full")
    if name == "gym_zero3":
        from gym_lightning.strategies import ZeROStrategy

        return ZeROStrategy(stage=3)
    if name == "lightning_fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        # The wrapping Lightning's docs recommend for transformers: one FSDP unit per decoder layer.
        return FSDPStrategy(auto_wrap_policy={Qwen3DecoderLayer}, sharding_strategy="FULL_SHARD")
    if name == "lightning_deepspeed":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=3)
    raise ValueError(f"unknown strategy {name!r}; expected one of {STRATEGIES}")


def predicted_peak(model_dir: str, strategy: str, batch_size: int, seq_len: int) -> dict[str, Any]:
    """The planner's device peak for this run: its load and step phases at world size 1, bf16-mixed, SDPA."""
    from gym_lightning.planner.catalog import resolve_shape
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY, Setup
    from gym_lightning.planner.phases import phase_peaks

    key = PLANNER_KEYS[strategy]
    setup = Setup(gpus_per_node=1, precision="bf16-mixed", micro_batch_size=batch_size, seq_length=seq_len)
    peaks = phase_peaks(resolve_shape(model_dir), STRATEGY_BY_KEY[key], setup)
    load, step = peaks.load.device, peaks.step.device
    figures = {"planner_strategy": key, "predicted_load_bytes": load, "predicted_step_bytes": step}
    return figures | {"predicted_peak_bytes": max(load, step)}


def optimizer_probe() -> Any:
    """A callback noting which optimizer the strategy steps: DeepSpeed wraps the module's torch AdamW in its own
    (``.optimizer``), where a DeepSpeed optimizer (FusedAdam) would JIT-build an op. Built here so that ``collect``
    and ``--help`` do not import Lightning."""
    import lightning.pytorch as pl

    class OptimizerProbe(pl.Callback):
        summary = ""

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            outer = trainer.optimizers[0]
            inner = getattr(outer, "optimizer", outer)
            fused = any(group.get("fused") for group in inner.param_groups)
            wrapped = f"{type(outer).__name__} over " if inner is not outer else ""
            self.summary = f"{wrapped}{type(inner).__module__}.{type(inner).__name__} (fused={fused})"

    return OptimizerProbe()


def bench_trainer(args: argparse.Namespace, callbacks: list[Any]) -> Any:
    """The run's Trainer: world size 1, bf16-mixed, warm-up + timed steps, nothing else (no validation, logger,
    checkpoints or progress bar)."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu" if args.cpu_smoke else "cuda",
        devices=1,
        strategy=make_strategy(args.strategy),
        precision="bf16-mixed",
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        logger=False,
        log_every_n_steps=50,
        use_distributed_sampler=False,
        default_root_dir=str(Path(args.work) / f"logs_{args.strategy}"),
        callbacks=callbacks,
    )


def run(args: argparse.Namespace, op_loads: list[dict[str, Any]]) -> dict[str, Any]:
    """Train ``args.strategy`` for warm-up + timed steps; its figures (tokens/s, MFU, peaks, the planner's)."""
    import torch
    from dist_bench import ReadyBatches, make_batches
    from fit_vs_plain import StepClock

    from gym_lightning.callbacks import ThroughputCallback
    from gym_lightning.module import CausalLMModule
    from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR

    model_dir = args.model or str(write_config(Path(args.work) / "model_config", smoke=args.cpu_smoke))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    spec = {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup}
    module = CausalLMModule(
        model=model_dir,
        tokenizer=str(SHIPPED_TOKENIZER_DIR),  # only loaded, never used for training on synthetic tokens
        pretrained=False,
        torch_dtype="float32",  # fp32 parameters: bf16-mixed keeps fp32 weights / masters in every strategy
        attn_implementation="sdpa",
        lr=1e-5,
        scheduler="constant",
    )
    throughput, clock = ThroughputCallback(warmup_steps=args.warmup, log_every_n_steps=5), StepClock(args.warmup)
    optimizer = optimizer_probe()
    start = time.perf_counter()
    trainer = bench_trainer(args, [throughput, clock, optimizer])
    trainer.fit(module, datamodule=ReadyBatches(make_batches(spec, rank=0, vocab=vocab), args.batch_size))
    total = throughput.summary.get("total") or {}
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    return {
        "tokens_per_sec": total.get("tokens_per_sec"),
        "clock_tokens_per_sec": args.steps * args.batch_size * args.seq_len / (clock.t1 - clock.t0),
        "mfu": total.get("mfu"),
        "device_tflops_per_sec": total.get("device_tflops_per_sec"),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else 0,
        **predicted_peak(model_dir, args.strategy, args.batch_size, args.seq_len),
        "optimizer": optimizer.summary,
        "deepspeed_ops_loaded": op_loads,
        "device": throughput.summary.get("device_name"),
        "flops": throughput.summary.get("flops"),
        "fit_seconds": time.perf_counter() - start,
    }


def run_recorded(args: argparse.Namespace) -> dict[str, Any]:
    """``run`` as one record: its figures, the skip on CPU of Lightning's CUDA-only strategies, or the error."""
    record: dict[str, Any] = {"strategy": args.strategy, "peer": PEERS.get(args.strategy), "round": args.round}
    start = time.perf_counter()
    if args.cpu_smoke and args.strategy.startswith("lightning_"):
        return record | {"ok": None, "skipped": "needs CUDA (Lightning's FSDPStrategy / DeepSpeedStrategy)"}
    try:
        from gym_lightning.quiet import quiet_console

        quiet_console()  # as `gym` does: before DeepSpeed is first imported

        op_loads = refuse_jit_builds(CPU_ONLY_OPS if args.cpu_smoke else ())
        record |= run(args, op_loads)
        record["ok"] = bool(record["tokens_per_sec"]) and record["tokens_per_sec"] > 0
    except Exception as err:  # recorded, so that one failing strategy does not hide the others' figures
        traceback.print_exc()
        record |= {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    return record | {"seconds": round(time.perf_counter() - start, 2)}


def merge_runs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry per strategy: the median over its successful rounds, else its last error or skip."""
    merged: dict[str, Any] = {}
    for name in STRATEGIES:
        found = [r for r in records if r.get("strategy") == name]
        good = [r for r in found if r.get("ok") and r.get("tokens_per_sec")]
        if not good:
            last = found[-1] if found else {"error": "not run (time budget or an earlier failure)"}
            merged[name] = {key: last[key] for key in ("error", "skipped") if key in last} or {"error": "no result"}
            merged[name]["peer"] = PEERS.get(name)
            continue
        best = dict(good[-1])
        for key in MEDIAN_KEYS:
            values = [r[key] for r in good if r.get(key) is not None]
            best[key] = statistics.median(values) if values else None
        best["rounds"] = [r["tokens_per_sec"] for r in good]
        merged[name] = best
    return merged


def collect(checks: Path, bench: Path, out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """results.json from the two JSON-lines files: {"meta", "checks": [records], "runs": {strategy: merged}}."""
    bench_records = read_records(bench)
    payload = {"meta": meta, "checks": read_records(checks), "runs": merge_runs(bench_records)}
    payload["failed"] = [r["check"] for r in payload["checks"] if r.get("ok") is False]
    payload["failed"] += [f"bench/{r['strategy']}" for r in bench_records if r.get("ok") is False]
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("write-config", help="write the config-only Qwen3-1.7B folder")
    config.add_argument("--out", type=Path, required=True)
    config.add_argument("--cpu-smoke", action="store_true", help="a tiny model of the same architecture")
    one = sub.add_parser("run", help="train one strategy and append its figures as one JSON line")
    one.add_argument("--strategy", choices=STRATEGIES, required=True)
    one.add_argument("--model", help="config-only model folder (default: written into --work)")
    one.add_argument("--jsonl", type=Path, required=True, help="the JSON-lines file to append this run's record to")
    one.add_argument("--work", default="/tmp/gym_gpu_work", help="scratch folder (model config, Lightning logs)")
    one.add_argument("--round", type=int, default=1, help="which round of the benchmark this run belongs to")
    one.add_argument("--batch-size", type=int, default=4)
    one.add_argument("--seq-len", type=int, default=2048)
    one.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    one.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    one.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the code path, no figures")
    gather = sub.add_parser("collect", help="merge the checks and the runs into one results file")
    gather.add_argument("--checks", type=Path, required=True, help="gpu_check.py's JSON lines")
    gather.add_argument("--bench", type=Path, required=True, help="the runs' JSON lines")
    gather.add_argument("--out", type=Path, required=True)
    gather.add_argument("--meta", default="{}", help="JSON object of facts to print above the tables")
    args = parser.parse_args()
    if args.command == "write-config":
        print(write_config(args.out, args.cpu_smoke))
        return 0
    if args.command == "collect":
        payload = collect(args.checks, args.bench, args.out, json.loads(args.meta))
        print(f"collect: {len(payload['checks'])} checks, failed: {payload['failed'] or 'none'}")
        return 1 if payload["failed"] else 0
    record = run_recorded(args)
    append_record(args.jsonl, record)
    print(json.dumps(record)[:3000], flush=True)
    return 1 if record["ok"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
