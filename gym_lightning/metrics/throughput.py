"""Throughput arithmetic: cumulative counters sampled at log points, turned into rates (pure, no Lightning).

The callback accumulates counters on the device and reads them (one all-reduce for the job totals) only at log
points, so there is no host sync per step. A :class:`Sample` is one such read; rates are differences of two samples
divided by the wall-clock time between them. Because the reads synchronise the device, the time between two samples
is exact even though a single step's time is not observed (on CUDA the host runs ahead of the device between syncs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from gym_lightning.errors import GymUserError
from gym_lightning.loss import count_target_tokens

# Order of the counters in the tensor the callback accumulates on the device.
COUNTER_NAMES: tuple[str, ...] = ("samples", "tokens", "target_tokens", "sum_squared_lengths")


@dataclass(frozen=True)
class Counters:
    """Cumulative counts since the end of warm-up (either one rank's or summed over all ranks).

    Args:
        steps: Optimizer steps.
        samples: Sequences (rows of ``input_ids``).
        tokens: Non-padding tokens (``attention_mask`` sum), i.e. tokens the model processed usefully.
        target_tokens: Tokens that contributed to the loss (labels ``!= -100`` after the causal shift).
        flops: Model training FLOPs (``None`` when no FLOPs formula is known).
    """

    steps: int
    samples: int
    tokens: int
    target_tokens: int
    flops: float | None


@dataclass(frozen=True)
class Sample:
    """Counters read at wall-clock ``time`` (seconds), locally and summed over the ``world_size`` ranks."""

    time: float
    local: Counters
    job: Counters


def rates(start: Sample, end: Sample, world_size: int, peak_flops: float | None) -> dict[str, float | None]:
    """Rates between two samples: job totals, per-device averages (job / world size) and this rank's own.

    MFU is the per-device average model FLOP/s over the dense peak of one device; ``None`` when either is unknown.
    """
    elapsed = end.time - start.time
    if elapsed <= 0:
        return {}
    out: dict[str, float | None] = {}
    for field in fields(Counters):
        job = _delta(start.job, end.job, field.name)
        local = _delta(start.local, end.local, field.name)
        name = "optimizer_steps" if field.name == "steps" else field.name
        out[f"{name}_per_sec"] = None if job is None else job / elapsed
        if field.name != "steps":  # every rank takes the same optimizer steps
            out[f"device_{name}_per_sec"] = None if job is None else job / elapsed / world_size
            out[f"local_{name}_per_sec"] = None if local is None else local / elapsed
    device_flops = out["device_flops_per_sec"]
    out["device_tflops_per_sec"] = None if device_flops is None else device_flops / 1e12
    out["mfu"] = None if device_flops is None or not peak_flops else device_flops / peak_flops
    return out


def _delta(start: Counters, end: Counters, name: str) -> float | None:
    a, b = getattr(start, name), getattr(end, name)
    return None if a is None or b is None else b - a


class SlidingWindow:
    """The samples of the last ``window_steps`` optimizer steps (at least two samples are kept).

    Args:
        window_steps: Width of the window in optimizer steps.
    """

    def __init__(self, window_steps: int) -> None:
        if not isinstance(window_steps, int) or window_steps < 1:
            raise GymUserError(f"window_steps must be a positive integer, got {window_steps!r}.")
        self.window_steps = window_steps
        self.first: Sample | None = None
        self._samples: deque[Sample] = deque()

    def append(self, sample: Sample) -> None:
        """Add a sample; samples must come in increasing time and step order."""
        if self._samples and (sample.time < self._samples[-1].time or sample.job.steps < self._samples[-1].job.steps):
            raise ValueError("throughput samples must not go back in time or steps; the counters were reset.")
        if self.first is None:
            self.first = sample
        self._samples.append(sample)
        while len(self._samples) > 2 and sample.job.steps - self._samples[1].job.steps >= self.window_steps:
            self._samples.popleft()

    @property
    def last(self) -> Sample | None:
        return self._samples[-1] if self._samples else None

    def interval(self) -> tuple[Sample, Sample] | None:
        """The last two samples: rates over the latest logging interval (the last step when logging every step)."""
        return (self._samples[-2], self._samples[-1]) if len(self._samples) >= 2 else None

    def window(self) -> tuple[Sample, Sample] | None:
        """Oldest and newest samples of the window."""
        return (self._samples[0], self._samples[-1]) if len(self._samples) >= 2 else None

    def total(self) -> tuple[Sample, Sample] | None:
        """First sample ever (end of warm-up) and newest: rates over the whole measured run."""
        last = self.last
        return (self.first, last) if self.first is not None and last is not None and last is not self.first else None


def batch_counts(batch: Mapping[str, Any]) -> torch.Tensor:
    """``[samples, tokens, target_tokens, Σ length²]`` of one micro-batch, as an ``int64`` tensor on its device.

    ``tokens`` are non-padding tokens (``attention_mask`` sum; every position when there is no mask); lengths are per
    row, for the attention FLOPs. ``target_tokens`` is 0 when the batch has no ``labels``. No host sync.

    Raises:
        TypeError: if the batch is not a mapping holding a 2-D ``input_ids`` tensor.
    """
    input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise GymUserError(
            "ThroughputCallback counts tokens from dict batches with a 2-D `input_ids` tensor (plus optional "
            f"`attention_mask` and `labels`), got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            + "; return such dicts from your DataLoader, or do not use this callback."
        )
    mask = batch.get("attention_mask")
    lengths = mask.sum(-1) if isinstance(mask, torch.Tensor) else torch.full_like(input_ids[:, 0], input_ids.size(1))
    labels = batch.get("labels")
    targets = count_target_tokens(labels) if isinstance(labels, torch.Tensor) else lengths.new_zeros(())
    lengths = lengths.long()
    # The row count is a host integer: filled in on the device (a kernel argument), not copied there. A tensor made
    # from it (``new_tensor``, ``torch.tensor``) would be a blocking host-to-device copy, a stream sync on CUDA.
    samples = torch.full((), input_ids.size(0), dtype=torch.long, device=lengths.device)
    return torch.stack([samples, lengths.sum(), targets.long().to(lengths.device), (lengths * lengths).sum()])
