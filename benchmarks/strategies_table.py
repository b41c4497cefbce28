"""Run every strategy on 2 CPU ranks and print ONE markdown table: throughput and per-rank memory, with ratios to DDP.

    python -m benchmarks.strategies_table [--steps 12] [--warmup 2] [--strategies gym_ddp zero3 ...]

Each strategy trains the ``tiny-llama`` preset on the bundled ``addition`` data set for a few steps in its own
2-process job (Lightning's launcher, gloo, a free port, 1 thread per rank), with ``ThroughputCallback`` and
``MemoryCallback``; the table is built from their ``throughput.json`` and ``memory.json``. Memory cells are the
largest rank's bytes; ``xDDP`` is the ratio to ``gym_ddp``. ``zero3 (persist 0)`` is ZeRO-3 with
``stage3_param_persistence_threshold=0``: the registered ``zero3`` keeps parameters under 1e5 elements (most of a tiny
model) whole on every rank, as DeepSpeed does by default.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.launch import child_env, free_port, python_module
from benchmarks.common.paths import REPO_ROOT

STRATEGIES: tuple[str, ...] = ("gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3", "zero3_persist0")
LABELS = {"zero3_persist0": "zero3 (persist 0)"}
MEMORY_COLUMNS = ("params", "grads", "master_params", "optimizer_state", "comm_buffers", "total")


def _strategy(name: str) -> Any:
    if name != "zero3_persist0":
        return name
    from gym_lightning.strategies import ZeROStrategy

    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 200_000_000,
        "allgather_bucket_size": 200_000_000,
    }
    return ZeROStrategy(config={"zero_optimization": zero})


def run_one(strategy: str, out_dir: str, steps: int, warmup: int) -> None:
    """The 2-rank training job (Lightning re-runs this command line for rank 1)."""
    import lightning.pytorch as pl
    import torch

    import gym_lightning.strategies  # noqa: F401  (registers the strategy names)
    from gym_lightning.callbacks import MemoryCallback, ThroughputCallback
    from gym_lightning.data.datamodule import CausalLMDataModule
    from gym_lightning.module import CausalLMModule

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(strategy),
        max_steps=steps,
        callbacks=[ThroughputCallback(warmup_steps=warmup, log_every_n_steps=1), MemoryCallback()],
        default_root_dir=out_dir,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    module = CausalLMModule(model="tiny-llama", pretrained=False, lr=1e-3, scheduler="constant")
    trainer.fit(module, CausalLMDataModule(dataset="addition", batch_size=16, max_seq_length=32))


def launch(strategy: str, out_dir: Path, steps: int, warmup: int) -> tuple[dict[str, Any], dict[str, Any]]:
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = python_module(
        __spec__.name, "--run", strategy, "--out", out_dir, "--steps", str(steps), "--warmup", str(warmup)
    )
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{strategy} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((out_dir / "throughput.json").read_text()), json.loads((out_dir / "memory.json").read_text())


def _max_rank(memory: dict[str, Any], column: str) -> int:
    held = [rank["end"] for rank in memory["ranks"]]
    if column == "total":
        return max(h["total"] for h in held)
    return max(h[column]["on_device"] + h[column]["offloaded"] for h in held)


def table(results: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> str:
    from gym_lightning.callbacks.reports import format_bytes, markdown_table

    base_tps = results["gym_ddp"][0]["total"]["tokens_per_sec"] if "gym_ddp" in results else None
    base_mem = {c: _max_rank(results["gym_ddp"][1], c) for c in MEMORY_COLUMNS} if "gym_ddp" in results else {}
    header = ["strategy", "tokens/s (job)", "target tok/s", *MEMORY_COLUMNS, "peak RSS"]
    rows = []
    for name, (throughput, memory) in results.items():
        tps = throughput["total"]["tokens_per_sec"]
        row = [LABELS.get(name, name), f"{tps:,.0f}" + (f" ({tps / base_tps:.2f}x)" if base_tps else "")]
        row.append(f"{throughput['total']['target_tokens_per_sec']:,.0f}")
        for column in MEMORY_COLUMNS:
            value, base = _max_rank(memory, column), base_mem.get(column)
            row.append(format_bytes(value) + (f" ({value / base:.2f}x)" if base else ""))
        row.append(format_bytes(max(rank["peak_host_rss"] for rank in memory["ranks"])))
        rows.append(row)
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--run", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run, args.out, args.steps, args.warmup)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results[name] = launch(name, Path(tmp) / name, args.steps, args.warmup)
    print(
        f"2 CPU ranks (gloo, 1 thread each), tiny-llama, batch 16 x 32 tokens per rank, {args.steps} steps "
        f"({args.warmup} warm-up); memory = largest rank around the last optimizer step; (x) = ratio to gym_ddp\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
