"""ZeRO-3 worker with a mixture of experts whose routing differs between ranks: ``python moe_worker.py SPEC.json``.

The MoE block keeps one module per expert (an ``nn.ModuleList``, as transformers 4 and DeepSeek's remote code do) and
runs only the experts that received tokens. Tokens go to expert 0 when their feature 0 is negative, else to expert 1,
and rank r's data has feature 0 of sign (-1, +1)[r]: rank 0 only ever runs expert 0, rank 1 only expert 1.

Spec keys: ``out`` (folder for ``result.pt``), ``steps``, ``timeout_s`` (collective timeout) and ``phases``, each a
``Trainer.fit`` in the same two processes: ``name`` and ``leaf`` (false: gym_lightning's MoE leaf marking switched off,
the control run). Both ranks run this script (``helpers.dist.run_ranks``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from helpers.full_state import full_model_state_dict

WIDTH, BATCH, SEED, LR = 8, 4, 11, 0.5


class PerExpertMoE(nn.Module):
    """Two experts as separate modules; only the experts that received tokens run (transformers 4's loop)."""

    def __init__(self, width: int, num_experts: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = (x[:, 0] >= 0).long()  # data-dependent: the sign of feature 0 picks the expert
        out = torch.zeros_like(x)
        for expert in route.unique().tolist():
            rows = (route == expert).nonzero().squeeze(-1)
            out = out.index_add(0, rows, self.experts[expert](x[rows]))
        return out


class RoutedRegression(pl.LightningModule):
    """A positive learned scale, the MoE block, a linear head; MSE loss, plain SGD (the weights show any error in the
    gradients).

    The scale keeps every feature's sign (so the routing stays the data's) and makes the block's input require grad,
    as a transformer's hidden states do: DeepSpeed reduces a leaf block's gradients in a full backward hook, which
    torch fires before the block's own backward when no input requires grad (the experts' weights are then already
    released: "The size of tensor a (0) must match the size of tensor b (8)").
    """

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(WIDTH))
        self.moe = PerExpertMoE(WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.moe(x * self.log_scale.exp()))).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def rank_data(rank: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``steps`` batches, in order: feature 0 negative on rank 0, positive on rank 1."""
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(steps * BATCH, WIDTH, generator=generator)
    x[:, 0] = x[:, 0].abs().clamp_min(0.1) * (1 if rank else -1)
    return x, torch.randn(steps * BATCH, generator=generator)


class RankData(pl.LightningDataModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*rank_data(self.trainer.global_rank, self.steps)), batch_size=BATCH)


def reference_state(steps: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the union of both ranks' batches (mean loss over both)."""
    torch.manual_seed(SEED)
    module = RoutedRegression()
    optimizer = module.configure_optimizers()
    (x0, y0), (x1, y1) = rank_data(0, steps), rank_data(1, steps)
    for step in range(steps):
        part = slice(step * BATCH, (step + 1) * BATCH)
        x, y = torch.cat([x0[part], x1[part]]), torch.cat([y0[part], y1[part]])
        optimizer.zero_grad()
        F.mse_loss(module(x), y).backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def strategy(spec: dict[str, Any]) -> Any:
    from gym_lightning.strategies import ZeRO3Strategy

    # Threshold 0: every parameter is partitioned (DeepSpeed keeps parameters under 1e5 elements whole by default).
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return ZeRO3Strategy(config=config, timeout=timedelta(seconds=spec.get("timeout_s", 60)))


@contextmanager
def leaf_marking(enabled: bool) -> Generator[None, None, None]:
    """gym_lightning's MoE leaf marking switched off when not ``enabled`` (the control run, as before it existed)."""
    import gym_lightning.strategies.zero.strategy as zero

    original = zero.mark_moe_leaf_modules
    if not enabled:
        zero.mark_moe_leaf_modules = lambda model: []
    try:
        yield
    finally:
        zero.mark_moe_leaf_modules = original


def run_phase(spec: dict[str, Any], phase: dict[str, Any]) -> dict[str, Any]:
    """One ``Trainer.fit`` of ``spec["steps"]`` steps; the full trained weights (on rank 0) and the step count."""
    pl.seed_everything(SEED)
    module = RoutedRegression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy(spec),
        max_steps=spec["steps"],
        use_distributed_sampler=False,  # each rank keeps its own data (RankData)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with leaf_marking(phase.get("leaf", True)):
        trainer.fit(module, datamodule=RankData(spec["steps"]))
    return {"state": full_model_state_dict(trainer.strategy, module), "global_step": trainer.global_step}


def main(spec_path: str) -> None:
    """Run the spec's phases one after the other in these processes; rank 0 writes ``result.pt``."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    results = {phase["name"]: run_phase(spec, phase) for phase in spec["phases"]}
    if torch.distributed.get_rank() == 0:
        torch.save(results, Path(spec["out"]) / "result.pt")


if __name__ == "__main__":
    main(sys.argv[1])
