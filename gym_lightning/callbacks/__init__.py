"""Callbacks that measure training: throughput (tokens/s, TFLOP/s, MFU) and memory held per rank."""

from __future__ import annotations

from gym_lightning.callbacks.memory_callback import MemoryCallback
from gym_lightning.callbacks.throughput_callback import ThroughputCallback

__all__ = ["MemoryCallback", "ThroughputCallback"]
