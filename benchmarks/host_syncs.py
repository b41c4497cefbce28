"""Host syncs per quiet training step of ``gym fit``, every strategy x precision x world size, by owner; writes the
"Host syncs per quiet step" section of docs/benchmarks.md.

    python -m benchmarks.host_syncs --json /tmp/after.json                     # this tree
    git archive e2e4f84 | tar -x -C /tmp/before                                # an older tree ...
    python -m benchmarks.host_syncs --tree /tmp/before --json /tmp/before.json # ... measured by the same census
    python -m benchmarks.host_syncs --render /tmp/after.json --before /tmp/before.json --write-docs
    python -m benchmarks.host_syncs --static-graph-timing --json /tmp/static.json   # gym_ddp step time, both settings

Every run is configs/quickstart.yaml (the tiny Llama) as a user changes it on the command line: the strategy, the
precision, the world size, 12 optimizer steps of batch 4, ``log_every_n_steps=5``, no export. The census
(benchmarks/common/host_syncs.py: a ``TorchDispatchMode`` that sees what stops the host on CUDA, on CPU ranks) counts
every training batch; a quiet step is one that does not log (loggers, progress bar, ThroughputCallback's reads),
checkpoint, or come first. The counts are per rank (the larger of the two ranks), averaged over the quiet steps.
One extra row runs a tiny Qwen3-MoE folder (benchmarks/common/models.py) with LoRA on attention and on every expert
under gym_fsdp. Each world size's runs go through one launch (``benchmarks/workers/host_sync_worker.py``, under
``torchrun`` for 2 ranks), one fit after the other.

``--tree DIR`` measures the gym_lightning in DIR (its configs/ too) with this tree's census, so an older commit is
measured exactly as the current one. ``--static-graph-timing``: gym_ddp at 2 ranks with ``static_graph`` on and
off, alternating, the census off; the median optimizer-step time of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.host_syncs import HOST_READ, KINDS
from benchmarks.common.host_syncs import quiet_steps as quiet
from benchmarks.common.launch import child_env, python_module, torchrun_command
from benchmarks.common.models import make_family_folder
from benchmarks.common.paths import REPO_ROOT
from benchmarks.common.ratios import speed_ratio

SECTION = "## Host syncs per quiet step"
WORKER = "benchmarks.workers.host_sync_worker"
STEPS, LOG_EVERY, THROUGHPUT_WARMUP = 12, 5, 2  # the quickstart's ThroughputCallback warm-up
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
# name -> (flags, world sizes, precisions)
STRATEGIES: dict[str, tuple[list[str], tuple[int, ...], tuple[str, ...]]] = {
    "gym_ddp": (["--trainer.strategy=gym_ddp"], (1, 2), PRECISIONS),
    "gym_ddp static_graph=false": (
        ["--trainer.strategy=gym_lightning.strategies.GymDDPStrategy", "--trainer.strategy.static_graph=false"],
        (2,),
        PRECISIONS,
    ),
    "ddp (Lightning's)": (["--trainer.strategy=ddp"], (2,), PRECISIONS),
    "gym_fsdp": (["--trainer.strategy=gym_fsdp"], (1, 2), PRECISIONS),
    "zero1": (["--trainer.strategy=zero1"], (1, 2), PRECISIONS),
    "zero2": (["--trainer.strategy=zero2"], (1, 2), PRECISIONS),
    "zero3": (["--trainer.strategy=zero3"], (1, 2), PRECISIONS),
    "zero2_offload": (["--trainer.strategy=zero2_offload"], (1, 2), PRECISIONS),
    "zero3_offload": (["--trainer.strategy=zero3_offload"], (1, 2), PRECISIONS),
    # Padding-free packed rows (no attention_mask, position_ids restarting per document): transformers' padding-mask
    # check gives way to its packed-sequence check, one read per forward as well.
    "gym_ddp, packed rows": (
        ["--trainer.strategy=gym_ddp", "--data.packing=true", "--data.max_seq_length=64"],
        (1, 2),
        ("32-true",),
    ),
}
MOE = "gym_fsdp, tiny Qwen3-MoE + expert LoRA"
MOE_LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "target_parameters": ["all-experts"]}
OWNERS = ("gym_lightning", "lightning", "transformers", "peft", "deepspeed", "torch", "other")
SHORT = {"gym_lightning": "gym", "lightning": "L", "transformers": "tf", "deepspeed": "ds", "peft": "peft"}


def quiet_steps() -> set[int]:
    return quiet(STEPS, LOG_EVERY, None, set(range(THROUGHPUT_WARMUP - 1, STEPS, LOG_EVERY)))


# ----------------------------------------------------------------------------------------------------- running
def precision_flags(precision: str, strategy: list[str]) -> list[str]:
    """``--trainer.precision``, except 16-mixed outside DeepSpeed: Lightning's Trainer runs that flag as bf16-mixed on
    CPU, so it goes in as the plugin instance (autocast fp16 + a CPU ``GradScaler``), as tests/strategies/
    test_clipping.py passes it. DeepSpeed gets the flag, and refuses it on CPU ranks (the table's note says so)."""
    if precision != "16-mixed" or any("zero" in flag for flag in strategy):
        return [f"--trainer.precision={precision}"]
    # A first scale of 2^8, as the test's: the default 2^16 overflows the tiny model's fp16 gradients, and
    # NonFiniteGuard(action="stop") ends the run at the first overflow the scaler would have skipped.
    scaler = {"class_path": "torch.amp.GradScaler", "init_args": {"device": "cpu", "init_scale": 256.0}}
    plugin = {"class_path": "lightning.pytorch.plugins.precision.MixedPrecision"}
    plugin["init_args"] = {"precision": "16-mixed", "device": "cpu", "scaler": scaler}
    return ["--trainer.precision=null", f"--trainer.plugins={json.dumps([plugin])}"]


def fit_args(name: str, strategy: list[str], precision: str, world: int, root: Path) -> list[str]:
    """``gym fit`` flags of one case: the quickstart, shortened, on ``world`` CPU ranks."""
    return [
        "--config", "configs/quickstart.yaml", *strategy, f"--trainer.devices={world}",
        *precision_flags(precision, strategy), f"--trainer.max_steps={STEPS}",
        f"--trainer.log_every_n_steps={LOG_EVERY}", "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root / name}", "--export.output_dir=null", "--data.batch_size=4",
    ]  # fmt: skip


def moe_args(folder: Path, precision: str, world: int, root: Path) -> list[str]:
    name = f"moe--{precision}--{world}"
    return [
        *fit_args(name, ["--trainer.strategy=gym_fsdp"], precision, world, root),
        f"--model.model={folder}", f"--model.tokenizer={folder}", f"--model.lora={json.dumps(MOE_LORA)}",
        '--model.config_overrides={"output_router_logits": true}',
    ]  # fmt: skip


def launch(tree: Path, cases: list[dict[str, Any]], world: int, out: Path, census: bool = True) -> None:
    """Run ``cases`` in one launch of ``world`` ranks of the worker, gym_lightning imported from ``tree``."""
    spec = out / f"spec-{world}-{int(time.time() * 1000)}.json"
    spec.write_text(json.dumps({"out": str(out), "cases": cases, "census": census, "keep_going": True}))
    env = child_env(tree)  # the tree's gym_lightning first, then this repository's benchmarks (the census)
    command = torchrun_command(world, WORKER, spec) if world > 1 else python_module(WORKER, spec)
    log = out / f"launch-{world}.log"
    with log.open("a") as file:
        proc = subprocess.run(command, cwd=tree, env=env, stdout=file, stderr=file)
    if proc.returncode != 0:
        print(f"launch of {len(cases)} cases at world size {world} exited {proc.returncode}; see {log}")


def matrix(tree: Path, out: Path, only: list[str] | None) -> dict[str, Any]:
    """Every case of the matrix, run and read back: ``{case: {"meta": ..., "ranks": [events...]}}``."""
    folder = out / "qwen3-moe"
    if not folder.exists():
        make_family_folder("qwen3_moe", folder)
    cases: dict[int, list[dict[str, Any]]] = defaultdict(list)
    meta: dict[str, dict[str, Any]] = {}
    for label, (flags, worlds, precisions) in STRATEGIES.items():
        for world in worlds:
            for precision in precisions:
                name = case_name(label, precision, world)
                meta[name] = {"strategy": label, "precision": precision, "world": world}
                cases[world].append({"name": name, "args": fit_args(name, flags, precision, world, out)})
    for world in (1, 2):
        for precision in ("32-true", "bf16-mixed"):
            name = f"moe--{precision}--{world}"
            meta[name] = {"strategy": MOE, "precision": precision, "world": world}
            cases[world].append({"name": name, "args": moe_args(folder, precision, world, out)})
    for world, items in cases.items():
        selected = [case for case in items if not only or set(only) & set(case["name"].split("--"))]
        if selected:
            launch(tree, selected, world, out)
    return {name: {"meta": info, "ranks": read_ranks(out, name, info["world"])} for name, info in meta.items()}


def case_name(label: str, precision: str, world: int) -> str:
    """A file name for a case: ``gym_ddp_static_graph-false--bf16-mixed--2``."""
    name = f"{label}|{precision}|{world}".replace(" ", "_").replace("=", "-")
    return "".join(c for c in name if c.isalnum() or c in "_-|.").replace("|", "--")


def read_ranks(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for r in range(world) if (path := out / f"{name}.{r}.json").exists()]


# ----------------------------------------------------------------------------------------------------- reading
def per_quiet_step(ranks: list[dict[str, Any]], kinds: tuple[str, ...]) -> tuple[Counter[str], Counter[str]]:
    """Syncs per quiet step by owner and by ``owner op @ site`` (the rank with most), over ``kinds``."""
    quiet = quiet_steps()
    best: tuple[Counter[str], Counter[str]] = (Counter(), Counter())
    for rank in ranks:
        events = [e for e in rank["events"] if e["step"] in quiet and e["kind"] in kinds]
        owners = Counter(e["owner"] for e in events)
        sites = Counter(f"{e['owner']}: {e['op']} @ {e['chain'][-1] if e['chain'] else '?'}" for e in events)
        if sum(owners.values()) >= sum(best[0].values()):
            best = (owners, sites)
    n = len(quiet)
    return Counter({k: v / n for k, v in best[0].items()}), Counter({k: v / n for k, v in best[1].items()})


def cell(owners: Counter[str] | None) -> str:
    """``total (gym a · L b · tf c ...)``; ``-`` when the case did not run."""
    if owners is None:
        return "-"
    total = sum(owners.values())
    parts = [f"{SHORT.get(o, o)} {round(owners[o], 1):g}" for o in OWNERS if owners.get(o)]
    return f"**{round(total, 1):g}**" + (f" ({' · '.join(parts)})" if parts else "")


def owners_of(result: dict[str, Any] | None) -> Counter[str] | None:
    if not result or not result["ranks"] or any(r.get("error") for r in result["ranks"]):
        return None
    return per_quiet_step(result["ranks"], KINDS)[0]


def error_of(result: dict[str, Any] | None) -> str:
    errors = [r["error"] for r in (result or {}).get("ranks", []) if r.get("error")]
    return errors[0] if errors else ""


# ----------------------------------------------------------------------------------------------------- rendering
# What each remaining site is (matched on ``owner: op @ file:line``); a site missing here shows as it is.
EXPLAINED = {
    "transformers/masking_utils.py:292": "transformers' padding-mask check (`fast_all(padding_mask)`: can the causal "
    "mask be skipped), once per forward; a plain loop pays it too",
    "transformers/masking_utils.py:761": "transformers' packed-sequence check (`find_packed_sequence_indices`) in its "
    "place for padding-free packed rows (position_ids, no attention_mask), once per forward",
    "training_epoch_loop.py:261": "Lightning's SIGTERM broadcast at 2 ranks (`_broadcast_sigterm_tensor`): a host "
    "flag made a device tensor every batch ...",
    "training_epoch_loop.py:269": "... and read back (`.item()`)",
    "deepspeed/runtime/utils.py:233": "DeepSpeed's `is_invalid_grad_norm` (a `bool` of the global gradient norm, to "
    "skip a bad step); a plain DeepSpeed loop pays it",
    "stage_1_and_2.py:3248": "DeepSpeed's bf16 overflow check (`overflow_gpu[0].item()`)",
    "stage_1_and_2.py:1792": "DeepSpeed's offload overflow check, one per gradient (`_has_inf_or_nan`)",
    "stage_1_and_2.py:1929": "DeepSpeed's offload gradient norm, one `.item()` per parameter",
    "stage3.py:1989": "DeepSpeed's ZeRO-3 offload gradient norm (`float(total_norm)`)",
    "deepspeed/runtime/utils.py:887": "DeepSpeed's `mask_nan_or_inf_with_val_inplace` (`torch.tensor(-1.0, device)`)",
    "callbacks/nonfinite.py": "NonFiniteGuard reading its flags at once where the optimizer cannot skip a step "
    "itself (DeepSpeed's engine, a GradScaler under 16-mixed): callbacks/nonfinite.py, not changed here",
    "models/experts.py": "the routed expert forward (issue 55 finding 3), not changed here",
}


def render(after: dict[str, Any], before: dict[str, Any] | None, static: dict[str, Any] | None = None) -> str:
    """The docs section: one row per strategy x precision x world size, before and after, what remains, the
    reducer's host reads and the static graph's step time."""
    lines = [
        SECTION,
        "",
        "Syncs per quiet optimizer step on CPU ranks, counted as CUDA would pay them by the census of "
        "`benchmarks/common/host_syncs.py` (its docstring says how, and what a CPU run cannot show): device reads "
        "(`item`, `bool`, `tolist`...), data-dependent shapes (`nonzero`, masked indexing...), copies of host data "
        "to the device and explicit waits. `gym fit` of configs/quickstart.yaml's tiny Llama, 12 steps of batch 4, "
        "`log_every_n_steps=5`; a quiet step neither logs, checkpoints nor comes first (6 of the 12); per rank, the "
        "larger of two. Owners: gym = gym_lightning, L = Lightning, tf = transformers, ds = DeepSpeed, torch = torch "
        "on its own behalf (autograd engine, optimizers, DDP, FSDP2). 16-mixed is Lightning's `MixedPrecision` "
        "plugin with a CPU `GradScaler` (the Trainer runs the `16-mixed` flag as bf16 on CPU); `-`: refused (below). "
        "Before: e2e4f84; after: this branch. `python -m benchmarks.host_syncs` (its docstring has the commands).",
        "",
        "| strategy | precision | ranks | before | after |",
        "|---|---|---:|---|---|",
    ]
    notes: dict[str, str] = {}
    for name, result in after.items():
        meta = result["meta"]
        new = owners_of(result)
        if new is None and (error := error_of(result)):
            notes[f"{meta['strategy']} {meta['precision']}"] = error.removeprefix("gym_lightning: error: ")
        old = cell(owners_of((before or {}).get(name))) if before else "n/a"
        lines.append(f"| {meta['strategy']} | {meta['precision']} | {meta['world']} | {old} | {cell(new)} |")
    lines += ["", "What remains (after), per site:", ""]
    seen: dict[str, set[str]] = defaultdict(set)
    for result in after.values():
        if owners_of(result) is not None:
            for site in per_quiet_step(result["ranks"], KINDS)[1]:
                seen[site].add(result["meta"]["strategy"])
    for site, where in sorted(seen.items(), key=lambda item: item[0]):
        text = next((why for key, why in EXPLAINED.items() if key in site), "")
        lines.append(f"- `{site}`{': ' + text if text else ''} ({'; '.join(sorted(where))})")
    reads = {per_quiet_step(r["ranks"], (HOST_READ,))[0].total() for r in after.values() if r["ranks"]} - {0}
    if reads:
        shown = " / ".join(f"{n:g}" for n in sorted(reads))
        lines += [
            "",
            f"Not syncs, counted apart: under gym_ddp's static graph DDP's reducer reads its `local_used_map_` "
            f"once per parameter at the end of backward ({shown} per step here; reducer.cpp `finalize_bucket_dense`). "
            "That map is a host tensor on CUDA too (`initialize_local_used_map`), so these reads wait for no device: "
            "the first census's \"29 syncs inside backward\" under gym_ddp (it took every CPU tensor for a device's).",
        ]
    lines += ["", *[f"- Not run: {what}: {error}" for what, error in sorted(notes.items())]] if notes else []
    return "\n".join(lines) + "\n" + (render_static(static) if static else "")


def render_static(static: dict[str, Any]) -> str:
    """The static graph's step time, both settings side by side."""
    lines = [
        "",
        "gym_ddp's static graph, on and off, side by side (2 CPU ranks, the tiny Llama at batch 4 x 32, two DDP "
        "models stepping alternately; throughput ratio static / not from paired steps, 95 % bootstrap interval; "
        "`python -m benchmarks.host_syncs --static-graph-timing`, on a machine other jobs shared). An interval that "
        "holds 1 is no measurable difference: the static graph's per-parameter host reads cost nothing a step shows, "
        "and it saves nothing per step on a graph whose parameters all get gradients; gym_ddp keeps it for the "
        "unused parameters and reentrant checkpointing it supports (`strategies.ddp.resolve_static_graph`).",
        "",
        "| layers | parameters | step, static (ms) | step, not (ms) | static / not |",
        "|---:|---:|---:|---:|---|",
    ]
    for depth, result in static.items():
        median = result["median_ms"]
        lines.append(
            f"| {depth} | {result['parameters']} | {median['true']:.1f} | {median['false']:.1f} | "
            f"{result['ratio']:.3f} [{result['low']:.3f}, {result['high']:.3f}] |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------- static graph
def static_graph_worker(out: Path, steps: int, repeats: int, layers: list[int]) -> None:
    """Under torchrun: gym_ddp's DDP (``gradient_as_bucket_view``) of the tiny Llama with ``static_graph`` on and
    off, two models on the same ranks stepping alternately (forward, backward, fused AdamW step), so that every
    pair of steps ran under the same load; rank 0 writes each side's step seconds per repeat."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gym_lightning import CausalLMModule

    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for depth in layers:
        runs: dict[str, list[list[float]]] = {"true": [], "false": []}
        for _ in range(repeats):
            sides = {}
            for static in (True, False):
                torch.manual_seed(0)
                module = CausalLMModule("tiny-llama", config_overrides={"num_hidden_layers": depth})
                module.configure_model()
                model = DistributedDataParallel(module.model, static_graph=static, gradient_as_bucket_view=True)
                sides[str(static).lower()] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
            ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(1))
            times: dict[str, list[float]] = {"true": [], "false": []}
            for step in range(steps + 3):  # 3 warm-up steps: the static graph's first (delayed) all-reduce
                for name in ("true", "false") if step % 2 else ("false", "true"):
                    model, optimizer = sides[name]
                    start = time.perf_counter()
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=False)
                    if step >= 3:
                        times[name].append(time.perf_counter() - start)
            for name in runs:
                runs[name].append(times[name])
        params = sum(1 for p in sides["true"][0].parameters() if p.requires_grad)
        results[str(depth)] = {"parameters": params, **runs}
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def static_graph_timing(out: Path, repeats: int, steps: int, layers: list[int]) -> dict[str, Any]:
    """``static_graph_worker`` on 2 CPU ranks; the paired-step throughput ratio static / not, per model depth."""
    path = out / "static_graph.json"
    launch = torchrun_command(2, __spec__.name, "--static-graph-worker", path, "--steps", str(steps))
    launch += ["--repeats", str(repeats), "--layers", *map(str, layers)]
    subprocess.run(launch, cwd=REPO_ROOT, env=child_env(), check=True)
    results = json.loads(path.read_text())
    for depth, result in results.items():
        ratio, low, high = speed_ratio(result["true"], result["false"], paired_steps=True)  # static over not
        median = {name: statistics.median(t for r in result[name] for t in r) * 1e3 for name in ("true", "false")}
        result.update(ratio=ratio, low=low, high=high, median_ms=median)
        print(
            f"{depth} layers ({result['parameters']} parameters): step {median['true']:.1f} ms static, "
            f"{median['false']:.1f} ms not; throughput static / not {ratio:.3f} [{low:.3f}, {high:.3f}]"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=REPO_ROOT, help="the gym_lightning tree to measure")
    parser.add_argument("--json", type=Path, help="write the raw results here (with --only: update them)")
    parser.add_argument("--render", type=Path, help="render this raw result (--json of an earlier run)")
    parser.add_argument("--before", type=Path, help="raw results of the tree before (--json of its run)")
    parser.add_argument("--static", type=Path, help="the --json of a --static-graph-timing run, for the section")
    parser.add_argument("--only", nargs="*", help="run only these cases: a strategy, precision or world size")
    parser.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace {SECTION!r} in docs/benchmarks.md")
    parser.add_argument("--static-graph-timing", action="store_true", help="gym_ddp step time, static_graph on/off")
    parser.add_argument("--static-graph-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, nargs="*", default=[3, 12])
    args = parser.parse_args()
    if args.static_graph_worker:
        static_graph_worker(args.static_graph_worker, args.steps, args.repeats, args.layers)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="host_syncs-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.static_graph_timing:
        results = static_graph_timing(workdir, args.repeats, args.steps, args.layers)
        if args.json:
            args.json.write_text(json.dumps(results))
        return
    results = json.loads(args.render.read_text()) if args.render else matrix(args.tree.resolve(), workdir, args.only)
    if args.only and args.json and args.json.exists():  # a subset run updates the cases it ran, keeps the others
        results = {**json.loads(args.json.read_text()), **{n: r for n, r in results.items() if r["ranks"]}}
    if args.json:
        args.json.write_text(json.dumps(results))
    before = json.loads(args.before.read_text()) if args.before else None
    section = render(results, before, json.loads(args.static.read_text()) if args.static else None)
    print(section)
    if args.write_docs:
        write_section(SECTION, section)


if __name__ == "__main__":
    main()
