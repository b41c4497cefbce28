"""2 gloo ranks run a preference objective on halves of a batch (``test_objectives_multirank.py``).

``python preference_rank_worker.py FOLDER REFERENCE OUT``: for each case, each rank takes its half of the pairs (or
KTO examples with their KL rows), runs the objective's training step at a logging step, back-propagates, and the
gradients are averaged over the ranks as DDP averages them; rank 0 saves the rank-mean loss, the averaged gradients
and the logged metrics.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from objective_harness import harness, tokenized_pairs, tokenized_unpaired

from gym_lightning.objectives import DPO, KTO, ORPO, SimPO


def cases(reference: str) -> dict[str, Any]:
    return {
        "dpo-sft": lambda: DPO(beta=0.5, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.4], ref_model=reference),
        "dpo-step-pairs": lambda: DPO(beta=0.5, loss_type="ipo", ref_model=reference),
        "kto": lambda: KTO(beta=0.5, undesirable_weight=1.5, ref_model=reference),
        "orpo": lambda: ORPO(beta=0.3),
        "simpo-cpo": lambda: SimPO(beta=2.0, cpo_alpha=0.5),
    }


def half(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share: its slice of the first rows and the same slice of the second rows."""
    rows = batch["input_ids"].size(0) // 2
    share = rows // world
    first, second = slice(rank * share, (rank + 1) * share), slice(rows + rank * share, rows + (rank + 1) * share)
    out = {k: torch.cat([v[first], v[second]]) for k, v in batch.items() if k != "kto_labels"}
    if "kto_labels" in batch:
        out["kto_labels"] = batch["kto_labels"][first]
    return out


def run_case(name: str, make: Any, folder: str, rank: int, world: int) -> dict[str, Any]:
    batch = tokenized_unpaired(folder) if name == "kto" else tokenized_pairs(folder)
    if world > 1:
        batch = half(batch, rank, world)
    if name == "dpo-step-pairs":
        batch["step_pairs"] = torch.tensor(batch["input_ids"].size(0) // 2)
    objective = make()
    torch.manual_seed(0)
    ours = harness(folder, objective)
    ours.trainer.world_size = world
    loss = objective.training_step(ours, batch)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ours.model.parameters() if p.grad is not None])
    if world > 1:
        loss = loss.detach().reshape(1).clone()
        dist.all_reduce(loss)
        dist.all_reduce(grads)
        loss, grads = loss[0] / world, grads / world  # DDP's gradient average
    metrics = {k: float(v) for k, v in ours.logged.items() if k != "train/loss"}
    return {"loss": float(loss), "grads": grads.detach(), "metrics": metrics}


def main(rank: int, world: int, folder: str, reference: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {name: run_case(name, make, folder, rank, world) for name, make in cases(reference).items()}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.spawn(main, args=(2, *sys.argv[1:4]), nprocs=2)
