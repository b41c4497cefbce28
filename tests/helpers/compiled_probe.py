"""A callback that records how many graphs dynamo compiled in this rank by the end of each optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch._dynamo.utils import counters


class GraphCountProbe(pl.Callback):
    """Writes ``{rank: [graphs after step 1, after step 2, ...]}`` to ``path`` (one file per rank: ``path.<rank>``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.graphs: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.graphs.append(counters["stats"]["unique_graphs"])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.graphs, f"{self.path}.{trainer.global_rank}")
