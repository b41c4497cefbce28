"""``trainer.strategy: gym_auto``: the planner picks, for the run's model, batch and hardware, the fastest strategy that
fits, and says which and why in one line (pure: the caller measures the hardware; ``cli.GymCLI`` does on a run).

The choice is :meth:`PlanReport.recommendation`: the strategies that fit the GPUs and the host, ranked by the step-time
model's tokens per second (``planner.timing``), ties within 5 % broken by the planner's list order
(``planner.budget.ranking``). On CPU ranks without measured figures there is no step-time prediction and the list
order alone decides (DDP first: on one host nothing is faster than replicating what fits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gym_lightning.errors import GymUserError
from gym_lightning.planner.report import GiB, PlanReport, plan
from gym_lightning.planner.run_config import run_settings
from gym_lightning.planner.timing import Hardware
from gym_lightning.vocabulary import AUTO_STRATEGY


@dataclass(frozen=True)
class AutoChoice:
    """What ``gym_auto`` chose.

    Args:
        strategy: The ``trainer.strategy`` value that selects it (a registered name or ``class_path`` + ``init_args``).
        line: One line: which strategy, and why.
        report: The plan it was chosen from (``report.table()`` shows the ranking).
    """

    strategy: str | dict[str, Any]
    line: str
    report: PlanReport


def is_auto(strategy: Any) -> bool:
    """Whether ``trainer.strategy`` asks the planner to choose."""
    return isinstance(strategy, str) and strategy == AUTO_STRATEGY


def choose_strategy(
    config: Mapping[str, Any],
    gpu: str | None = None,
    gpu_memory: int | None = None,
    host_memory: int | None = None,
    hardware: Hardware | None = None,
    gpus_per_node: int | None = None,
    source: str = "the run config",
) -> AutoChoice:
    """The fastest strategy that fits the run ``config`` describes (a ``gym fit`` YAML as plain data).

    Args:
        config: The run's ``trainer`` / ``model`` / ``data`` sections (``trainer.strategy`` is ignored).
        gpu: The catalog GPU the run is on (``metrics.hardware.gpu_for_device_name``); ``None``: the catalog default.
        gpu_memory: Bytes of one GPU as the driver reports it; ``None``: the GPU's catalog figure.
        host_memory: Bytes of host RAM per node; ``None``: the planner's default.
        hardware: Measured step-time figures (CPU ranks); overrides ``gpu``.
        gpus_per_node: Ranks per node when the config says ``devices: auto``.
        source: How errors name the config.

    Raises:
        GymUserError: when nothing fits, with what to change.
    """
    run = run_settings(config, source=source)
    settings = dict(run.settings)
    settings.pop("strategy", None)
    if gpus_per_node is not None and "gpus_per_node" not in settings:
        settings["gpus_per_node"] = gpus_per_node
    extra: dict[str, Any] = {"gpu": gpu, "hardware": hardware}
    if gpu_memory is not None:
        extra["gpu_memory"] = gpu_memory
    if host_memory is not None:
        extra["host_memory"] = host_memory
    report = plan(**settings, **extra)
    best = report.recommendation
    if best is None:
        advice = report.recommendation_line().split("nothing fits. ", 1)[-1]
        raise GymUserError(f"strategy {AUTO_STRATEGY}: no strategy fits {source} on {_where(report)}. {advice}")
    selects = best.strategy.trainer_config()
    if selects is None:  # every row of the planner's list stands for a gym_lightning strategy (tests check it)
        raise RuntimeError(f"planner row {best.strategy.key} has no trainer.strategy")
    return AutoChoice(selects, choice_line(report), report)


def choice_line(report: PlanReport) -> str:
    """``gym_auto: FSDP full (strategy: gym_fsdp), the fastest of 9 that fit on 8 x h100-sxm, nvlink4: ...``."""
    best = report.recommendation
    if best is None:
        return f"{AUTO_STRATEGY}: nothing fits."
    ranked = report.ranking()
    speeds = dict(zip((e.strategy.key for e in report.estimates), report.speeds(), strict=True))
    s, where = report.setup, _where(report)
    memory = f"{best.gpu_total / GiB:.1f} of {s.usable_gpu_memory / GiB:.1f} GiB per GPU"
    if s.accelerator == "cpu":
        memory = f"{best.host_per_node / GiB:.1f} of {s.host_memory / GiB:.1f} GiB of host RAM"
    predicted = speeds.get(best.strategy.key)
    if predicted is None:
        return (
            f"{AUTO_STRATEGY}: {best.strategy.label} (strategy: {best.strategy.trainer_strategy}), the first that fits "
            f"on {where} in the planner's order (no step-time figures for this hardware); {memory}."
        )
    line = (
        f"{AUTO_STRATEGY}: {best.strategy.label} (strategy: {best.strategy.trainer_strategy}), the fastest of "
        f"{len(ranked)} that fit on {where}: {predicted.tokens_per_second_per_gpu:,.0f} tokens/s per GPU predicted, "
        f"{memory}"
    )
    if len(ranked) > 1:
        runner = next(e for e in report.estimates if e.strategy.key == ranked[1])
        runner_speed = speeds[runner.strategy.key]
        line += (
            f"; next {runner.strategy.label} at {runner_speed.tokens_per_second_per_gpu:,.0f}" if runner_speed else ""
        )
    return line + "."


def _where(report: PlanReport) -> str:
    """``8 x h100-sxm, nvlink4`` (or the CPU ranks)."""
    if report.machine is not None:
        return f"{report.setup.world_size} x {report.machine.hardware.name}"
    return f"{report.setup.world_size} {report.setup.accelerator.upper()} rank(s)"
