"""Callbacks only (their math lives in ``gym_lightning.metrics``): throughput (tokens/s, TFLOP/s, MFU) and memory
held per rank; the non-finite loss/gradient guard; the Hugging Face export at the end of ``fit``; a quiet progress
bar, the loss/lr curves written to ``curves.png`` and an HF-style ``trainer_state.json``."""

from __future__ import annotations

from gym_lightning.callbacks.curves import CurvesCallback
from gym_lightning.callbacks.epochs import EpochFraction
from gym_lightning.callbacks.hf_export import HFExport
from gym_lightning.callbacks.memory_monitor import MemoryCallback
from gym_lightning.callbacks.nonfinite import NonFiniteGuard, NonFiniteLossError
from gym_lightning.callbacks.progress import GymProgressBar
from gym_lightning.callbacks.throughput_monitor import ThroughputCallback
from gym_lightning.callbacks.trainer_state import TrainerStateCallback

__all__ = [
    "CurvesCallback",
    "EpochFraction",
    "GymProgressBar",
    "HFExport",
    "MemoryCallback",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "ThroughputCallback",
    "TrainerStateCallback",
]
