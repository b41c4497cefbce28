"""gym_ddp on 2 CPU ranks with gradient accumulation: where every micro-batch's gradients live.

``python tests/helpers/ddp_bucket_worker.py OUT`` (on 2 ranks: ``helpers.dist.run_ranks``). Two fits
in the same two processes: ``fixed`` (gym_ddp as it is) and ``control`` (gym_ddp with ``zero_gradients_in_place``
switched off: bucket views, but Lightning's ``zero_grad(set_to_none=True)``), each 2 optimizer steps of 2
micro-batches. Rank 0 writes ``OUT/<phase>.json``: per micro-batch, the distinct storages of the gradients (bytes)
after its backward, DDP's bucket sizes, the losses and whether DDP runs a static graph.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn.parallel import DistributedDataParallel

import gym_lightning.strategies.ddp as ddp
from gym_lightning._compat import ddp_bucket_sizes
from gym_lightning.strategies import GymDDPStrategy


class _Mlp(pl.LightningModule):
    """Three linear layers (6 parameter tensors, 1 bucket: under DDP's 1 MiB first bucket), AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 1)
        self.micro_batches: list[dict[str, Any]] = []
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.head(self.net(batch[0])).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in self.parameters()}
        model = self.trainer.strategy.model
        assert isinstance(model, DistributedDataParallel)
        buckets = ddp_bucket_sizes(model)
        self.micro_batches.append(
            {"storages": sorted(storages.values()), "buckets": buckets, "static": model.static_graph}
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(out: Path, phase: str) -> None:
    module = _Mlp()
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=GymDDPStrategy(), accumulate_grad_batches=2, max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    if trainer.global_rank == 0:
        trainable = sum(p.numel() * p.element_size() for p in module.parameters())
        result = {"micro_batches": module.micro_batches, "losses": module.losses, "trainable_bytes": trainable}
        (out / f"{phase}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    _fit(out_dir, "fixed")
    ddp.zero_gradients_in_place = lambda optimizer: None  # the control: Lightning's set_to_none zeroing
    _fit(out_dir, "control")
