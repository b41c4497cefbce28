"""Write ``predict`` results (prompt and completion per line) to JSON Lines files."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from gym_lightning._compat import rank_zero_info


class JsonlPredictionWriter(BasePredictionWriter):
    """Writes the completions of ``predict`` to ``<output_dir>/predictions.jsonl`` (one file per rank, suffixed
    ``.rank<k>``, when several processes predict).

    Args:
        output_dir: Folder for the file(s); ``None`` uses the Trainer's ``default_root_dir``.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def path(self, trainer: pl.Trainer) -> Path:
        folder = Path(self.output_dir or trainer.default_root_dir)
        suffix = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        return folder / f"predictions{suffix}.jsonl"

    @override
    def write_on_epoch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(path.name + ".tmp")
        with staging.open("w") as handle:
            for batch in predictions:
                for row in batch:
                    handle.write(json.dumps(row) + "\n")
        os.replace(staging, path)  # never leave a half-written file under the final name
        rank_zero_info(f"Predictions written to {path}.")
