"""How long and what it costs: the step-time model's predictions per strategy as the plan's speed table, the ranking
of the strategies that fit, and hours, GPU-hours and dollars for a number of tokens (pure, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gym_lightning.planner.estimate import Estimate, recommend
from gym_lightning.planner.machines import Machine
from gym_lightning.planner.timing import Speed

# Predicted speeds this close to the fastest are a tie (see ranking()).
TIE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Budget:
    """What the run trains on and what a GPU-hour costs (each optional).

    Args:
        tokens: Tokens to train on (``rows x epochs x seq_length x sequences`` when given as a data set); ``None``:
            no times.
        price_per_gpu_hour: Dollars per GPU-hour; ``None``: no cost.
        epochs: Passes over the data that ``tokens`` make (a preference stage's precomputed reference runs over
            the data once).
    """

    tokens: float | None = None
    price_per_gpu_hour: float | None = None
    epochs: float = 1.0

    def problems(self) -> list[str]:
        given = (("tokens", self.tokens), ("price_per_gpu_hour", self.price_per_gpu_hour), ("epochs", self.epochs))
        return [
            f"{name} must be a positive number, got {value!r}"
            for name, value in given
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0)
        ]


def fastest(estimates: Sequence[Estimate], speeds: Sequence[Speed | None]) -> Estimate | None:
    """The first of :func:`ranking`: the fastest strategy that fits (ties broken by the list's order); without
    predictions, the first that fits in the list's order (``estimate.recommend``)."""
    ranked = ranking(estimates, speeds)
    if ranked:
        return estimates[ranked[0]]
    return recommend(list(estimates))


def ranking(estimates: Sequence[Estimate], speeds: Sequence[Speed | None]) -> list[int]:
    """Indices of the strategies that fit and have a prediction, fastest first. Predictions within
    :data:`TIE_TOLERANCE` of the fastest left are a tie, which the list's order breaks (``estimate.STRATEGIES``:
    fewer moving parts first): the model is validated to 15 % (docs/planner.md), so a 0.1 % edge of ZeRO-3 over FSDP
    in bytes says nothing, while issue 47's H200 rows measured FSDP at twice ZeRO-3's speed before its rule."""
    rate = {
        i: s.tokens_per_second_per_gpu for i, (e, s) in enumerate(zip(estimates, speeds, strict=True)) if e.fits and s
    }
    order: list[int] = []
    while rate:
        fastest_left = max(rate.values())
        pick = next(i for i in rate if rate[i] >= fastest_left * (1 - TIE_TOLERANCE))
        order.append(pick)
        del rate[pick]
    return order


def cost_figures(result: Speed, gpus: int, budget: Budget) -> dict[str, float | None]:
    """Hours, GPU-hours and dollars of ``budget.tokens`` at ``result``'s speed (``None`` where not asked)."""
    if budget.tokens is None:
        return {"hours": None, "gpu_hours": None, "cost": None}
    hours = result.hours(budget.tokens, gpus, budget.epochs)
    cost = None if budget.price_per_gpu_hour is None else hours * gpus * budget.price_per_gpu_hour
    return {"hours": hours, "gpu_hours": hours * gpus, "cost": cost}


def speed_dict(result: Speed | None, gpus: int, budget: Budget, rank: int | None) -> dict[str, Any] | None:
    """One strategy's prediction for ``PlanReport.to_dict()``."""
    if result is None:
        return None
    return {
        "rank": rank,
        "step_seconds": result.step.total,
        "terms": result.step.as_dict(),
        "tokens_per_step": result.tokens_per_step,
        "tokens_per_second_per_gpu": result.tokens_per_second_per_gpu,
        "mfu": result.mfu,
        "scaling": result.scaling,
        "reference_pass_seconds_per_step": result.reference_pass,
        **cost_figures(result, gpus, budget),
    }


def speed_lines(
    estimates: Sequence[Estimate], speeds: Sequence[Speed | None], machine: Machine, gpus: int, budget: Budget
) -> list[str]:
    """The speed table: rank among those that fit, step seconds, tokens/s per GPU, MFU, scaling, exposed
    communication, and the time and cost of ``budget.tokens``."""
    hw = machine.hardware
    first = next((s for s in speeds if s is not None), None)
    if first is None:
        return []
    title = (
        f"Speed on {gpus} x {hw.name} (kernels at {hw.compute_efficiency:.1%} of the roofline of a "
        f"{hw.peak_flops / 1e12:,.0f} TFLOP/s peak; {first.tokens_per_step:,} tokens per optimizer step)"
    )
    if budget.tokens is not None:
        title += f", {budget.tokens:,.0f} tokens"
    header = ["strategy", "rank", "step s", "tok/s/GPU", "MFU", "scaling", "comm shown s", "offload s"]
    if first.reference_pass:  # precompute_ref_log_probs: the pass before training, per optimizer step of data
        header.append("ref pass s")
    if budget.tokens is not None:
        header += ["hours", "GPU-h"] + (["cost $"] if budget.price_per_gpu_hour is not None else [])
    ranks = {index: place + 1 for place, index in enumerate(ranking(estimates, speeds))}
    rows = [header]
    for i, (e, s) in enumerate(zip(estimates, speeds, strict=True)):
        rows.append(_speed_row(e, s, ranks.get(i), gpus, budget, len(header)))
    notes = [f"Note: {note}." for note in machine.notes]
    if first.reference_pass:
        notes.append(
            "Note: ref pass s: precompute_ref_log_probs' reference forward before training, seconds per optimizer "
            "step of data, run once (not per epoch)" + (" and counted in hours." if budget.tokens else ".")
        )
    return [title + ":", *aligned(rows), *notes]


def _speed_row(e: Estimate, s: Speed | None, rank: int | None, gpus: int, budget: Budget, width: int) -> list[str]:
    if s is None:
        return [e.strategy.label, *(["—"] * (width - 1))]
    row = [
        e.strategy.label,
        str(rank) if rank is not None else "does not fit",
        f"{s.step.total:.3f}",
        f"{s.tokens_per_second_per_gpu:,.0f}",
        f"{s.mfu:.1%}",
        f"{s.scaling:.2f}",
        f"{s.step.exposed_communication + s.step.sequence_parallel:.3f}",
        f"{s.step.offload:.3f}",
        *([f"{s.reference_pass:.3f}"] if s.reference_pass else []),
    ]
    figures = cost_figures(s, gpus, budget)
    if budget.tokens is not None:
        row += [f"{figures['hours']:,.1f}", f"{figures['gpu_hours']:,.0f}"]
        if figures["cost"] is not None:
            row.append(f"{figures['cost']:,.0f}")
    return row


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows as lines of columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
