"""Planner: per-GPU and per-node memory, step time and cost of finetuning a model with each strategy, before renting
GPUs.

``plan("llama-3-70b", gpu_memory="24GB", activation_checkpointing=True).table()``;
``plan("qwen3-8b", gpu="h200", nodes=4, tokens=2e9, price_per_gpu_hour=3.5)`` adds the speed table. One run
description, :class:`RunSpec` (``planner.spec``), is what ``plan``, ``gym plan`` (flags or ``--config``), the live-run
plan check and ``strategy: gym_auto`` read; each strategy family's costs are its cost model (``planner.families``).
``choose_strategy(run_yaml)``: what ``gym_auto`` picks; ``longest_sequence(shape, strategy, spec)``: the longest
sequence that fits; ``run_settings(yaml.safe_load(...))``: the settings of the run a ``gym fit`` YAML launches.
Formulas, validation and sources: docs/planner.md.
"""

from __future__ import annotations

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.auto import AutoChoice, choose_strategy
from gym_lightning.planner.catalog import BUNDLED, resolve_shape
from gym_lightning.planner.estimate import STRATEGIES, Estimate, Setup, Strategy, estimate, estimate_all
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.long_sequence import longest_sequence
from gym_lightning.planner.machines import Figures, Machine, machine
from gym_lightning.planner.phases import qlora_peak
from gym_lightning.planner.report import PlanReport, parse_bytes, plan
from gym_lightning.planner.run_config import RunSettings, run_settings
from gym_lightning.planner.spec import STAGES, RunSpec
from gym_lightning.planner.timing import Speed, StepTime, speed, step_time

__all__ = [
    "BUNDLED",
    "STAGES",
    "STRATEGIES",
    "AutoChoice",
    "Estimate",
    "Figures",
    "Hardware",
    "Machine",
    "ModelShape",
    "PlanReport",
    "RunSettings",
    "RunSpec",
    "Setup",
    "Speed",
    "StepTime",
    "Strategy",
    "choose_strategy",
    "cost_model",
    "estimate",
    "estimate_all",
    "longest_sequence",
    "machine",
    "parse_bytes",
    "plan",
    "qlora_peak",
    "resolve_shape",
    "run_settings",
    "speed",
    "step_time",
]
