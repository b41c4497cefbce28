"""Faults a test injects into a real run, as callbacks a YAML can list (``class_path: helpers.faults.StopRank``)."""

from __future__ import annotations

import json
import os
import signal
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
