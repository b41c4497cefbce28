"""2-rank worker for gym_fsdp's vocabulary units (``strategies.fsdp.vocabulary_units``) on an untied tiny Llama.

``python fsdp_units_worker.py MODEL_DIR OUT`` (on 2 ranks: ``helpers.dist.run_ranks``) runs the cases of
:data:`CASES` in turn in the same pair of processes, each from the saved folder ``MODEL_DIR`` on the same data;
rank 0 writes ``OUT/<case>.json`` (per-step losses, all-gathers per step, the FSDP units, the weights' and the
optimizer state's checksums at the start and end of training):

- ``old_layout``: sharded as before the vocabulary units (the embedding and the head in the model's root unit), 2
  steps, then a checkpoint (``old_layout.ckpt``);
- ``fsdp``: today's layout, 4 steps, the loss chunked in 5-position chunks (the LM head called once per chunk);
- ``fsdp_unchunked``: today's layout, 2 steps, the loss not chunked (one LM-head call);
- ``resumed``: today's layout resumed from ``old_layout.ckpt``, 1 step.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.strategies import fsdp
from helpers.strategy_worker import records

CASES = ("old_layout", "fsdp", "fsdp_unchunked", "resumed")
STEPS = {"old_layout": 2, "fsdp": 4, "fsdp_unchunked": 2, "resumed": 3}
UNTIED = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "tie_word_embeddings": False}


class Collectives(TorchDispatchMode):
    """Counts the all-gathers (FSDP's unshards) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.all_gathers = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "allgather" in str(func):
            self.all_gathers += 1
        return func(*args, **(kwargs or {}))


def checksums(trainer: pl.Trainer, module: Any) -> list[float]:
    """The sums over ranks of the local parameter shards and of AdamW's local ``exp_avg_sq`` shards (a collective)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    states = [s["exp_avg_sq"] for s in trainer.optimizers[0].state.values() if "exp_avg_sq" in s]
    moments = [m.to_local() if hasattr(m, "to_local") else m for m in states]
    sums = torch.tensor(
        [sum(float(t.double().sum()) for t in group) for group in (local, moments)], dtype=torch.float64
    )
    torch.distributed.all_reduce(sums)
    return sums.tolist()


class StepRecord(pl.Callback):
    """Each step's loss (summed over ranks) and all-gathers (this rank's); the checksums at the start and end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.all_gathers: list[int] = []
        self.checksums: dict[str, list[float]] = {}
        self._mode: Collectives | None = None

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        self.checksums["start"] = checksums(trainer, module)

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.checksums["end"] = checksums(trainer, module)

    def on_train_batch_start(self, *args: Any) -> None:
        self._mode = Collectives()
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self.all_gathers.append(self._mode.all_gathers)
        loss = outputs["loss"].detach().reshape(1).clone()
        torch.distributed.all_reduce(loss)
        self.losses.append(loss.item())


def run_case(name: str, model_dir: str, out: Path, train: Path) -> None:
    pl.seed_everything(5)
    chunks = {"loss_chunking": "off"} if name == "fsdp_unchunked" else {"loss_chunking": "on", "loss_chunk_tokens": 5}
    module = CausalLMModule(model_dir, tokenizer=model_dir, lr=3e-2, scheduler="constant", **chunks)
    record = StepRecord()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="gym_fsdp", max_steps=STEPS[name], limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[record],
    )  # fmt: skip
    data = CausalLMDataModule(train_files=str(train), batch_size=4, max_seq_length=24, seed=0)
    ckpt = str(out / "old_layout.ckpt") if name == "resumed" else None
    with mock.patch.object(fsdp, "vocabulary_units", lambda module: []) if name == "old_layout" else nullcontext():
        trainer.fit(module, data, ckpt_path=ckpt)
    if name == "old_layout":
        trainer.save_checkpoint(out / "old_layout.ckpt")
    if trainer.is_global_zero:
        units = sorted(n for n, m in module.named_modules() if isinstance(m, FSDPModule))
        result = {"losses": record.losses, "all_gathers": record.all_gathers, "units": units, **record.checksums}
        (out / f"{name}.json").write_text(json.dumps(result))


def main(model_dir: str, out: Path) -> None:
    torch.set_num_threads(1)
    train = out / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps(record) + "\n" for record in records()))
    for name in CASES:
        run_case(name, model_dir, out, train)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
