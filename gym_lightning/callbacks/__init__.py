"""Callbacks that measure and show training: throughput (tokens/s, TFLOP/s, MFU), memory held per rank, a quiet
progress bar, and the loss/lr curves written to ``curves.png`` (and an HF-style ``trainer_state.json``)."""

from __future__ import annotations

from gym_lightning.callbacks.curves import CurvesCallback
from gym_lightning.callbacks.memory import MemoryCallback
from gym_lightning.callbacks.progress import GymProgressBar
from gym_lightning.callbacks.throughput import ThroughputCallback
from gym_lightning.callbacks.trainer_state import TrainerStateCallback

__all__ = ["CurvesCallback", "GymProgressBar", "MemoryCallback", "ThroughputCallback", "TrainerStateCallback"]
