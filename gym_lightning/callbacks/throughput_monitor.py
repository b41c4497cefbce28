"""``ThroughputCallback``: tokens/s, samples/s, steps/s, TFLOP/s and MFU, per device and for the whole job."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gym_lightning._compat import rank_zero_info, rank_zero_warn
from gym_lightning.callbacks.plan_check import prediction
from gym_lightning.callbacks.reports import markdown_table, report_dir, write_json
from gym_lightning.errors import GymUserError
from gym_lightning.metrics.flops import transformer_flops
from gym_lightning.metrics.peak_flops import dense_peak_flops, precision_to_dtype
from gym_lightning.metrics.throughput import Counters, Sample, SlidingWindow, batch_counts, rates

PALM_CONVENTION = "6*N_trainable + 4*N_frozen + 12*L*H*Q*T per token (PaLM app. B; Kaplan et al. 2020)"


class ThroughputCallback(Callback):
    """Measures training throughput on every rank and logs job totals, per-device averages and MFU.

    Counters (samples, non-padding tokens, target tokens, Σ sequence length²) accumulate on the device every
    micro-batch, so variable batch sizes and gradient accumulation are counted exactly and nothing syncs the host per
    step. Every ``log_every_n_steps`` optimizer steps the counters are summed over ranks with ONE all-reduce, which
    also synchronises the device so the wall-clock time between two reads is exact. Logged keys
    (``throughput/interval/...`` over the last interval, ``throughput/window/...`` over the sliding window):
    ``tokens_per_sec`` (job total), ``device_tokens_per_sec`` (job / world size), ``local_tokens_per_sec`` (this
    rank), the same for ``target_tokens``, ``samples`` and ``flops``, plus ``optimizer_steps_per_sec``,
    ``device_tflops_per_sec`` and ``mfu``. ``GymProgressBar`` shows the window's job ``tok/s``
    (``progress_bar_items``). At the end of fit a
    summary is printed on rank zero and written to ``throughput.json`` in the run's log directory. Time spent in
    validation during fit is paused out of the clock.

    FLOPs: if the LightningModule has a Hugging Face model (``module.model.config``) the formula of
    :mod:`gym_lightning.metrics.flops` is used; otherwise pass ``flops_per_token``, else FLOPs and MFU read "n/a".
    MFU needs the dense peak of one device: from :mod:`gym_lightning.metrics.peak_flops` for known CUDA chips, or
    ``peak_flops``; never guessed.

    Plan check: at the end of fit the planner's step-time model (``planner.timing``) predicts this run's optimizer
    step time and tokens/s from the strategy, the model's shape, the measured micro-batch and sequence length and the
    hardware (the catalog GPU of the CUDA device; on CPU ranks figures measured on the spot, a collective that every
    rank runs), and the summary table prints them beside the measured ones with the ratio measured / predicted step
    time; ``throughput.json`` holds them under ``"plan"`` (``callbacks.plan_check.prediction``), or
    ``{"unavailable": why}`` when the planner cannot model the run.

    Args:
        warmup_steps: Optimizer steps excluded at the start (allocator warm-up, compilation, first all-gathers);
            ``>= 0``.
        window_steps: Width of the sliding window in optimizer steps; ``>= 1``.
        log_every_n_steps: Optimizer steps between reads (each costs one all-reduce and one host sync); ``>= 1``, or
            ``None`` for the Trainer's ``log_every_n_steps``.
        flops_per_token: Training (forward + backward) FLOPs per token, for models without a Hugging Face config;
            overrides the formula. ``None`` to derive it from the model.
        peak_flops: Dense peak FLOP/s of ONE device in the training dtype; overrides the table. ``None`` to look the
            chip up.
        report_name: File name of the JSON summary in the log directory.
        predict: Add the planner's predicted step time and tokens/s to the summary (see "Plan check"); ``False``
            skips it (and, on CPU ranks, the second or so of host measurements it costs).
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        window_steps: int = 20,
        log_every_n_steps: int | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        report_name: str = "throughput.json",
        predict: bool = True,
    ) -> None:
        problems = _argument_problems(warmup_steps, window_steps, log_every_n_steps, flops_per_token, peak_flops)
        if not isinstance(predict, bool):
            problems.append(f"predict must be true or false, got {predict!r}")
        if problems:
            raise GymUserError("invalid ThroughputCallback arguments:\n  - " + "\n  - ".join(problems))
        self.warmup_steps = warmup_steps
        self.window_steps = window_steps
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.report_name = report_name
        self.predict = predict
        self.summary: dict[str, Any] = {}
        self._paused = 0.0
        self._pause_start: float | None = None
        self.progress_bar_items: dict[str, float] = {}  # shown by GymProgressBar

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flops_coefficients, self._flops_info = self._resolve_flops(pl_module)
        self._device_name, self._dtype, self._peak, self._peak_source = self._resolve_peak(trainer)
        self._counts = torch.zeros(4, dtype=torch.int64, device=pl_module.device)
        self._window = SlidingWindow(self.window_steps)
        self._interval = self.log_every_n_steps or trainer.log_every_n_steps or 1
        self._start_step = self._seen_step = trainer.global_step
        self._paused = 0.0  # seconds spent in validation during fit: not training time
        if self.warmup_steps == 0:
            self._window.append(self._read(trainer, steps=0))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._counts += batch_counts(batch).to(self._counts.device)
        if trainer.global_step == self._seen_step:
            return  # a gradient-accumulation micro-batch: no optimizer step yet
        self._seen_step = trainer.global_step
        measured = trainer.global_step - self._start_step - self.warmup_steps
        if measured == 0:
            self._counts.zero_()  # everything so far was warm-up
            self._window.append(self._read(trainer, steps=0))
        elif measured > 0 and measured % self._interval == 0:
            self._window.append(self._read(trainer, steps=measured))
            self._log(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._pause_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        measured = trainer.global_step - self._start_step - self.warmup_steps
        last = self._window.last
        if last is not None and measured > last.job.steps:
            self._window.append(self._read(trainer, steps=measured))
        self.summary = self._summary(trainer, measured)
        if self.predict:  # on every rank: on CPU ranks it measures the host with collectives
            total = self.summary["total"] or {}
            steps, tokens = total.get("optimizer_steps_per_sec"), total.get("tokens_per_sec")
            self.summary["plan"] = prediction(trainer, pl_module, self.summary["job_counts"], steps, tokens)
        path = report_dir(trainer) / self.report_name  # collective (broadcasts the log dir): every rank calls it
        if trainer.is_global_zero:
            write_json(path, self.summary)
            rank_zero_info(_summary_table(self.summary) + f"\nthroughput report: {path}")

    def _read(self, trainer: pl.Trainer, steps: int) -> Sample:
        """One all-reduce of the counters; ``tolist`` syncs the device, so the timestamp after it is exact."""
        job = trainer.strategy.reduce(self._counts.clone(), reduce_op="sum")
        local_values, job_values = torch.stack([self._counts, job.to(self._counts.device)]).tolist()
        clock = time.perf_counter() - self._paused  # training time only: validation runs are paused out
        return Sample(clock, self._counters(steps, local_values), self._counters(steps, job_values))

    def _counters(self, steps: int, values: list[int]) -> Counters:
        samples, tokens, targets, sum_squares = values
        flops = None
        if self._flops_coefficients is not None:
            dense, attention = self._flops_coefficients
            flops = dense * tokens + attention * sum_squares
        return Counters(steps=steps, samples=samples, tokens=tokens, target_tokens=targets, flops=flops)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics: dict[str, float] = {}
        for scope, pair in (("interval", self._window.interval()), ("window", self._window.window())):
            if pair is not None:
                values = rates(*pair, world_size=trainer.world_size, peak_flops=self._peak)
                metrics.update({f"throughput/{scope}/{k}": v for k, v in values.items() if v is not None})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if "throughput/window/tokens_per_sec" in metrics:
            # A host number for GymProgressBar, not ``pl_module.log(prog_bar=True)``: Lightning would hold it as a
            # device tensor and convert it with ``.item()`` (a host sync on CUDA) at every later batch end.
            self.progress_bar_items = {"tok/s": metrics["throughput/window/tokens_per_sec"]}

    def _resolve_flops(self, pl_module: pl.LightningModule) -> tuple[tuple[float, float] | None, dict[str, Any]]:
        if self.flops_per_token is not None:
            return (float(self.flops_per_token), 0.0), {"source": "user", "flops_per_token": self.flops_per_token}
        model = getattr(pl_module, "model", pl_module)
        config = getattr(model, "config", None)
        if config is None:
            rank_zero_warn("ThroughputCallback: no Hugging Face `model.config` and no flops_per_token; FLOPs are n/a.")
            return None, {"source": None}
        try:
            flops = transformer_flops(model, config)
        except ValueError as err:
            rank_zero_warn(f"ThroughputCallback: FLOPs are n/a: {err}")
            return None, {"source": None}
        info = {"source": PALM_CONVENTION, **flops.__dict__, "dense_per_token": flops.dense_per_token}
        info["attention_per_token_per_position"] = flops.attention_per_token_per_position
        return (float(flops.dense_per_token), float(flops.attention_per_token_per_position)), info

    def _resolve_peak(self, trainer: pl.Trainer) -> tuple[str, str | None, float | None, str | None]:
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        dtype = precision_to_dtype(str(trainer.precision), torch.get_float32_matmul_precision())
        if self.peak_flops is not None:
            return name, dtype, self.peak_flops, "user"
        peak = dense_peak_flops(name, dtype) if dtype is not None and device.type == "cuda" else None
        return name, dtype, peak, ("table" if peak is not None else None)

    def _summary(self, trainer: pl.Trainer, measured: int) -> dict[str, Any]:
        pairs = {"total": self._window.total(), "window": self._window.window()}
        last = self._window.last
        return {
            "world_size": trainer.world_size,
            "device_name": self._device_name,
            "matmul_dtype": self._dtype,
            "peak_flops_per_device": self._peak,
            "peak_flops_source": self._peak_source,
            "flops": self._flops_info,
            "warmup_steps": self.warmup_steps,
            "measured_steps": max(measured, 0),
            "elapsed_sec": (last.time - self._window.first.time) if last and self._window.first else None,
            "job_counts": last.job.__dict__ if last else None,
            **{name: rates(*pair, trainer.world_size, self._peak) if pair else None for name, pair in pairs.items()},
        }


def _argument_problems(
    warmup_steps: int,
    window_steps: int,
    log_every_n_steps: int | None,
    flops_per_token: float | None,
    peak_flops: float | None,
) -> list[str]:
    problems = []
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        problems.append(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if not isinstance(window_steps, int) or window_steps < 1:
        problems.append(f"window_steps must be an integer >= 1, got {window_steps!r}")
    if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
        problems.append(f"log_every_n_steps must be an integer >= 1 or None, got {log_every_n_steps!r}")
    for name, value in (("flops_per_token", flops_per_token), ("peak_flops", peak_flops)):
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            problems.append(f"{name} must be a positive number or None, got {value!r}")
    return problems


def _summary_table(summary: dict[str, Any]) -> str:
    """The end-of-fit report: measured rates, with the plan's predictions beside them when there are any."""
    total = summary.get("total")
    plan = summary.get("plan")
    if not total:
        return (
            f"ThroughputCallback: nothing measured ({summary['measured_steps']} optimizer steps after "
            f"{summary['warmup_steps']} warm-up steps); run more steps or lower warmup_steps."
            + ("" if plan is None else "\nplan check: no prediction, the run was too short to measure.")
        )

    def fmt(key: str, scale: float = 1.0, digits: int = 1) -> str:
        value = total.get(key)
        return "n/a" if value is None else f"{value * scale:,.{digits}f}"

    rows = [
        ["tokens/s (job)", fmt("tokens_per_sec")],
        ["target tokens/s (job)", fmt("target_tokens_per_sec")],
        ["tokens/s per device", fmt("device_tokens_per_sec")],
        ["samples/s (job)", fmt("samples_per_sec", digits=2)],
        ["optimizer steps/s", fmt("optimizer_steps_per_sec", digits=3)],
        ["TFLOP/s per device", fmt("device_tflops_per_sec", digits=3)],
        ["MFU", fmt("mfu", scale=100, digits=1) + ("%" if total.get("mfu") is not None else "")],
    ]
    title = (
        f"Throughput over {summary['measured_steps']} optimizer steps after {summary['warmup_steps']} warm-up steps, "
        f"{summary['world_size']} x {summary['device_name']} ({summary['matmul_dtype']})"
    )
    if plan is None:
        return title + "\n" + markdown_table(["metric", "value"], rows)
    return title + "\n" + _with_plan(rows, total, plan)


def _with_plan(rows: list[list[str]], total: dict[str, Any], plan: dict[str, Any]) -> str:
    """``rows`` with a "plan" column (the planner's step time and tokens/s) and a line on the ratio or on why there
    is no prediction."""
    if "unavailable" in plan:
        table = markdown_table(["metric", "measured", "plan"], [[*row, ""] for row in rows])
        return table + f"\nplan check: no prediction: {plan['unavailable']}."
    steps = total.get("optimizer_steps_per_sec")
    predicted = {
        "tokens/s (job)": f"{plan['tokens_per_second']:,.1f}",
        "tokens/s per device": f"{plan['device_tokens_per_second']:,.1f}",
        "optimizer steps/s": f"{1 / plan['step_seconds']:,.3f}",
    }
    rows = [[*row, predicted.get(row[0], "")] for row in rows]
    rows.insert(5, ["step time (s)", "n/a" if not steps else f"{1 / steps:,.4f}", f"{plan['step_seconds']:,.4f}"])
    table = markdown_table(["metric", "measured", "plan"], rows)
    return table + (
        f"\nplan check: measured / predicted step time = {plan['ratio']:.2f} ({plan['strategy']}, "
        f"{plan['hardware']['name']}, micro-batch {plan['setup']['micro_batch_size']} x "
        f"{plan['setup']['seq_length']} tokens)"
    )
