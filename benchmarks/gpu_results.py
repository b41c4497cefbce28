"""benchmarks/gpu.sh's results: the JSON lines each part writes merged into results.json, the host-sync table, and
the GPU section of docs/benchmarks.md.

    python -m benchmarks.gpu_results collect --dir DIR [--meta JSON]   # DIR/results.json (gpu.sh's last step)
    python -m benchmarks.gpu_results syncs --dir DIR                    # the host-sync table, also DIR/host_syncs.md
    python -m benchmarks.run --sections gpu                             # DIR (benchmarks/results/gpu) -> the docs

The folder (``$OUT/gpu`` on the device machine) holds what each part wrote as it went, one JSON object per line:
``checks.jsonl`` (``--part checks``: one record per test of tests/gpu, written by tests/gpu/conftest.py),
``bench.jsonl`` (``--part bench``: one record per run of benchmarks/workers/gpu_bench.py) and ``routed.jsonl``
(``--part bench``: benchmarks/routed_forward_speed.py on the device). ``results.json`` is ``{"meta", "checks",
"runs", "host_syncs", "routed", "failed"}``; a part it lacks (a run killed before it was written, or the other part's
device call) is read from the JSON lines beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.paths import BENCH_DIR, REPO_ROOT
from benchmarks.common.records import read_records
from benchmarks.workers import gpu_bench as bench
from gym_lightning.callbacks.reports import markdown_table

DEFAULT_DIR = BENCH_DIR / "results" / "gpu"
PRECISIONS = ("bf16-mixed", "32-true", "16-mixed")
SHORT = {"gym_lightning": "gym", "lightning": "L", "transformers": "tf", "deepspeed": "ds"}


# --------------------------------------------------------------------------------------------- merging
def merge_runs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry per run that has a record, in ``STRATEGIES`` order: the medians over its successful rounds with
    their spread, its tokens/s ratio to the plain loop paired round by round (median, min, max), to its Lightning
    peer and a warm compile's to the cold one; else its last error or skip."""
    good = {name: _good(records, name) for name in bench.STRATEGIES}
    merged: dict[str, Any] = {}
    for name in bench.STRATEGIES:
        found = [r for r in records if r.get("strategy") == name]
        if not found:
            continue
        if not good[name]:
            merged[name] = {key: found[-1][key] for key in ("error", "skipped") if key in found[-1]}
            merged[name] = merged[name] or {"error": "no result"}
            continue
        entry = _medians(good[name])
        if name != "plain" and good["plain"]:
            entry["vs_plain"] = _paired_ratios(good[name], good["plain"], "tokens_per_sec")
            entry["vs_plain"]["peak"] = _ratio(entry["peak_memory_bytes"], _medians(good["plain"])["peak_memory_bytes"])
        if (peer := bench.LIGHTNING_PEERS.get(name)) and good[peer]:
            theirs = _medians(good[peer])
            entry["vs_peer"] = {"peer": peer} | {
                key: _ratio(entry[field], theirs[field])
                for key, field in (("tokens_per_sec", "tokens_per_sec"), ("peak", "peak_memory_bytes"))
            }
        if (cold := bench.COLD_COMPILE.get(name)) and good[cold]:
            entry["compile_vs_cold"] = _ratio(entry["compile_seconds"], _medians(good[cold])["compile_seconds"])
        merged[name] = entry
    return merged


def _good(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("strategy") == name and r.get("ok") and r.get("tokens_per_sec")]


def _medians(good: list[dict[str, Any]]) -> dict[str, Any]:
    """The last successful round's record with ``MEDIAN_KEYS`` replaced by their medians over the rounds;
    ``rounds``: tokens/s of each round, in order."""
    entry = dict(good[-1])
    for key in bench.MEDIAN_KEYS:
        values = [r[key] for r in good if r.get(key) is not None]
        entry[key] = statistics.median(values) if values else None
    entry["rounds"] = [r["tokens_per_sec"] for r in good]
    return entry


def _paired_ratios(ours: list[dict[str, Any]], plain: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """``ours / plain`` for ``key``: with several rounds (interleaved), each over the plain loop's round of the same
    number (the one run next to it), over the plain loop's median where it has no such round; one round (a run of
    its own, later in the bench) over the median. Median, min, max, how many, how many paired."""
    by_round = {r.get("round"): r[key] for r in plain}
    median = statistics.median(by_round.values())
    paired = by_round if len(ours) > 1 else {}
    ratios = [r[key] / paired.get(r.get("round"), median) for r in ours]
    figures = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
    return figures | {"paired_rounds": sum(r.get("round") in paired for r in ours)}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def collect(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``folder``/results.json from the JSON lines there (a file that does not exist is a part that did not run:
    no checks, or no runs), with the host-sync table written beside it as host_syncs.md."""
    checks, bench_records = read_records(folder / "checks.jsonl"), read_records(folder / "bench.jsonl")
    payload = {"meta": meta, "checks": checks, "runs": merge_runs(bench_records) if bench_records else {}}
    payload["host_syncs"] = host_sync_cells(checks)
    payload["routed"] = read_records(folder / "routed.jsonl")
    payload["failed"] = [r["check"] for r in checks if r.get("ok") is False]
    payload["failed"] += [f"bench/{r['strategy']}" for r in bench_records if r.get("ok") is False]
    payload["failed"] += [f"routed/{r['key']}" for r in payload["routed"] if r.get("ok") is False]
    (folder / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    if payload["host_syncs"]:
        (folder / "host_syncs.md").write_text(host_sync_table(payload["host_syncs"]))
    return payload


def load(folder: Path) -> dict[str, Any] | None:
    """results.json of ``folder``, its missing parts filled from the JSON lines beside it; ``None`` when nothing
    ran there."""
    path = folder / "results.json"
    parts = [folder / name for name in ("checks.jsonl", "bench.jsonl", "routed.jsonl")]
    if not path.is_file() and not any(p.is_file() for p in parts):
        return None
    data = json.loads(path.read_text()) if path.is_file() else {"meta": {"note": "partial: no results.json"}}
    if not data.get("checks"):
        data["checks"] = read_records(parts[0])
    if not data.get("runs") and parts[1].is_file():
        data["runs"] = merge_runs(read_records(parts[1]))
    if not data.get("routed"):
        data["routed"] = read_records(parts[2])
    data["host_syncs"] = data.get("host_syncs") or host_sync_cells(data["checks"])
    return data


# --------------------------------------------------------------------------------------------- host syncs
def host_sync_cells(checks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{strategy: {precision: record}}`` of tests/gpu/test_gpu_host_syncs.py's records (``host_syncs/S/P``)."""
    cells: dict[str, dict[str, Any]] = {}
    for record in checks:
        parts = record.get("check", "").split("/")
        if len(parts) == 3 and parts[0] == "host_syncs":
            cells.setdefault(parts[1], {})[parts[2]] = record
    return cells


def _sync_cell(record: dict[str, Any] | None) -> str:
    if record is None:
        return "-"
    if record.get("ok") is None:
        return "skipped"
    figures = record.get("figures") or {}
    if "per_quiet_step" not in figures:
        return "failed: " + str(record.get("detail", ""))[:80].replace("|", "/")
    owners = " · ".join(f"{SHORT.get(o, o)} {n:.3g}" for o, n in figures["by_owner"].items() if n)
    flag = "" if record.get("ok") else " ❌"
    return f"**{figures['per_quiet_step']:.3g}**" + (f" ({owners})" if owners else "") + flag


def host_sync_table(cells: dict[str, dict[str, Any]]) -> str:
    """Syncs per quiet step, strategy x precision, with each owner's share (gym = gym_lightning, L = Lightning,
    tf = transformers, ds = DeepSpeed); ❌ where gym_lightning's exceed the test's budget."""
    any_figures = next((r["figures"] for row in cells.values() for r in row.values() if r.get("figures")), {})
    rows = [[strategy, *(_sync_cell(row.get(p)) for p in PRECISIONS)] for strategy, row in cells.items()]
    lines = [
        f"Host syncs per quiet training step (`gym fit` of the shipped config on one device; counted by "
        f"{any_figures.get('counted_by', 'tests/gpu/test_gpu_host_syncs.py')}; quiet steps "
        f"{any_figures.get('quiet_steps', '?')}; tests/gpu/test_gpu_host_syncs.py):",
        "",
        markdown_table(["strategy", *PRECISIONS], rows),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- rendering
def gpu_section(path: Path) -> str:
    """The device check from benchmarks/gpu.sh's results folder (``path``: its results.json), or a plain statement
    that it has not been run."""
    data = load(path.parent)
    if data is None:
        return GPU_NOT_RUN.format(folder=_shown(path.parent))
    return render_gpu(data)


GPU_NOT_RUN = (
    "**Not run yet.** No GPU has been available to this project so far. `benchmarks/gpu.sh` is prepared for one "
    "GPU (H100 or H200), in two parts, each one device call. `--part checks` (under 4 minutes): `python -m pytest "
    "tests/gpu`: correctness of every strategy on CUDA (bf16-mixed training against fp32, FSDP CPU offload, "
    "validation metrics, the HF export, equal initial weights, the chunked loss, QLoRA, DDP compression hooks), "
    "`gym fit` of every shipped config that runs on one GPU (ddp, fsdp, zero1, zero2, zero3, zero3_offload, and qlora "
    "on a local random-weight folder) with each export reloaded, and the host syncs per quiet training step of "
    'every strategy x precision under `torch.cuda.set_sync_debug_mode("warn")`. `--part bench` (under 6 minutes): '
    "the Qwen3-1.7B shape (random weights, fp32 parameters, bf16 autocast, SDPA, fused AdamW, micro-batch 4 x 2048): "
    "a plain PyTorch loop, `gym_ddp` and `gym_fsdp` three times interleaved (the wrapper tax: ratio medians and "
    "min-max), the fast path (`CausalLMModule(compile=True)` under gym_fsdp and gym_ddp, the plain loop with the "
    "same per-layer compile, Liger kernels where liger-kernel imports) with its cold compile time and a second "
    "process's warm-cache one, `zero3` beside Lightning's `DeepSpeedStrategy(stage=3)` (the ZeRO-3 settings rule), "
    "ZeRO-1/2, each beside the planner's predicted peak and tokens/s; and the MoE routed forward grouped by expert "
    "against the per-expert one (`benchmarks/routed_forward_speed.py` on the device). It writes `{folder}/`; "
    "`python -m benchmarks.run --sections gpu` renders it here. Targets (issue 47): gym_ddp and gym_fsdp >= 0.98 of "
    "the plain loop; zero3 >= 0.75 of it and >= 1.5 x Lightning's DeepSpeedStrategy, peak within 5 % of the planner; "
    "zero1/zero2 >= 0.95; compile=True >= 1.30 x the plain loop with no higher peak, cold compile <= 60 s, warm <= a "
    "third of it; gym_lightning's own host syncs per quiet step 0 (1 where NonFiniteGuard reads its flags at once)."
)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def render_gpu(data: dict[str, Any]) -> str:
    """The checks table, then the benchmark table (``{"meta": {...}, "checks": [...], "runs": {name: {...}}}``)."""
    facts = ", ".join(f"{k}: {v}" for k, v in data.get("meta", {}).items())
    parts = [facts]
    if data.get("checks"):
        rows = [
            [c["check"], _verdict(c.get("ok")), f"{c.get('seconds', 0):.1f}", _summary_cell(c)] for c in data["checks"]
        ]
        parts.append(markdown_table(["check", "ok", "s", "figures"], rows))
    if data.get("host_syncs"):
        parts.append(host_sync_table(data["host_syncs"]))
    if data.get("runs"):
        parts.append(render_gpu_runs(data["runs"]))
    if data.get("routed"):
        parts.append(render_routed(data["routed"]))
    return "\n\n".join(parts)


def render_gpu_runs(runs: dict[str, Any]) -> str:
    """Markdown table of benchmarks/workers/gpu_bench.py's merged runs: medians over rounds with min-max, the ratios
    to the plain eager loop (paired round by round) and to the Lightning peer, each beside issue 47's bar where it
    has one (✅ the whole min-max range meets it, ❌ none of it does, ≈ undecided), and the compile times."""
    rows = []
    for name, run in runs.items():
        if "error" in run or "skipped" in run:
            why = ("failed: " + run["error"]) if "error" in run else ("skipped: " + run["skipped"])
            rows.append([name, why[:160].replace("|", "/"), *[""] * 9])
        else:
            rows.append(_gpu_run_row(name, run, bench))
    header = ["run", "rounds", "tokens/s: median (min-max)", "÷ plain loop: median (min-max)", "MFU"]
    header += ["peak CUDA memory (max allocated)", "peak ÷ plain", "planner's peak (measured ÷ predicted)"]
    header += ["compile s (first step - steady)", "÷ Lightning's peer (tokens/s; peak)"]
    header += ["planner's tokens/s (measured ÷ predicted)"]
    return markdown_table(header, rows)


def _gpu_run_row(name: str, run: dict[str, Any], bench: Any) -> list[str]:
    """One measured run's cells (``bench``: gpu_bench.py, whose constants hold the bars)."""
    rounds = run.get("rounds") or [run["tokens_per_sec"]]
    speed = f"{run['tokens_per_sec']:,.0f}"
    if len(rounds) > 1:
        speed += f" ({min(rounds):,.0f}-{max(rounds):,.0f})"
    return [
        name,
        str(len(rounds)),
        speed,
        _vs_plain_cell(run.get("vs_plain"), bench.TARGETS_VS_PLAIN.get(name)),
        "n/a" if run.get("mfu") is None else f"{100 * run['mfu']:.1f}%",
        f"{run['peak_memory_bytes'] / 2**30:.1f} GiB",
        _at_most((run.get("vs_plain") or {}).get("peak"), bench.PEAK_VS_PLAIN_MAX.get(name)),
        _planner_cell(run, bench.PLANNER_TOLERANCE.get(name)),
        _compile_cell(name, run, bench),
        _peer_cell(run.get("vs_peer"), bench.TARGETS_VS_PEER.get(name)),
        _speed_cell(run),
    ]


def _speed_cell(run: dict[str, Any]) -> str:
    """The step-time model's tokens/s for the run (planner.timing) and measured ÷ predicted, within 15 % or not
    (issue 48's validation bar for one-GPU rows; compiled rows are predicted as eager ones, so they show the gain)."""
    predicted = run.get("predicted_tokens_per_sec")
    if not predicted:
        return ""
    share = run["tokens_per_sec"] / predicted
    return f"{predicted:,.0f} ({run.get('predicted_on')}), {share:.3f}{' ✅' if abs(share - 1) <= 0.15 else ' ❌'}"


def _bar(low: float, high: float, target: float | None, at_least: bool = True) -> str:
    """`` ✅`` when all of [low, high] meets ``target`` (>= it, or <= it with ``at_least=False``), `` ❌`` when none
    does, `` ≈`` between; nothing without a target."""
    if target is None:
        return ""
    if not at_least:
        low, high, target = -high, -low, -target
    return " ✅" if low >= target else " ❌" if high < target else " ≈"


def _vs_plain_cell(ratio: dict[str, Any] | None, target: float | None) -> str:
    if not ratio:
        return ""
    spread = f" ({ratio['min']:.3f}-{ratio['max']:.3f})" if ratio.get("n", 1) > 1 else ""
    bar = f" (>= {target}){_bar(ratio['min'], ratio['max'], target)}" if target else ""
    return f"**{ratio['median']:.3f}**{spread}{bar}"


def _at_most(value: float | None, bound: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" + (f" (<= {bound}){_bar(value, value, bound, at_least=False)}" if bound else "")


def _planner_cell(run: dict[str, Any], tolerance: float | None) -> str:
    predicted = run.get("predicted_peak_bytes")
    if not predicted:
        return ""
    share = run["peak_memory_bytes"] / predicted
    bar = ""
    if tolerance is not None:
        bar = f" (within {tolerance:.0%}){' ✅' if abs(share - 1) <= tolerance else ' ❌'}"
    return f"{predicted / 2**30:.1f} GiB ({run.get('planner_strategy')}), {share:.3f}{bar}"


def _compile_cell(name: str, run: dict[str, Any], bench: Any) -> str:
    """The compiled runs' compile seconds with their bars (cold: at most 60 s; warm: at most a third of cold)."""
    seconds = run.get("compile_seconds")
    if seconds is None or name not in bench.COMPILED:
        return ""
    cell = f"{seconds:.1f}" + _at_most_seconds(seconds, bench.COLD_COMPILE_MAX_S.get(name))
    if (share := run.get("compile_vs_cold")) is not None:
        limit = bench.WARM_COMPILE_MAX_SHARE
        cell += f", {share:.2f} of cold (<= {limit:.2f}){_bar(share, share, limit, at_least=False)}"
    if name in bench.COLD_COMPILE and run.get("inductor_cache_files_at_start") == 0:
        cell += " (the cache was empty: a cold compile)"  # its cold run was skipped or failed
    return cell


def _at_most_seconds(seconds: float, bound: float | None) -> str:
    return f" (<= {bound:.0f} s){_bar(seconds, seconds, bound, at_least=False)}" if bound else ""


def _peer_cell(ratio: dict[str, Any] | None, target: float | None) -> str:
    if not ratio or ratio.get("tokens_per_sec") is None:
        return ""
    speed = ratio["tokens_per_sec"]
    bar = f" (>= {target}){_bar(speed, speed, target)}" if target else ""
    peak = f"; peak {ratio['peak']:.3f}" if ratio.get("peak") else ""
    return f"{ratio['peer']}: {speed:.3f}{bar}{peak}"


def _verdict(ok: bool | None) -> str:
    return {True: "✅", False: "❌"}.get(ok, "skipped")


def _summary_cell(record: dict[str, Any]) -> str:
    try:
        return check_summary(record)
    except (KeyError, TypeError, ValueError, AttributeError):  # a record of an unforeseen shape still shows
        return json.dumps(record.get("figures", {}))[:200].replace("|", "/")


def check_summary(record: dict[str, Any]) -> str:
    """A short cell from one tests/gpu record: its error, else the figures that decided it."""
    if record.get("detail") or record.get("skipped"):
        return str(record.get("detail") or record["skipped"])[:200].replace("|", "/").replace("\n", " ")
    f, name = record.get("figures", {}), record["check"]
    cells = [f"{f['global_step']} steps"] if "global_step" in f else []
    if "vs_reference" in f:
        cells.append(f"losses vs reference: max rel. diff {f['vs_reference'].get('max_rel_diff', 'n/a'):.2g}")
    if name.startswith("host_syncs/"):
        cells.append(f"{_sync_cell(record)} per quiet step; gym_lightning allowed {f.get('gym_lightning_allowed')}")
    for key in ("host_placement", "registered_hooks"):
        if key in f:
            cells.append(f"{key.replace('_', ' ')}: {f[key]}")
    if name.startswith("export/"):
        cells.append(
            f"max abs. logit diff {f['max_abs_diff']:.2g} ({f['module_logits_dtype']} module), training moved "
            f"logits by {f['moved_by_training']:.2g}"
        )
    if name == "val_metrics":
        before = max(r["before_vs_reference"]["max_rel_diff"] for r in f.values() if isinstance(r, dict))
        after = max(r["after_vs_reference"]["max_rel_diff"] for r in f.values() if isinstance(r, dict))
        cells.append(f"val/loss max rel. diff to fp32: {before:.2g} before training, {after:.2g} after")
    if name == "init_weights":
        cells.append(", ".join(f"{k}: {v['n_differing']} tensors differ" for k, v in f.items() if "n_differing" in v))
    if name == "chunked_loss":
        cells.append(f"loss diff {f['loss'].get('max_abs_diff')}, grad diff {f['grads'].get('max_abs_diff')}")
    if name.startswith("gym_fit/"):
        cells.append(gym_fit_summary(f))
    if name == "op_builds":
        cells.append("ops asked for: " + (", ".join(o["op"] for o in f.get("loaded", [])) or "none"))
    return "; ".join(cells).replace("|", "/")


def gym_fit_summary(figures: dict[str, Any]) -> str:
    """A ``gym_fit/<config>`` record: the expected refusal, or what ran and how its export reloaded."""
    if figures.get("expected_refusal"):
        return f"refused as expected: {figures['expected_refusal']}"[:200]
    export = figures.get("export", {})
    logits = "finite logits" if export.get("finite_logits") else "NON-FINITE logits"
    loads = "loads" if export.get("loads") else f"load problems {export.get('load_problems')}"
    return f"{figures.get('strategy')}, {figures.get('precision')}; export ({export.get('dtype')}) {loads}, {logits}"


def render_routed(records: list[dict[str, Any]]) -> str:
    """benchmarks/routed_forward_speed.py's table of the device's runs, under a label of its own (its section
    heading would start a new section of the document), failed or skipped sizes as one line each."""
    from benchmarks.routed_forward_speed import render

    done = {r["key"]: r for r in records if r.get("ok")}
    failed = [
        f"- {r['key']}: {r.get('error') or 'skipped: ' + r.get('skipped', '')}" for r in records if not r.get("ok")
    ]
    device = next((r.get("device") for r in records if r.get("device")), "cuda")
    table = render(done, device).split("\n", 2)[2].strip() if done else ""
    return "\n".join(
        ["MoE routed forward, grouped by expert vs per expert, on the device:", "", table, *failed]
    ).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gather = sub.add_parser("collect", help="merge the parts' JSON lines into DIR/results.json; exit 1 if one failed")
    gather.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    gather.add_argument("--meta", default="{}", help="JSON object of facts to print above the tables")
    syncs = sub.add_parser("syncs", help="print the host-sync table of DIR's checks (strategy x precision)")
    syncs.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    if args.command == "syncs":
        cells = host_sync_cells(read_records(args.dir / "checks.jsonl"))
        print(
            host_sync_table(cells) if cells else "no host-sync records (tests/gpu/test_gpu_host_syncs.py did not run)"
        )
        return 0
    payload = collect(args.dir, json.loads(args.meta))
    failed = payload["failed"] or "none"
    print(f"collect: {len(payload['checks'])} checks, {len(payload['runs'])} runs, failed: {failed}")
    return 1 if payload["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
