"""The overhead budget: what gym_lightning's wrappers add to each optimizer step, line by line (run.py's ``overhead``).

One probed ``Trainer.fit`` run per strategy and step size (benchmarks/workers/dist_bench.py with ``"probe": true``
and the non-finite guard on, as ``gym fit`` runs it): workers/probe.py times every collective, host sync and
Python-side cost the wrapper adds per step, and this module renders one table per strategy, each line's median
milliseconds per step and its share of the median step, at both step sizes. A regression shows up as a line that
grew. When the strategy comparison ran in the same pass, the table also gives the measured gap to the plain loop
(wrapper minus peer, guard off) and what the listed lines leave of it (Lightning's loop, hooks and closures).

    python -m benchmarks.run --sections overhead             # alone (~3 min on 2 idle cores)
    python -m benchmarks.run --sections fsdp zero overhead   # with the gaps to the plain loops
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.workers.probe import COMPONENTS
from gym_lightning.callbacks.reports import markdown_table

# Strategy name in run.py's PAIRS -> gym kind; the order of the tables.
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
# Lines the peer loop runs too (same mathematics): listed, not counted in the wrapper's own sum.
SHARED = ("tokens_launch", "tokens_wait")
# Lines of the guard (off in the ratio runs): summed separately.
GUARD = ("guard_loss", "guard_norm", "guard_reduce")


def probe_runs(
    workloads: list[tuple[str, int, int]], base: dict[str, Any], kinds: dict[str, str], zero_config: Any
) -> list[dict[str, Any]]:
    """One probed gym run (guard on) per strategy and step size; ``workloads`` as run.py's strategy_workloads,
    ``kinds``: strategy name -> gym kind, ``zero_config(stage, micro_batch)``: run.py's ZeRO config."""
    runs = []
    for suffix, batch, steps in workloads:
        for name in STRATEGIES:
            run = {**base, "batch_size": batch, "steps": steps, "name": name + suffix, "kind": kinds[name]}
            run |= {"guard": True, "probe": True}
            if name.startswith("zero"):
                run["ds_config"] = zero_config(int(name[-1]), batch)
            runs.append(run)
    return runs


def ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def cell(milliseconds: float, step_ms: float) -> str:
    return f"{milliseconds:.2f} ms ({100 * milliseconds / step_ms:.1f}%)"


def budget_rows(run: dict[str, Any], gap_ms: float | None) -> dict[str, str]:
    """Line label -> ``ms (share)`` for one probed run; ``gap_ms``: wrapper minus peer median step (guard off)."""
    step = ms(run["step_seconds"])
    lines = {name: ms(values) for name, values in run["probe"].items()}
    rows = {"median step (probed run, guard on)": f"{step:.1f} ms"}
    rows |= {f"{name}: {COMPONENTS[name]}": cell(value, step) for name, value in lines.items()}
    own = sum(v for k, v in lines.items() if k not in SHARED and k not in GUARD)
    rows["sum of the wrapper's own lines (guard and shared lines excluded)"] = cell(own, step)
    rows["non-finite guard, all three lines"] = cell(sum(lines[k] for k in GUARD), step)
    if gap_ms is not None:
        rows["measured gap to the plain loop (ratio runs, guard off: wrapper - peer median step)"] = cell(gap_ms, step)
        rows["gap not covered by the lines (Lightning's loop, hooks, closures; noise)"] = cell(gap_ms - own, step)
    return rows


def render(
    results: list[dict[str, Any]], workloads: list[tuple[str, int, int]], seq: int, gaps: dict[str, float]
) -> str:
    """One markdown table per strategy: lines x step sizes. ``gaps``: run name -> wrapper minus peer step (ms)."""
    parts = []
    for name in STRATEGIES:
        columns = []
        for suffix, batch, _ in workloads:
            run = next((r for r in results if r["name"] == name + suffix), None)
            if run is not None:
                rows = budget_rows(run, gaps.get(name + suffix))
                columns.append((f"batch {batch} x {seq}: ms per step (share)", rows))
        if not columns:
            continue
        labels = list(dict.fromkeys(label for _, rows in columns for label in rows))
        if name == "ddp":
            labels.append("comm hooks: none registered (`gradient_compression='none'`, the default)")
        table = [[label, *(rows.get(label, "0") for _, rows in columns)] for label in labels]
        header = ["line", *(title for title, _ in columns)]
        parts.append(f"**{name}**\n\n" + markdown_table(header, table))
    return "\n\n".join(parts)


INTRO = (
    "What the wrapper adds per optimizer step, measured line by line with targeted timers (benchmarks/overhead.py, "
    "benchmarks/workers/probe.py) in one `Trainer.fit` run per strategy and step size, 2 ranks x 1 thread, the same "
    "model and batches as sections 2-3, the non-finite guard on (as `gym fit` runs it). Each line: rank 0's median "
    "milliseconds per timed step and its share of the median step. A blocking collective's time includes waiting "
    "for the other rank, so on a loaded machine those lines grow with the load. `tokens_*` lines: the plain loops "
    "do the same all-reduce (same mathematics), so they are listed but not counted in the wrapper's own sum. The "
    "SIGTERM broadcast is Lightning's (every batch, in `_TrainingEpochLoop.advance`)."
)
