"""One rank of tests/data/test_reference.py's two-rank precompute: ``python reference_worker.py RANK SPEC_JSON``.

Each rank has its own data cache (two nodes), a stand-in trainer whose strategy gathers over gloo, and a fake
reference (``fake_logps``). Three precomputes in a row: fresh (both compute their share), again (both find the
file: nothing computed), then with rank 1's file deleted (both compute again: a rank alone would hang a sharded
reference). Writes each pass's values and the rows this rank ran to ``out-RANK.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from gym_lightning.data.datamodule import CausalLMDataModule


def fake_logps(batch: dict) -> torch.Tensor:
    """A deterministic stand-in for a reference forward: per row, its target count plus its first id / 1000."""
    return batch["labels"].ne(-100).sum(1).float() + batch["input_ids"][:, 0].float() / 1000


def main(rank: int, spec: dict) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    strategy = SimpleNamespace(
        world_size=2,
        root_device=torch.device("cpu"),
        all_gather=gather,
        distributed_sampler_kwargs={"num_replicas": 2, "rank": rank},
    )
    cache = Path(spec["cache"]) / f"node-{rank}"
    dm = CausalLMDataModule(train_files=spec["data"], val_split=0.25, batch_size=2, cache_dir=str(cache))
    dm.trainer = SimpleNamespace(strategy=strategy, accumulate_grad_batches=1)
    ran: list[int] = []

    def logps(batch: dict) -> torch.Tensor:
        ran.append(len(batch["input_ids"]) // 2)
        return fake_logps(batch)

    passes = []
    for step in range(3):
        if step == 2 and rank == 1:
            for file in cache.glob("*/reference-*.npy"):
                file.unlink()
        ran.clear()
        dm._references.clear()
        dm.precompute_reference_logps(logps, reference_id="model-a", batch_size=2)
        passes.append({"rows": sum(ran), "values": {k: v.tolist() for k, v in dm._references.items()}})
    Path(spec["out"], f"out-{rank}.json").write_text(json.dumps(passes))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GYM_DATA_CACHE", json.loads(sys.argv[2])["cache"])
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
