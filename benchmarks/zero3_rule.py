"""Host-side cost of ZeRO-3's settings on 2 CPU ranks: DeepSpeed's old settings vs each setting of
``strategies.zero.rule`` alone vs the whole rule.

    python -m benchmarks.zero3_rule [--layers 12 --hidden 64 --seq 32 --batch 2 --steps 6]

A tiny random Llama (many small layers, so host work dominates) trains ``--steps`` AdamW steps under DeepSpeed's
engine (gloo, 1 thread per rank, fp32) on the same random tokens per variant. Per step (mean over the steps after
the first, which records ZeRO-3's trace) it counts DeepSpeed's sub-module fetch hook calls (pre-forward and
pre-backward) and times it, and it reports how many elements DeepSpeed persisted (whole on every rank).
The losses of every variant must equal the old settings' (ZeRO settings do not change the maths): the table says
the largest difference. Prints one markdown table (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common.launch import spawn_gloo

# The settings before the rule: gym_lightning's layer-sized limits, DeepSpeed's persistence (1e5 elements per tensor,
# no total budget), no leaf modules.
VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "old (1e5 persistence, no leaf)": ({}, False),
    "leaf decoder layers only": ({}, True),
    "rule persistence only": ({"rule_persistence": True}, False),
    "whole rule": ({"rule_persistence": True}, True),
    # What the layer-sized limits and buckets gave: DeepSpeed's own defaults (Lightning's DeepSpeedStrategy(stage=3)
    # passes them), and the whole rule without prefetching (the prefetch is what overlaps gathers on a GPU).
    "DeepSpeed defaults (Lightning's stage 3)": ({"deepspeed_defaults": True}, False),
    "whole rule, no prefetch": ({"rule_persistence": True, "stage3_prefetch_bucket_size": 0}, True),
}
SIZING_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _config(model: torch.nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    from gym_lightning.strategies.zero.rule import ZeroShape, zero_rule

    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    shape = ZeroShape(
        layer_numel=layer, hidden_size=model.config.hidden_size, world_size=dist.get_world_size(), stage=3
    )
    zero = dict(zero_rule(shape).zero)
    zero.pop("stage3_param_persistence_threshold")
    zero.pop("stage3_model_persistence_threshold")
    if settings.get("rule_persistence"):
        zero.update({k: v for k, v in zero_rule(shape).zero.items() if "persistence" in k})
    if settings.get("deepspeed_defaults"):
        zero = {k: v for k, v in zero.items() if k not in SIZING_KEYS}
    zero.update({k: v for k, v in settings.items() if k in SIZING_KEYS})
    zero.update(stage=3, overlap_comm=False)  # CPU: no streams to overlap on
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


def _run_variant(args: argparse.Namespace, settings: dict[str, Any], leaf: bool) -> dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from gym_lightning.strategies.zero.leaf import mark_decoder_leaf_modules

    model = _model(args)
    config = _config(model, settings)
    if leaf:
        mark_decoder_leaf_modules(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    hooks = {"n": 0}
    for name in ("pre_sub_module_forward_function", "pre_sub_module_backward_function"):
        original = getattr(DeepSpeedZeRoOffload, name)

        def counted(self: Any, module: Any, _original: Any = original) -> Any:
            hooks["n"] += 1
            return _original(self, module)

        setattr(DeepSpeedZeRoOffload, name, counted)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, times, hook_calls = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch, args.seq), generator=generator)
        hooks_before = hooks["n"]
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        hook_calls.append(hooks["n"] - hooks_before)
        losses.append(loss.item())
    persistent = sum(p.ds_numel for p in engine.module.parameters() if getattr(p, "ds_persist", False))
    engine.destroy()
    rest = slice(1, None)
    return {
        "losses": losses,
        "ms": 1000 * sorted(times[rest])[len(times[rest]) // 2],
        "hooks": sum(hook_calls[rest]) / len(hook_calls[rest]),
        "persistent": persistent,
    }


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    import deepspeed

    from gym_lightning.strategies.zero.ops import load_ops, ops_needed

    load_ops(ops_needed("cpu", "torch", nvme=False))
    deepspeed.init_distributed(dist_backend="gloo")
    results = {name: _run_variant(args, *variant) for name, variant in VARIANTS.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    # Both ranks leave the group together: a gloo group torn down at interpreter exit aborted one rank ("terminate
    # called without an active exception", pytorch #190489), as in the test workers.
    dist.barrier()
    dist.destroy_process_group()


def _table(results: dict[str, dict[str, Any]]) -> str:
    base = results[next(iter(results))]
    lines = [
        "| settings | fetch hook calls / step | persisted elements | step ms (median) | max abs loss diff vs old |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
        lines.append(f"| {name} | {r['hooks']:.0f} | {r['persistent']:,} | {r['ms']:.1f} | {diff:.1e} |")
    return "\n".join(lines)


def main() -> None:
    """Run every variant on 2 gloo ranks and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "results.json")
        spawn_gloo(_worker, 2, (args, out))
        results = json.loads(Path(out).read_text())
    print(f"2 CPU ranks (gloo), Llama {args.layers} x hidden {args.hidden}, batch {args.batch} x {args.seq}, fp32")
    print(_table(results))


if __name__ == "__main__":
    main()
