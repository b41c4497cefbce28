"""One GPU benchmark run for benchmarks/gpu.sh: a Qwen3-1.7B-shaped model, random weights, one strategy, one process.

    python benchmarks/workers/gpu_bench.py write-config --out DIR           # config-only model folder (no weights)
    python benchmarks/workers/gpu_bench.py run --strategy gym_fsdp --model DIR --json OUT.json [--batch-size 4 ...]
    python benchmarks/workers/gpu_bench.py collect --runs DIR --out results.json   # median per strategy, ratios
    python benchmarks/workers/gpu_bench.py run --cpu-smoke --strategy gym_zero3 --json /tmp/x.json   # CPU dry run

Strategies: ``gym_fsdp`` (GymFSDPStrategy, FSDP2), ``gym_zero3`` (ZeROStrategy(stage=3)), ``lightning_fsdp``
(Lightning's FSDPStrategy, FSDP1, one unit per Qwen3DecoderLayer), ``lightning_deepspeed`` (Lightning's
DeepSpeedStrategy(stage=3)); all at world size 1, ``bf16-mixed``, the same ``CausalLMModule`` (fp32 parameters,
SDPA attention) and the same synthetic batches (no padding). tokens/s and MFU come from gym_lightning's
``ThroughputCallback`` (FLOPs convention: 6·N + 12·L·H·Q·T per token, PaLM appendix B; N excludes the input
embedding and counts the tied LM head; dense bf16 peak of the chip from gym_lightning.metrics.peak_flops) over
the steps after ``--warmup``; peak memory is ``torch.cuda.max_memory_allocated`` of the process.
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

STRATEGIES = ("gym_fsdp", "gym_zero3", "lightning_fsdp", "lightning_deepspeed")
PEERS = {"gym_fsdp": "lightning_fsdp", "gym_zero3": "lightning_deepspeed"}

# Qwen/Qwen3-1.7B config.json (shape as in gym_lightning.planner.shapes.BUNDLED["qwen3-1.7b"]); no weights needed.
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from dist_bench import ReadyBatches, make_batches
    from fit_vs_plain import StepClock

    from gym_lightning.callbacks import ThroughputCallback
    from gym_lightning.module import CausalLMModule
    from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR

    model_dir = args.model or str(write_config(Path(args.json).parent / "model_config", smoke=args.cpu_smoke))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    spec = {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup}
    batches = make_batches(spec, rank=0, vocab=vocab)
    module = CausalLMModule(
        model=model_dir,
        tokenizer=str(SHIPPED_TOKENIZER_DIR),  # only loaded, never used for training on synthetic tokens
        pretrained=False,
        torch_dtype="float32",  # fp32 parameters: bf16-mixed keeps fp32 weights / masters in every strategy
        attn_implementation="sdpa",
        lr=1e-5,
        scheduler="constant",
    )
    throughput = ThroughputCallback(warmup_steps=args.warmup, log_every_n_steps=5)
    clock = StepClock(args.warmup)
    trainer = pl.Trainer(
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
        default_root_dir=str(Path(args.json).parent / f"logs_{args.strategy}"),
        callbacks=[throughput, clock],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=ReadyBatches(batches, args.batch_size))
    total = throughput.summary.get("total") or {}
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    return {
        "strategy": args.strategy,
        "peer": PEERS.get(args.strategy),
        "tokens_per_sec": total.get("tokens_per_sec"),
        "clock_tokens_per_sec": args.steps * args.batch_size * args.seq_len / (clock.t1 - clock.t0),
        "mfu": total.get("mfu"),
        "device_tflops_per_sec": total.get("device_tflops_per_sec"),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else 0,
        "device": throughput.summary.get("device_name"),
        "flops": throughput.summary.get("flops"),
        "wall_sec": time.perf_counter() - start,
    }


def collect(runs_dir: Path, out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Median over rounds per strategy (``<strategy>.<round>.json`` files), the ratio to the peer, as JSON."""
    merged: dict[str, Any] = {}
    for name in STRATEGIES:
        found = [json.loads(p.read_text()) for p in sorted(runs_dir.glob(f"{name}.*.json"))]
        ok = [r for r in found if r.get("tokens_per_sec")]
        if not ok:
            errors = [r.get("error", "no result") for r in found] or ["not run"]
            merged[name] = {"error": errors[-1], "peer": PEERS.get(name)}
            continue
        best = dict(ok[0])
        for key in ("tokens_per_sec", "clock_tokens_per_sec", "mfu", "device_tflops_per_sec", "peak_memory_bytes"):
            values = [r[key] for r in ok if r.get(key) is not None]
            best[key] = statistics.median(values) if values else None
        best["rounds"] = [r["tokens_per_sec"] for r in ok]
        merged[name] = best
    payload = {"meta": meta, "runs": merged}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("write-config", help="write the config-only Qwen3-1.7B folder")
    config.add_argument("--out", type=Path, required=True)
    config.add_argument("--cpu-smoke", action="store_true", help="a tiny model of the same architecture")
    one = sub.add_parser("run", help="train one strategy and write its figures as JSON")
    one.add_argument("--strategy", choices=STRATEGIES, required=True)
    one.add_argument("--model", help="config-only model folder (default: written next to --json)")
    one.add_argument("--json", required=True, help="where to write this run's figures")
    one.add_argument("--batch-size", type=int, default=4)
    one.add_argument("--seq-len", type=int, default=2048)
    one.add_argument("--steps", type=int, default=15, help="timed optimizer steps")
    one.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    one.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the code path, no figures")
    gather = sub.add_parser("collect", help="merge the runs into one results file")
    gather.add_argument("--runs", type=Path, required=True)
    gather.add_argument("--out", type=Path, required=True)
    gather.add_argument("--meta", default="{}", help="JSON object of facts to print above the table")
    args = parser.parse_args()
    if args.command == "write-config":
        print(write_config(args.out, args.cpu_smoke))
        return 0
    if args.command == "collect":
        payload = collect(args.runs, args.out, json.loads(args.meta))
        print(json.dumps(payload["runs"], indent=1)[:4000])
        return 0
    try:
        result = run(args)
    except Exception as err:  # recorded, so that one failing strategy does not hide the others' figures
        traceback.print_exc()
        result = {"strategy": args.strategy, "peer": PEERS.get(args.strategy), "error": f"{type(err).__name__}: {err}"}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
