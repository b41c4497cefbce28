"""Faults a test injects into a real run, as callbacks a YAML can list (``class_path: helpers.faults.StopRank``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class StopRank(Callback):
    """SIGSTOP one rank at the start of a micro-batch of a given optimizer step: the process stays, answers nothing
    (as a hung GPU or a frozen node), and only SIGKILL ends it. Writes ``marker`` (pid, time) first.

    Args:
        rank: The global rank to stop.
        step: The optimizer step (``trainer.global_step``) during which it stops.
        marker: File to write ``{"pid": ..., "time": ...}`` to just before stopping.
    """

    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.marker).write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), signal.SIGSTOP)


class AbortLikeNccl(Callback):
    """On one rank, behave as NCCL does when a collective times out: nothing is raised in Python (the default
    process group's timeout goes far above the strategy's), and the process dies by SIGABRT ``timeout`` seconds
    after the stopped rank's ``marker`` time (NCCL's watchdog aborts it at the collective timeout).

    Args:
        rank: The global rank that aborts.
        marker: The file ``StopRank`` writes just before stopping.
        timeout: Seconds from the stop to the abort (the strategy's collective timeout).
    """

    def __init__(self, rank: int, marker: str, timeout: float) -> None:
        self.rank, self.marker, self.timeout = rank, Path(marker), timeout

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != self.rank:
            return
        from datetime import timedelta

        from gym_lightning._compat import set_collective_timeout

        set_collective_timeout(timedelta(hours=1))  # gloo would raise at the timeout; NCCL does not
        threading.Thread(target=self._abort_after_the_stop, daemon=True).start()

    def _abort_after_the_stop(self) -> None:
        while (stopped := _stop_time(self.marker)) is None:
            time.sleep(0.05)
        time.sleep(max(0.0, stopped + self.timeout - time.time()))
        os.kill(os.getpid(), signal.SIGABRT)


def _stop_time(marker: Path) -> float | None:
    try:  # StopRank may be writing it right now
        return float(json.loads(marker.read_text())["time"])
    except (OSError, ValueError, KeyError):
        return None


class KillRank(Callback):
    """SIGKILL one rank at the start of one micro-batch (``batch_idx``) of a given optimizer step: no Python
    cleanup, no exception handler, no checkpoint of the step in flight (as a node that loses power).

    Args:
        rank: The global rank to kill.
        step: The optimizer step (``trainer.global_step``) during which it dies.
        batch: The micro-batch index in the epoch (``batch_idx``) at whose start it dies.
    """

    def __init__(self, rank: int, step: int, batch: int) -> None:
        self.rank, self.step, self.batch = rank, step, batch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)
