"""A 2-rank DDP run on a streamed data set that records, per rank, the token ids of every micro-batch it trains on.

``python stream_resume_worker.py TRAIN_JSONL OUT_DIR MAX_STEPS CKPT`` (``CKPT`` is ``none`` or a checkpoint to resume
from). Checkpoints every 2 optimizer steps into ``OUT_DIR/ckpt``; writes ``OUT_DIR/seen.RANK.json``. The model is a
single zero-learning-rate parameter: only the data path is under test (tests/data/test_stream_resume.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from gym_lightning.data.datamodule import CausalLMDataModule

torch.set_num_threads(1)


class Recorder(LightningModule):
    """Records ``(global_step, input_ids, step_target_tokens)`` of each micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"].tolist()
        self.seen.append({"step": self.global_step, "ids": ids, "step_tokens": int(batch["step_target_tokens"])})
        return self.weight.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main() -> None:
    train, out, max_steps, resume = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    data = CausalLMDataModule(train_files=train, streaming=True, batch_size=2, cache_dir=str(out / "cache"))
    model = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=max_steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(model, data, ckpt_path=None if resume == "none" else resume)
    (out / f"seen.{trainer.global_rank}.json").write_text(json.dumps(model.seen))
    if torch.distributed.is_initialized():
        # Lightning's own DDP leaves its gloo group up; left to the interpreter's finalisation it aborted a finished
        # run now and then ("terminate called without an active exception", exit -6; pytorch #190489).
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
