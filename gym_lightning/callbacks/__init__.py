"""Callbacks that measure training: throughput (tokens/s, TFLOP/s, MFU) and memory held per rank."""

from __future__ import annotations

from gym_lightning.callbacks.memory import MemoryCallback
from gym_lightning.callbacks.throughput import ThroughputCallback

__all__ = ["MemoryCallback", "ThroughputCallback"]
