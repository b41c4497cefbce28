"""Memory planner: per-GPU and per-node memory of finetuning a model with each strategy, before renting GPUs.

``plan("llama-3-70b", gpu_memory="24GB", activation_checkpointing=True).table()``; on the command line
``python -m gym_lightning plan --model llama-3-70b ...``; ``longest_sequence(shape, strategy, setup)``: the longest
sequence that fits; ``run_settings(yaml.safe_load(...))``: ``plan``'s arguments for the run a ``gym fit`` YAML
launches (``gym plan --config run.yaml``). Formulas and sources: docs/planner.md.
"""

from __future__ import annotations

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.catalog import BUNDLED, resolve_shape
from gym_lightning.planner.estimate import STRATEGIES, Estimate, Setup, Strategy, estimate, estimate_all
from gym_lightning.planner.long_sequence import longest_sequence
from gym_lightning.planner.phases import qlora_peak
from gym_lightning.planner.report import PlanReport, parse_bytes, plan
from gym_lightning.planner.run_config import RunSettings, run_settings

__all__ = [
    "BUNDLED",
    "STRATEGIES",
    "Estimate",
    "ModelShape",
    "PlanReport",
    "RunSettings",
    "Setup",
    "Strategy",
    "estimate",
    "estimate_all",
    "longest_sequence",
    "parse_bytes",
    "plan",
    "qlora_peak",
    "resolve_shape",
    "run_settings",
]
