"""gym_ddp's compiled layers at world size 2: graphs per decoder layer and step time, for each dynamo DDP mode.

    python -m benchmarks.compiled_ddp                    # Llama layers of hidden 512 / MLP 2,048, 2 CPU ranks
    python -m benchmarks.compiled_ddp --hidden 128 --intermediate 1024 --steps 4 --backend aot_eager  # quick
    python -m benchmarks.compiled_ddp --write-docs

A Llama of ``--layers`` decoder layers (fp32) on 2 gloo ranks, each layer's forward compiled by
``models.compiled.compile_layers`` (``dynamic=True``, ``--backend``), wrapped in ``DistributedDataParallel`` (25 MiB
buckets, as gym_ddp builds it: ``gradient_as_bucket_view``), trained with AdamW on 1 x ``--seq`` random tokens per
rank, under each of dynamo's DDP modes (``CompileArgs.ddp_buckets``):

- ``ddp_optimizer`` (torch's default, ``ddp_buckets=True``): dynamo splits each compiled layer's graph at DDP's bucket
  boundaries, so that a bucket's all-reduce can start before the layer's whole backward ends;
- ``no_optimization`` (gym's default): one graph per layer; its gradients come ready when its backward ends.

(``python_reducer`` modes need compiled autograd, which gym does not turn on.) Graphs per layer = the graphs the
backend compiled for the layers' one dynamo graph (``benchmarks.common.ddp_graphs``: the DDP optimizer's buckets);
step time = the median over the steps after the first (which compiles), of rank 0. The modes run in fresh rank
pairs, alternately, ``--rounds`` times each: the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.launch import child_env, init_gloo, python_module, spawn_gloo
from benchmarks.common.paths import REPO_ROOT

SECTION = "## gym_ddp + compile: graphs per layer and step time for each dynamo DDP mode"
MODES = {"ddp_optimizer": True, "no_optimization": False}  # mode -> CompileArgs.ddp_buckets


def _rank(rank: int, port: int, args: argparse.Namespace, mode: str, out: str) -> None:
    """One rank: build, compile, wrap, train; rank 0 writes its step times and graph counts to ``out``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.common.ddp_graphs import graph_counts
    from gym_lightning.models.compiled import CompileArgs, compile_layers

    init_gloo(rank, 2, port)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers}
    config = LlamaConfig(vocab_size=1024, num_attention_heads=args.hidden // 64, num_key_value_heads=2, **shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    compile_layers(model, CompileArgs(backend=f"counting_{args.backend}", ddp_buckets=MODES[mode]))
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    ids = torch.randint(1024, (1, args.seq), generator=torch.Generator().manual_seed(rank))
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        ddp(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, **graph_counts()}))
    dist.destroy_process_group()


def pair(args: argparse.Namespace, mode: str, out: Path) -> None:
    """Both ranks of one run (``--role pair``), started by ``torch.multiprocessing.spawn``."""
    spawn_gloo(_rank, 2, (args, mode, str(out)))


def run(args: argparse.Namespace, mode: str, out: Path) -> dict[str, Any]:
    """One run of ``mode`` in a fresh process (its ranks' dynamo state their own); ``{"failed": ...}`` if it
    failed or ran past ``--timeout``."""
    settings = [f"--{k}={getattr(args, k)}" for k in ("hidden", "intermediate", "layers", "seq", "steps", "threads")]
    command = python_module(__spec__.name, "--role", "pair", "--modes", mode, "--out", out, *settings,
                            f"--backend={args.backend}")  # fmt: skip
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=child_env(threads=None), capture_output=True, text=True,
                              timeout=args.timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"failed": f"timeout {args.timeout} s"}
    if done.returncode != 0 or not out.exists():
        return {"failed": f"exit {done.returncode}: {done.stderr[-500:]}"}
    return json.loads(out.read_text())


def render(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    h = args.hidden  # q, o: h x h; k, v: h x 128 (2 heads of 64); gate, up, down: h x I
    layer_mib = 4 * (2 * h * h + 2 * h * 128 + 3 * h * args.intermediate) / 2**20
    lines = [
        SECTION, "",
        f"`python -m benchmarks.compiled_ddp` (see its docstring): a Llama of {args.layers} decoder layers, hidden "
        f"{args.hidden}, MLP {args.intermediate} ({layer_mib:.0f} MiB of fp32 gradients per layer against DDP's 25 "
        f"MiB buckets), 2 gloo CPU ranks, each layer compiled by `compile_layers` (`{args.backend}`, dynamic), "
        f"1 x {args.seq} tokens per rank, {args.steps} steps, {args.threads} thread(s) per rank; the modes in fresh "
        f"rank pairs, alternately, {args.rounds} rounds. Graphs per layer = graphs the backend compiled for the "
        "layers' dynamo graph; step = median seconds of the steps after the first; compile = the first step. This "
        "machine's 2 cores were shared with other jobs: compare the modes, not the seconds. A GPU's figures (NCCL, "
        "where the overlap the split buys is real) are owed.",
        "",
        "| dynamo DDP mode | `compile.ddp_buckets` | graphs per layer | step (s), per round | compile step (s) |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for mode, all_runs in results.items():
        runs = [run for run in all_runs if "failed" not in run]
        if not runs:
            lines.append(f"| `{mode}` | {MODES[mode]} | failed: {all_runs[0]['failed'][:80]} | | |")
            continue
        pieces = sorted({p for run in runs for p in run["pieces"]})
        steps = ", ".join(f"{statistics.median(run['seconds'][1:]):.3f}" for run in runs)
        first = ", ".join(f"{run['seconds'][0]:.1f}" for run in runs)
        lines.append(f"| `{mode}` | {MODES[mode]} | {'/'.join(map(str, pieces))} | {steps} | {first} |")
    lines += [
        "",
        "Why gym's default is one graph per layer (`compile.ddp_buckets: false`, `models/compiled.py`): dynamo's DDP "
        "optimizer exists for a whole-model graph, whose gradients would all come ready at the end of one backward, "
        "leaving DDP nothing to overlap; it cuts the graph where DDP's buckets fill (the first at 1 MiB, then every "
        "25 MiB). gym compiles each decoder layer on its own, so a layer's gradients already come ready when its "
        "backward ends and DDP reduces them during the next layer's backward: the split only moves that point "
        "inside the layer, for the price of more graphs per layer (fewer fusions, more compiles; a Qwen3-1.7B "
        "layer, 192 MiB of fp32 gradients, would be about 5: each of its 48 MiB MLP matrices fills a bucket alone). "
        "The modes compute the same. Where the gain is real (a slow interconnect, large layers, few of them) "
        "`ddp_buckets: true` restores torch's default; a GPU measurement of both is owed.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-compiled-ddp")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--render-only", action="store_true", help="the table from --workdir's results.json")
    parser.add_argument("--role", choices=["main", "pair"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "pair":
        pair(args, args.modes[0], args.out)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    if args.render_only:
        results = json.loads((args.workdir / "results.json").read_text())
    for round_ in range(0 if args.render_only else args.rounds):
        for mode in args.modes:
            print(f"round {round_ + 1}: {mode} ...", file=sys.stderr, flush=True)
            results[mode].append(run(args, mode, args.workdir / f"{mode}-{round_}.json"))
            (args.workdir / "results.json").write_text(json.dumps(results, indent=1))
    section = render(results, args)
    print(section)
    if args.write_docs:
        write_section(SECTION, section)


if __name__ == "__main__":
    main()
