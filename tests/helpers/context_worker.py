"""What user data code sees while a strategy sets up: ``python context_worker.py OUT.json``.

For each strategy x precision, one process fits a plain LightningModule that builds its layer in ``configure_model``
with a data module that states no batch size (so ZeRO reads the training DataLoader to size its config). The data
module's ``train_dataloader`` records the torch function-mode stack (Lightning's construction contexts push the root
device as a ``DeviceContext`` mode) and the default dtype (``bf16-true`` sets bf16 there), and draws from a CPU
generator (what failed under the CUDA default device on an H200). The module records where its metric states and
buffers are, and in which dtype, when training starts.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy
from gym_lightning.strategies.placement import unmanaged_state_devices

STRATEGIES = {
    "gym_ddp": lambda: GymDDPStrategy(),
    "gym_fsdp": lambda: GymFSDPStrategy(),
    "zero1": lambda: ZeROStrategy(stage=1),
    "zero2": lambda: ZeROStrategy(stage=2),
    "zero3": lambda: ZeROStrategy(stage=3),
}
PRECISIONS = ("32-true", "bf16-true")


class Plain(pl.LightningModule):
    """Builds its layer in ``configure_model``; holds a metric and a non-persistent buffer made in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: torch.nn.Module | None = None
        self.train_loss = MeanMetric()
        self.register_buffer("scale", torch.ones(8), persistent=False)
        self.placed: dict[str, tuple[str, str]] = {}

    def configure_model(self) -> None:
        if self.layer is None:
            self.layer = torch.nn.Sequential(torch.nn.Linear(8, 8))

    def on_train_start(self) -> None:
        self.placed = unmanaged_state_devices(self)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0].to(self.dtype) * self.scale.to(self.dtype)).float().pow(2).mean()
        self.train_loss.update(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def train_dataloader(self) -> DataLoader:
        drawn = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))  # a CPU generator
        self.seen.append(
            {
                "modes": [type(mode).__name__ for mode in _get_current_function_mode_stack()],
                "default_dtype": str(torch.get_default_dtype()),
                "tensor": str(torch.tensor([0.5]).dtype),
                "drawn": str(drawn.device),
            }
        )
        return DataLoader(TensorDataset(drawn), batch_size=4)


def main(out: str) -> None:
    results: dict[str, dict[str, Any]] = {}
    for name, make in STRATEGIES.items():
        for precision in PRECISIONS:
            data, module = Data(), Plain()
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, strategy=make(), precision=precision, max_steps=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module, datamodule=data)
            results[f"{name}/{precision}"] = {"loaders": data.seen, "placed": module.placed}
    with open(out, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
