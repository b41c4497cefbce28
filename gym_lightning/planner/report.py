"""``plan(...)``: the planner as a Python function, returning a :class:`PlanReport` (``.table()``, ``.to_dict()``).

``plan`` takes a :class:`~gym_lightning.planner.spec.RunSpec`, or a model and any of the spec's settings by their
flat names (``plan("llama-3-70b", gpu_memory="24GB", activation_checkpointing=True)``); every value it cannot read
is one :class:`GymUserError` that lists them all.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner import tables
from gym_lightning.planner.activations import sequence_parallel_problems
from gym_lightning.planner.budget import Budget, fastest, ranking, speed_dict, speed_lines
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.estimate import Estimate, estimate, estimate_all
from gym_lightning.planner.experts import target_parameter_problems
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.long_sequence import longest_sequence, sequence_step
from gym_lightning.planner.machines import Figures, Machine, machine_of
from gym_lightning.planner.params import param_counts, quantized_base
from gym_lightning.planner.phases import PhasePeaks, phase_peaks
from gym_lightning.planner.spec import LEAVES, GiB, RunSpec, local_tokens, parse_bytes
from gym_lightning.planner.spec_flags import coerce, names_ok, spec_problems
from gym_lightning.planner.strategies import STRATEGIES, STRATEGY_BY_KEY, Strategy, planner_strategy
from gym_lightning.planner.timing import Speed, speed
from gym_lightning.vocabulary import STRATEGY_NAMES, STRATEGY_PRESET_BY_NAME


@dataclass(frozen=True)
class PlanReport:
    """What :func:`plan` found: one :class:`Estimate` per strategy (fastest first) and the recommendation."""

    shape: ModelShape
    setup: RunSpec
    estimates: list[Estimate]
    show_longest_sequence: bool = False  # table(): add the "longest seq" column (to_dict() always has it)
    selected: str | None = None  # the key of the run's own strategy: a line of its own
    machine: Machine | None = None  # the hardware the step time is predicted on (None: no speed predictions)
    budget: Budget = field(default_factory=Budget)  # tokens to train and the price of a GPU-hour

    @property
    def spec(self) -> RunSpec:
        return self.setup

    @property
    def recommendation(self) -> Estimate | None:
        """The fastest strategy that fits (predicted tokens/s; the list's order without a machine)."""
        return fastest(self.estimates, self.speeds())

    def speeds(self) -> list[Speed | None]:
        """The step-time model's prediction for each strategy, in ``estimates`` order (None where not modelled)."""
        return list(self._speeds)

    @functools.cached_property
    def _speeds(self) -> tuple[Speed | None, ...]:
        # Computed once: the recommendation, ranking, table and JSON all read them (a frozen report never changes).
        if self.machine is None:
            return (None,) * len(self.estimates)
        hw = self.machine.hardware
        return tuple(speed(self.shape, e.strategy, self.setup, hw) if e.modelled else None for e in self.estimates)

    def ranking(self) -> list[str]:
        """The keys of the strategies that fit, fastest first."""
        return [self.estimates[i].strategy.key for i in ranking(self.estimates, self.speeds())]

    def longest_sequences(self) -> list[int]:
        """The longest sequence that fits the GPUs at micro-batch 1 with each strategy, in ``estimates`` order."""
        return [longest_sequence(self.shape, e.strategy, self.setup) for e in self.estimates]

    def phases(self) -> list[PhasePeaks]:
        """The peak per rank of each phase (load, step, save, export), one per strategy, in ``estimates`` order."""
        return [phase_peaks(self.shape, e.strategy, self.setup) for e in self.estimates]

    def to_dict(self) -> dict[str, Any]:
        counts, best, s = param_counts(self.shape, self.setup), self.recommendation, self.setup
        ranks = {key: place + 1 for place, key in enumerate(self.ranking())}
        speeds = [speed_dict(v, s.world_size, self.budget, ranks.get(e.strategy.key)) for e, v in self._pairs()]
        rows = zip(self.estimates, self.longest_sequences(), self.phases(), speeds, strict=True)
        return {
            "model": asdict(self.shape),
            "parameters": {
                "total": counts.total_with_adapters,
                "trainable": counts.trainable,
                "active": self.shape.active_params(),
                "nf4": quantized_base(self.shape, s).weights,
            },
            "setup": {k: (v.key if isinstance(v, Strategy) else v) for k, v in s.flat().items()},
            "usable_gpu_memory": s.usable_gpu_memory,
            "data_parallel_size": s.data_parallel_size,
            "tokens_per_rank": local_tokens(s, s.micro_batch_size),
            "longest_sequence_step": sequence_step(s),
            "hardware": None if self.machine is None else tables.machine_dict(self.machine),
            "strategies": [
                {**tables.estimate_dict(e), "longest_sequence": n, "phases": tables.phases_dict(p), "speed": v}
                for e, n, p, v in rows
            ],
            "ranking": self.ranking(),
            "recommendation": None if best is None else best.strategy.key,
            "selected": self.selected,
        }

    def _pairs(self) -> list[tuple[Estimate, Speed | None]]:
        return list(zip(self.estimates, self.speeds(), strict=True))

    def table(self) -> str:
        lines = [*tables.header_lines(self), *tables.memory_table(self), "", *self.phase_table()]
        lines += [*self.speed_table(), "", self.recommendation_line(), *self.selected_lines()]
        return "\n".join(lines)

    def phase_table(self) -> list[str]:
        """Peak per rank in each phase, GiB: ``host / device`` on GPUs, host only on CPU ranks."""
        return tables.phase_table(self.estimates, self.phases(), self.setup.accelerator == "cpu")

    def speed_table(self) -> list[str]:
        """The predicted speed of each strategy (a blank line first), none without a machine."""
        if self.machine is None:
            return []
        lines = speed_lines(self.estimates, self.speeds(), self.machine, self.setup.world_size, self.budget)
        return ["", *lines] if lines else []

    def selected_lines(self) -> list[str]:
        """One line on the run's own strategy, none without one."""
        chosen = next((e for e in self.estimates if e.strategy.key == self.selected), None)
        if chosen is None:
            return []
        name = f"Your run: {chosen.strategy.label} (strategy: {chosen.strategy.trainer_strategy})"
        if not chosen.modelled:
            return [f"{name}: not modelled with these settings."]
        verdict = "fits" if chosen.fits else f"does not fit ({tables.fits_text(chosen).removeprefix('no (')[:-1]})"
        return [
            f"{name} {verdict}: {tables.gib(chosen.gpu_total)} per GPU, micro-batch up to {chosen.max_micro_batch}, "
            f"host {tables.gib(chosen.host_per_node)} per node."
        ]

    def recommendation_line(self) -> str:
        best = self.recommendation
        if best is None:
            return (
                "Recommendation: nothing fits. Try activation checkpointing, a smaller micro-batch or sequence, "
                "LoRA (--lora_r), more GPUs or nodes, or more host memory for offloading."
            )
        predicted = dict((e.strategy.key, v) for e, v in self._pairs())[best.strategy.key]
        why = "the fastest that fits"
        if predicted is not None:
            why += f" ({predicted.tokens_per_second_per_gpu:,.0f} tokens/s per GPU predicted)"
        return (
            f"Recommendation: {best.strategy.label} (strategy: {best.strategy.trainer_strategy}), {why}; "
            f"{tables.gib(best.gpu_total)} per GPU, micro-batch up to {best.max_micro_batch}."
        )


def plan(
    model: str | ModelShape | RunSpec | None = None,
    *,
    spec: RunSpec | None = None,
    hardware: Hardware | None = None,
    figures: Figures | None = None,
    tokens: float | None = None,
    price_per_gpu_hour: float | None = None,
    longest_sequence: bool = False,
    epochs: float = 1.0,
    **settings: Any,
) -> PlanReport:
    """Memory per GPU and per node of finetuning a model with every strategy, and the fastest one that fits.

    Args:
        model: A bundled architecture name (``llama-3-8b``, ``qwen3-32b``, ... ``catalog.BUNDLED``), a preset, a
            local ``config.json`` or model folder, a :class:`ModelShape`, or a whole :class:`RunSpec`.
        spec: The run (its ``model`` leaf names the model unless ``model`` does); ``settings`` override it.
        hardware: The step-time figures given whole (CPU ranks: measured); overrides the spec's GPU.
        figures: Explicit figures over the catalog's (the spec's ``peak_tflops``, ``compute_efficiency``, ...).
        tokens: Tokens to train on: the hours, GPU-hours (and cost) of each strategy.
        price_per_gpu_hour: Dollars per GPU-hour: the cost column.
        longest_sequence: Add the "longest seq" column to ``table()`` (``to_dict()`` always has it).
        epochs: Passes over the data that ``tokens`` make (a precomputed reference runs over the data once).
        **settings: Any leaf of :class:`RunSpec` by its flat name (``gpus_per_node``, ``gpu_memory="24GB"``,
            ``lora_r``, ``strategy``: the run's own strategy, a registered name, planner key or ``Strategy``).
    """
    problems: list[str] = []
    run, shape, unknown = _spec(model, spec, settings, figures, problems)
    chosen = run_strategy(run.parallel.strategy, problems)
    budget = Budget(tokens, price_per_gpu_hour, epochs)
    problems += budget.problems() + spec_problems(run)
    if names_ok(run.lora_target_parameters):
        problems += target_parameter_problems(run.lora_target_parameters, shape, _int(run.lora_r))
    problems += _targets_problem(run)
    found = _machine(run, hardware, problems)
    if not problems:
        problems += sequence_parallel_problems(shape, run)
    shape = _refuse(problems, shape, unknown)
    estimates = estimate_all(shape, run)
    if chosen is not None and not any(e.strategy.key == chosen.key for e in estimates):
        estimates.append(estimate(shape, chosen, run))
    selected = None if chosen is None else chosen.key
    return PlanReport(shape, run, estimates, longest_sequence, selected, found, budget)


def _spec(
    model: str | ModelShape | RunSpec | None,
    spec: RunSpec | None,
    settings: dict[str, Any],
    figures: Figures | None,
    problems: list[str],
) -> tuple[RunSpec, ModelShape | None, GymUserError | None]:
    """The run the arguments describe, its model's shape (or the error naming it unknown), values coerced."""
    base = model if isinstance(model, RunSpec) else spec or RunSpec()
    if isinstance(model, (str, ModelShape)):
        settings = {**settings, "model": model if isinstance(model, str) else model.name}
    if figures is not None:
        settings = {**{k: v for k, v in vars(figures).items() if v is not None}, **settings}
    if unknown := sorted(k for k in settings if k not in LEAVES):
        raise TypeError(f"plan() got unknown settings {unknown}")
    values = {}
    for key, value in settings.items():
        try:
            values[key] = coerce(key, value)
        except GymUserError as err:
            problems.append(str(err).rstrip("."))
    run = replace(base, **values)
    if isinstance(model, ModelShape):
        return run, model, None
    return run, *_resolve(run.model, run.config_overrides)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _targets_problem(run: RunSpec) -> list[str]:
    if run.lora_targets == "none" and not run.lora_target_parameters and run.lora_r:
        return [
            "lora_targets none adapts no linear layer and lora_target_parameters names no expert: nothing to train; "
            "give lora_target_parameters (all-experts) or lora_targets all-linear / attention-qv"
        ]
    return []


def _machine(run: RunSpec, hardware: Hardware | None, problems: list[str]) -> Machine | None:
    """The plan's :class:`Machine`: ``hardware`` as given, else the catalog's GPU; none on CPU ranks without
    measured figures. A name or figure it cannot read goes to ``problems``."""
    if hardware is not None:
        return Machine(hardware, 0, "given")
    if run.accelerator == "cpu" or problems:
        return None
    try:
        return machine_of(run)
    except GymUserError as err:
        problems.append(str(err).rstrip("."))
        return None


def run_strategy(strategy: str | Strategy | None, problems: list[str]) -> Strategy | None:
    """The planner's row for the run's ``strategy`` (a row of the list that shards and offloads alike, else the
    strategy itself); an unknown name is added to ``problems``."""
    if strategy is None or isinstance(strategy, Strategy):
        found = strategy
    elif strategy in STRATEGY_BY_KEY:
        found = STRATEGY_BY_KEY[strategy]
    elif strategy in STRATEGY_PRESET_BY_NAME:
        preset = STRATEGY_PRESET_BY_NAME[strategy]
        found = planner_strategy("run", strategy, preset.strategy_class, preset.init_args, name=strategy)
    else:
        problems.append(
            f"strategy must be one of gym_lightning's ({', '.join(STRATEGY_NAMES)}) or a planner key "
            f"({', '.join(STRATEGY_BY_KEY)}), got {strategy!r}"
        )
        return None
    same = [s for s in STRATEGIES if found is not None and s.layout() == found.layout()]
    return same[0] if same else found


def _refuse(problems: list[str], shape: ModelShape | None, unknown: GymUserError | None) -> ModelShape:
    """``shape`` if nothing is wrong, else one error listing every problem (an unknown model alone keeps its own
    message)."""
    if unknown is not None and not problems:
        raise unknown
    if unknown is not None:
        problems = [*problems, str(unknown).rstrip(".")]
    if problems or shape is None:
        raise GymUserError("Invalid planner settings: " + "; ".join(problems) + ".")
    return shape


def _resolve(model: str | None, config_overrides: Any) -> tuple[ModelShape | None, GymUserError | None]:
    """The shape of ``model``, or the error naming it unknown: kept, so that one message lists it with the other
    problems (the sequence-parallel ones need the shape's heads)."""
    if model is None:
        return None, GymUserError(
            "Invalid planner settings: model is required (a bundled name, preset or config.json)."
        )
    try:
        return resolve_shape(model, config_overrides), None
    except GymUserError as err:
        return None, err


__all__ = ["GiB", "PlanReport", "parse_bytes", "plan", "run_strategy"]
