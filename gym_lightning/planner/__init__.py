"""Planner: per-GPU and per-node memory, step time and cost of finetuning a model with each strategy, before renting
GPUs.

``plan("llama-3-70b", gpu_memory="24GB", activation_checkpointing=True).table()``;
``plan("qwen3-8b", gpu="h200", nodes=4, tokens=2e9, price_per_gpu_hour=3.5)`` adds the speed table (``planner.timing``
on the hardware catalog's figures, ``planner.machines``); ``choose_strategy(run_yaml)``: what ``strategy: gym_auto``
picks; on the command line
``python -m gym_lightning plan --model llama-3-70b ...``; ``longest_sequence(shape, strategy, setup)``: the longest
sequence that fits; ``run_settings(yaml.safe_load(...))``: ``plan``'s arguments for the run a ``gym fit`` YAML
launches (``gym plan --config run.yaml``). Formulas and sources: docs/planner.md.
"""

from __future__ import annotations

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.auto import AutoChoice, choose_strategy
from gym_lightning.planner.catalog import BUNDLED, resolve_shape
from gym_lightning.planner.estimate import STRATEGIES, Estimate, Setup, Strategy, estimate, estimate_all
from gym_lightning.planner.long_sequence import longest_sequence
from gym_lightning.planner.machines import Figures, Machine, machine
from gym_lightning.planner.phases import qlora_peak
from gym_lightning.planner.report import PlanReport, parse_bytes, plan
from gym_lightning.planner.run_config import RunSettings, run_settings
from gym_lightning.planner.timing import Hardware, Speed, StepTime, speed, step_time

__all__ = [
    "BUNDLED",
    "STRATEGIES",
    "AutoChoice",
    "Estimate",
    "Figures",
    "Hardware",
    "Machine",
    "ModelShape",
    "PlanReport",
    "RunSettings",
    "Setup",
    "Speed",
    "StepTime",
    "Strategy",
    "choose_strategy",
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
