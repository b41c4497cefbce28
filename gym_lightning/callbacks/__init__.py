"""Callbacks: throughput (tokens/s, TFLOP/s, MFU) and memory held per rank; the non-finite loss/gradient guard;
the Hugging Face export at the end of ``fit``."""

from __future__ import annotations

from gym_lightning.callbacks.export import HFExport
from gym_lightning.callbacks.memory_callback import MemoryCallback
from gym_lightning.callbacks.nonfinite import NonFiniteGuard, NonFiniteLossError
from gym_lightning.callbacks.throughput_callback import ThroughputCallback

__all__ = ["HFExport", "MemoryCallback", "NonFiniteGuard", "NonFiniteLossError", "ThroughputCallback"]
