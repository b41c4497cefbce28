"""``StepLosses``: the callback ``scripts/fingerprint.py`` adds to every run it fingerprints. Each rank writes
``<out>/rank<r>.json``: which ``gym_lightning`` it imported (so a "before" run can be shown to have used the old
tree) and, per optimizer step, the exact training loss as ``float.hex``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class StepLosses(pl.Callback):
    """Per training batch: the loss ``training_step`` returned and the ``train/loss`` it logged, both as ``float.hex``
    (exact), with the global step after the batch; written by every rank at the end of fit.

    Args:
        out: Folder for ``rank<r>.json``.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        logged = trainer.callback_metrics.get("train/loss")
        self.steps.append({
            "global_step": trainer.global_step,
            "loss": float(loss.detach().float().cpu()).hex(),
            "loss_dtype": str(loss.dtype),
            "logged": None if logged is None else float(logged.detach().float().cpu()).hex(),
        })  # fmt: skip

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import gym_lightning

        self.out.mkdir(parents=True, exist_ok=True)
        record = {"gym_lightning": gym_lightning.__file__, "steps": self.steps}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
