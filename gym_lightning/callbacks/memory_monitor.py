"""``MemoryCallback``: per-rank bytes of parameters, gradients and optimizer state, gathered and reported."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gym_lightning._compat import (
    ZERO_OPTIMIZER_MEMORY_ATTRIBUTES,
    rank_zero_info,
    rank_zero_warn,
    zero_optimizer_lacks_memory_attributes,
)
from gym_lightning.callbacks.reports import format_bytes, markdown_table, report_dir, write_json
from gym_lightning.errors import GymUserError
from gym_lightning.metrics.memory import (
    CATEGORIES,
    HeldBytes,
    held_bytes,
    host_rss_bytes,
    peak_host_rss_bytes,
    take_cuda_peak,
)

MOMENTS: tuple[str, ...] = ("after_first_step", "end")
# Phases of fit whose CUDA peaks are kept apart: set-up (build, load, shard, optimizer) up to the start of training,
# the first optimizer step (optimizer states appear), and the rest of training.
PHASES: tuple[str, ...] = ("setup", "first_step", "training")
PROCESS_FIELDS: tuple[str, ...] = (
    "cuda_max_allocated",
    "cuda_max_reserved",
    "peak_host_rss",
    "host_rss",
    *(f"cuda_{phase}_max_allocated" for phase in PHASES),
)


class MemoryCallback(Callback):
    """Reports, per rank, the bytes of parameters, gradients, fp32 master weights, optimizer state and
    communication buffers that the rank actually holds (see :mod:`gym_lightning.metrics.memory` for how each
    strategy is read), plus peak CUDA allocated/reserved and peak host RSS. The CUDA peak is also kept per phase
    (``cuda_<phase>_max_allocated`` for set-up, the first step and the rest of training): the allocator's peak
    counters are reset when a phase ends, and ``cuda_max_allocated`` is the largest of them.

    Measured twice: around the first optimizer step (optimizer state exists only after it) and around the last one.
    "Around" a step is the per-category maximum of a reading just before ``optimizer.step`` (gradients are complete;
    ZeRO frees its gradient partitions inside the step) and one just after it. The readings only walk tensor
    metadata: no device sync. At the end of fit the ranks' figures are gathered (one all-gather), rank zero prints a
    table and writes ``memory.json`` to the run's log directory, and the largest per-rank totals are logged as
    ``memory/max_rank/<category>_bytes``.

    Args:
        report_name: File name of the JSON report in the log directory.
    """

    def __init__(self, report_name: str = "memory.json") -> None:
        if not isinstance(report_name, str) or not report_name:
            raise GymUserError(f"report_name must be a non-empty file name, got {report_name!r}.")
        self.report_name = report_name
        self.summary: dict[str, Any] = {}
        self._warned_unread: set[str] = set()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._before_step: HeldBytes | None = None
        self._first: HeldBytes | None = None
        self._cuda_peaks: dict[str, tuple[int | None, int | None]] = {}
        self._end_phase("setup", trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._before_step = self._measure(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._first is None and trainer.global_step != self._seen_step:
            self._first = self._around_step(trainer)
            self._end_phase("first_step", trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        end = self._around_step(trainer) if self._first is not None else None
        self._end_phase("first_step" if self._first is None else "training", trainer)
        local = _encode([self._first, end], self._process_figures())
        gathered = _gather_rows(local.to(pl_module.device)).cpu()
        self.summary = {
            "world_size": trainer.world_size,
            "device": str(trainer.strategy.root_device),
            "strategy": type(trainer.strategy).__name__,
            "ranks": [_decode(rank, row.tolist()) for rank, row in enumerate(gathered)],
        }
        path = report_dir(trainer) / self.report_name  # collective (broadcasts the log dir): every rank calls it
        if trainer.is_global_zero:
            write_json(path, self.summary)
            rank_zero_info(memory_table(self.summary) + f"\nmemory report: {path}")
            for logger in trainer.loggers:
                logger.log_metrics(_max_rank_metrics(self.summary), step=trainer.global_step)

    def _measure(self, trainer: pl.Trainer) -> HeldBytes:
        optimizers = list(trainer.optimizers)
        engine_optimizer = getattr(trainer.strategy.model, "optimizer", None)  # DeepSpeedEngine's ZeRO optimizer
        if engine_optimizer is not None and all(engine_optimizer is not o for o in optimizers):
            optimizers.append(engine_optimizer)
        model = trainer.strategy.model if trainer.strategy.model is not None else trainer.lightning_module
        self._warn_if_unreadable(optimizers)
        return held_bytes(model, optimizers, trainer.strategy.root_device)

    def _warn_if_unreadable(self, optimizers: list[Any]) -> None:
        """Say so (once per optimizer class) when a DeepSpeed upgrade moved every attribute we read: the figures
        would otherwise silently count 0 for its master weights, gradients and buffers."""
        for opt in optimizers:
            name = type(opt).__qualname__
            if name in self._warned_unread or not zero_optimizer_lacks_memory_attributes(opt):
                continue
            self._warned_unread.add(name)
            rank_zero_warn(
                f"MemoryCallback found none of the DeepSpeed attributes it reads on {type(opt).__module__}.{name} "
                f"(looked for {', '.join(ZERO_OPTIMIZER_MEMORY_ATTRIBUTES)}); this DeepSpeed version keeps them "
                "elsewhere, so master weights, gradients and communication buffers count 0. Update "
                "gym_lightning._compat.DEEPSPEED_MEMORY_ATTRIBUTES."
            )

    def _around_step(self, trainer: pl.Trainer) -> HeldBytes:
        after = self._measure(trainer)
        return after if self._before_step is None else self._before_step.maximum(after)

    def _end_phase(self, phase: str, trainer: pl.Trainer) -> None:
        self._cuda_peaks[phase] = take_cuda_peak(trainer.strategy.root_device)

    def _process_figures(self) -> list[int | None]:
        """Called once the last phase has ended: the whole fit's CUDA peaks are the largest of the phases'."""
        per_phase = [self._cuda_peaks.get(phase, (None, None)) for phase in PHASES]
        allocated = _largest(a for a, _ in per_phase)
        reserved = _largest(r for _, r in per_phase)
        return [allocated, reserved, peak_host_rss_bytes(), host_rss_bytes(), *(a for a, _ in per_phase)]


def _largest(values: Any) -> int | None:
    """The largest of the values that were measured (``None``: not measured, off CUDA)."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[world_size, n]``: every rank's vector (plain ``all_gather``; Lightning's goes through the deprecated
    autograd-aware ``torch.distributed.nn`` version, which we do not need)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor[None]
    rows = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(rows, tensor)
    return torch.stack(rows)


def _encode(moments: list[HeldBytes | None], process: list[int | None]) -> torch.Tensor:
    """Flat float64 vector for the all-gather; ``-1`` stands for "not measured" (bytes fit float64 exactly)."""
    values: list[float] = []
    for held in moments:
        for category in CATEGORIES:
            values += [-1, -1] if held is None else [held.on_device[category], held.offloaded[category]]
    values += [-1 if v is None else v for v in process]
    return torch.tensor(values, dtype=torch.float64)


def _decode(rank: int, values: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank}
    width = 2 * len(CATEGORIES)
    for index, moment in enumerate(MOMENTS):
        chunk = values[index * width : (index + 1) * width]
        if chunk[0] < 0:
            out[moment] = None
            continue
        per_category = {
            c: {"on_device": int(chunk[2 * i]), "offloaded": int(chunk[2 * i + 1])} for i, c in enumerate(CATEGORIES)
        }
        total = sum(v["on_device"] + v["offloaded"] for v in per_category.values())
        out[moment] = {**per_category, "total": total}
    for name, value in zip(PROCESS_FIELDS, values[len(MOMENTS) * width :], strict=True):
        out[name] = None if value < 0 else int(value)
    return out


def memory_table(summary: dict[str, Any], moment: str = "end") -> str:
    """Markdown table of a :class:`MemoryCallback` summary: one row per rank."""
    header = ["rank", *CATEGORIES, "total", "offloaded", "peak CUDA alloc", "peak CUDA reserved", "peak host RSS"]
    rows = []
    for rank in summary["ranks"]:
        held = rank.get(moment)
        cells = ["n/a"] * (len(CATEGORIES) + 2)
        if held is not None:
            cells = [format_bytes(held[c]["on_device"] + held[c]["offloaded"]) for c in CATEGORIES]
            cells += [format_bytes(held["total"]), format_bytes(sum(held[c]["offloaded"] for c in CATEGORIES))]
        process = [rank[k] for k in ("cuda_max_allocated", "cuda_max_reserved", "peak_host_rss")]
        rows.append([str(rank["rank"]), *cells, *("n/a" if v is None else format_bytes(v) for v in process)])
    title = f"Memory held per rank around the last optimizer step ({summary['strategy']}, {summary['device']})"
    return title + "\n" + markdown_table(header, rows)


def _max_rank_metrics(summary: dict[str, Any]) -> dict[str, float]:
    held = [rank["end"] for rank in summary["ranks"] if rank.get("end") is not None]
    metrics = {
        f"memory/max_rank/{c}_bytes": float(max(h[c]["on_device"] + h[c]["offloaded"] for h in held))
        for c in CATEGORIES
        if held
    }
    if held:
        metrics["memory/max_rank/total_bytes"] = float(max(h["total"] for h in held))
    return metrics
