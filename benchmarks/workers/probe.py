"""Targeted timers for benchmarks/overhead.py: what gym_lightning's ``Trainer.fit`` adds to an optimizer step.

``StepProbe.install(trainer, module, guard)`` wraps, on those *instances* only (nothing global is patched but
``nonfinite_flag``, restored by ``uninstall``), every call the wrapper makes per step that a plain loop does not
(or does differently), and records rank 0's seconds per component per timed step. Lightning's private members
(the SIGTERM broadcast, the logger connector) come from ``gym_lightning._compat.per_batch_lightning_calls``, whose
declared table tests/test_compat.py checks against the installed Lightning; they are timed, never changed.

A wrapped call costs two ``perf_counter`` reads (~0.1 us): well below the ~0.01 ms resolution of the table.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

import gym_lightning.callbacks.nonfinite as nonfinite_module
from gym_lightning._compat import per_batch_lightning_calls

# Component -> what it is, in the order of the overhead table (benchmarks/overhead.py renders these labels).
COMPONENTS: dict[str, str] = {
    "sigterm": "Lightning's SIGTERM flag broadcast (a blocking 1-element broadcast + host read per batch)",
    "tokens_launch": "step-token all-reduce: count, copy and launch (async)",
    "tokens_wait": "step-token all-reduce: wait after the forward (the peer loop waits too)",
    "log": "`self.log('train/loss', tensor)` (Lightning's result collection, no host sync)",
    "logger": "Lightning's logger connector per batch (start, end, step metrics)",
    "lr_schedulers": "Lightning's per-batch scheduler update (`LambdaLR.step`)",
    "guard_loss": "non-finite guard: loss flag (`isfinite` on the loss, per micro-batch)",
    "guard_norm": "non-finite guard: gradient norm of the local gradients (one foreach norm)",
    "guard_reduce": "non-finite guard: flag all-reduce + host read (one 2·world-element all-reduce)",
}


class _TimedWork:
    """A pending collective whose ``wait`` is timed as ``tokens_wait``."""

    def __init__(self, work: Any, probe: StepProbe) -> None:
        self.work, self.probe = work, probe

    def wait(self) -> Any:
        start = time.perf_counter()
        try:
            return self.work.wait()
        finally:
            self.probe.add("tokens_wait", time.perf_counter() - start)


class StepProbe(pl.Callback):
    """Per-step seconds of each ``COMPONENTS`` entry (timed steps only: after ``warmup`` optimizer steps).

    Args:
        warmup: Optimizer steps not recorded (as ``StepClock``'s start).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._restore: list[Callable[[], None]] = []

    def add(self, name: str, seconds: float) -> None:
        self.current[name] += seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def per_step(self) -> dict[str, list[float]]:
        """Component -> its seconds in each timed step (0 where it did not run); guard_reduce net of guard_norm."""
        table = {name: [step.get(name, 0.0) for step in self.steps] for name in COMPONENTS}
        table["guard_reduce"] = [
            max(0.0, total - norm) for total, norm in zip(table["guard_reduce"], table["guard_norm"], strict=True)
        ]
        return table

    # ------------------------------------------------------------------------------------------ installing
    def _wrap(self, owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)

        object.__setattr__(owner, attribute, timed)

    def install(self, trainer: pl.Trainer, module: pl.LightningModule, guard: pl.Callback | None) -> None:
        for owner, method, name in per_batch_lightning_calls(trainer):
            self._wrap(owner, method, name)
        self._wrap(module, "log", "log")
        self._wrap_token_count(module)
        if guard is not None:
            self._wrap(guard, "on_before_backward", "guard_loss")
            self._wrap(guard, "on_before_optimizer_step", "guard_reduce")  # net of guard_norm in per_step()
            original = nonfinite_module.nonfinite_flag
            self._wrap(nonfinite_module, "nonfinite_flag", "guard_norm")
            self._restore.append(lambda: setattr(nonfinite_module, "nonfinite_flag", original))

    def _wrap_token_count(self, module: pl.LightningModule) -> None:
        original = module.objective._start_step_token_count

        def timed(owner: pl.LightningModule, batch: dict[str, Any]) -> Any:
            start = time.perf_counter()
            tokens, undo, pending = original(owner, batch)
            self.add("tokens_launch", time.perf_counter() - start)
            return tokens, undo, (None if pending is None else _TimedWork(pending, self))

        object.__setattr__(module.objective, "_start_step_token_count", timed)

    def uninstall(self) -> None:
        for restore in self._restore:
            restore()
        self._restore.clear()
