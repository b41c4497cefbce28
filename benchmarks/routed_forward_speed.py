"""Speed and host syncs of gym's routed experts forward against the per-expert forward it replaced (issue 55).

    python -m benchmarks.routed_forward_speed                # moe-400m and Qwen3-30B-A3B, 512 and 2,048 tokens
    python -m benchmarks.routed_forward_speed --layers moe-400m --tokens 512 --repeats 3     # a quick look
    python -m benchmarks.routed_forward_speed --write-docs
    python -m benchmarks.routed_forward_speed --device cuda --jsonl routed.jsonl   # on a GPU (gpu.sh --part bench)

One MoE layer's experts (transformers' ``Qwen3MoeExperts``, bf16 weights of std 0.02) with LoRA r=16, alpha 32 on
both fused weights in peft's layout (fp32 factors of std 0.02, as ``expert_forward_peak.py`` has them), routed
forward + backward of 1 x T random tokens (top-k of a softmax over random router logits) through:

- ``grouped``: ``models.experts.route_experts``: the pairs sorted by expert on the device, one read of the group
  bounds, the tokens and weights gathered once and split by expert;
- ``per-expert``: the forward before issue 55 (``benchmarks.common.routed_reference``): ``nonzero().tolist()`` for
  the routed experts, ``torch.where`` on a one-hot mask per expert, an index from the host list per adapter.

The two run alternately in one process (``--repeats`` rounds; the median of each), so a shared machine's load falls on
both alike; the ratio is per-expert / grouped. Their outputs and gradients are compared (bf16: the same products in
the same order, so they agree bit for bit, or to bf16 rounding). The syncs of one call (forward and backward) are
counted by op with ``benchmarks.common.sync_census`` (what would stop the host on a GPU; its docstring).

On a GPU (``--device cuda``) the modules and tokens live on the device and each call is timed between two device
synchronisations; ``--jsonl`` appends one record per layer and length as it finishes (``{"key", "ok", "device",
...}``), which benchmarks/gpu.sh hands back and ``benchmarks.gpu_results`` renders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.models import SIZES
from benchmarks.common.records import append_record, one_line

SECTION = "## MoE routed forward: host syncs and speed, grouped by expert vs per expert"
VARIANTS = ("per-expert", "grouped")
RANK, ALPHA, STD = 16, 32, 0.02
LAYERS: dict[str, dict[str, int]] = {
    "qwen3-30b-a3b": {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8},
    "moe-400m": {k: SIZES["moe-400m"][k] for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                                                   "num_experts_per_tok")},
    "tiny": {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
}  # fmt: skip


def build(layer: str, device: str = "cpu") -> tuple[Any, dict[str, list[Any]]]:
    """The experts module of ``LAYERS[layer]`` in bf16 and its LoRA adapters (``{weight name: [ExpertAdapter]}``),
    on ``device``."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from gym_lightning.models.experts import ExpertAdapter

    torch.manual_seed(0)
    with torch.device("meta"):
        experts = Qwen3MoeExperts(Qwen3MoeConfig(**LAYERS[layer]))
    experts = experts.to_empty(device=device).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, STD)
    adapters = {}
    for name in ("gate_up_proj", "down_proj"):
        num_experts, out_features, in_features = getattr(experts, name).shape
        a = (torch.randn(RANK * num_experts, in_features, device=device) * STD).requires_grad_()
        b = (torch.randn(out_features, RANK * num_experts, device=device) * STD).requires_grad_()
        adapters[name] = [ExpertAdapter(a, b, ALPHA / RANK)]
    return experts, adapters


def routing(layer: str, tokens: int, device: str = "cpu") -> tuple[Any, Any, Any]:
    """Seeded bf16 tokens ``[T, h]``, and the top-k experts and weights of a softmax over random router logits (drawn
    on the host: the same inputs on every device), on ``device``."""
    import torch

    c = LAYERS[layer]
    generator = torch.Generator().manual_seed(tokens)
    hidden_states = torch.randn(tokens, c["hidden_size"], generator=generator).bfloat16()
    logits = torch.randn(tokens, c["num_experts"], generator=generator)
    weights, index = logits.softmax(-1).topk(c["num_experts_per_tok"])
    inputs = hidden_states, index, (weights / weights.sum(-1, keepdim=True)).bfloat16()
    return tuple(tensor.to(device) for tensor in inputs)


def forwards() -> dict[str, Any]:
    from benchmarks.common.routed_reference import reference_route_experts
    from gym_lightning.models.experts import route_experts

    return {"per-expert": reference_route_experts, "grouped": route_experts}


def step(forward: Any, experts: Any, adapters: dict[str, list[Any]], inputs: tuple[Any, ...]) -> dict[str, Any]:
    """One forward + backward; the output and the gradients of the tokens, weights and factors (cleared)."""
    hidden_states, index, weights = (t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    out = forward(experts, hidden_states, index, weights, adapters)
    out.float().square().sum().backward()
    grads = {"out": out.detach(), "d tokens": hidden_states.grad, "d weights": weights.grad}
    for name, found in adapters.items():
        for factor in ("a", "b"):
            tensor = getattr(found[0], factor)
            grads[f"d {name}.{factor}"], tensor.grad = tensor.grad, None
    return grads


def synchronised(device: str) -> float:
    """The host clock once ``device`` has run what was queued (a CUDA device; the host clock on the CPU)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure(layer: str, tokens: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Both variants alternately, ``repeats`` rounds after one warm-up each; their seconds, syncs and agreement."""
    import torch

    from benchmarks.common.sync_census import SyncCensus

    experts, adapters = build(layer, device)
    inputs = routing(layer, tokens, device)
    variants = forwards()
    results: dict[str, Any] = {v: {"seconds": []} for v in VARIANTS}
    outputs = {}
    for variant, forward in variants.items():
        with SyncCensus() as census:
            outputs[variant] = step(forward, experts, adapters, inputs)
        results[variant]["syncs"] = {f"{kind}: {op}": n for (kind, op), n in sorted(census.counts.items())}
    for _ in range(repeats):
        for variant, forward in variants.items():
            start = synchronised(device)
            step(forward, experts, adapters, inputs)
            results[variant]["seconds"].append(synchronised(device) - start)
    for variant in VARIANTS:
        results[variant]["median_s"] = statistics.median(results[variant]["seconds"])
        results[variant]["min_s"] = min(results[variant]["seconds"])
    results["ratio"] = results["per-expert"]["median_s"] / results["grouped"]["median_s"]
    results["ratio_min"] = results["per-expert"]["min_s"] / results["grouped"]["min_s"]
    results["routed_experts"] = int(torch.unique(inputs[1]).numel())
    results["max_abs_diff"] = {
        key: float((outputs["grouped"][key].float() - value.float()).abs().max())
        for key, value in outputs["per-expert"].items()
    }
    return results


def render(results: dict[str, Any], device: str = "cpu") -> str:
    where = (
        "on this machine's 2 CPU cores (shared with other jobs: the ratios are the figures). A GPU's times are owed."
        if device == "cpu"
        else f"on {device}, each call between two device synchronisations (benchmarks/gpu.sh --part bench)."
    )
    lines = [
        SECTION, "",
        "`python -m benchmarks.routed_forward_speed` (see its docstring). One MoE layer's experts (bf16) with LoRA "
        "r=16 on both fused weights (fp32 factors), forward + backward of the routed experts alone on 1 x T tokens: "
        "`grouped` = `models.experts.route_experts` (pairs sorted by expert on the device, one read of the group "
        "bounds), `per-expert` = the forward before issue 55 (`benchmarks/common/routed_reference.py`). The two "
        "alternate in one process, one torch thread (`--threads`); median and fastest seconds " + where + " Syncs = "
        "ops of one call that stop the host on a GPU (`benchmarks/common/sync_census.py`: `nonzero`, reads such as "
        "`tolist` / `item`, `lift_fresh` = host data made a tensor, on a GPU a blocking copy to the device).",
        "",
        "| layer | T | routed experts | per-expert syncs | grouped syncs | per-expert (s) | grouped (s) | ratio | "
        "fastest: per-expert / grouped (s) | ratio | max abs diff (out, grads) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for key, result in results.items():
        layer, tokens = key.split("/")
        syncs = ["; ".join(f"{op} {n}" for op, n in result[v]["syncs"].items()) or "none" for v in VARIANTS]
        lines.append(
            f"| {layer} | {int(tokens):,} | {result['routed_experts']} | {syncs[0]} | {syncs[1]} | "
            f"{result['per-expert']['median_s']:.3f} | {result['grouped']['median_s']:.3f} | {result['ratio']:.2f} | "
            f"{result['per-expert']['min_s']:.3f} / {result['grouped']['min_s']:.3f} | {result['ratio_min']:.2f} | "
            f"{max(result['max_abs_diff'].values()):.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", default=["moe-400m", "qwen3-30b-a3b"], choices=list(LAYERS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds (the time is the median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: steadier on a shared machine)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "gym-routed-speed.json")
    parser.add_argument("--jsonl", type=Path, help="also append one record per layer and length here, as each ends")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    results, failed = {}, False
    for layer in args.layers:
        for tokens in args.tokens:
            key = f"{layer}/{tokens}"
            print(f"{key} on {args.device} ...", file=sys.stderr, flush=True)
            try:
                results[key] = measure(layer, tokens, args.repeats, args.device)
                record = {"key": key, "ok": True, "device": args.device, **results[key]}
            except Exception as err:  # recorded: one size that fails (memory) must not hide the others
                traceback.print_exc()
                failed, record = True, {"key": key, "ok": False, "device": args.device, "error": one_line(err)[:500]}
            if args.jsonl:
                append_record(args.jsonl, record)
            args.out.write_text(json.dumps(results, indent=1))
    section = render(results, args.device)
    print(section)
    if args.write_docs:
        write_section(SECTION, section)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
