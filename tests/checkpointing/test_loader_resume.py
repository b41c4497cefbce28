"""The mid-epoch data position comes back on resume in one place (``checkpointing.loader_state``), also when the run
checkpoints with Lightning's own ``ModelCheckpoint``: the command line adds the callback that restores it to every
run, ``StepCheckpoint`` is one, and a Python user adds ``ResumeLoaderPositions()`` (the module holds no callback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.checkpointing import StepCheckpoint
from gym_lightning.checkpointing.loader_state import ResumeLoaderPositions

SMALL = {
    "num_hidden_layers": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


class SeenBatches(pl.Callback):
    """The input ids of every micro-batch trained."""

    def __init__(self) -> None:
        self.seen: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        self.seen.append(batch["input_ids"].tolist())


def fit(root: Path, callbacks: list[pl.Callback], ckpt_path: str | None = None) -> None:
    pl.seed_everything(3)
    # The schedule reads trainer.estimated_stepping_batches, which sets up the data before the checkpoint is restored.
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, lr=1e-2, scheduler="linear")
    trainer = pl.Trainer(
        max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=callbacks, accelerator="cpu", devices=1,
    )  # fmt: skip
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i) * (1 + i % 3)} for i in range(24)]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(record) + "\n" for record in records))
    data = CausalLMDataModule(train_files=str(train), batch_size=4, max_seq_length=16)
    trainer.fit(module, data, ckpt_path=ckpt_path)


def test_a_run_checkpointed_by_lightning_resumes_at_the_saved_batch(tmp_path: Path) -> None:
    full, resumed = SeenBatches(), SeenBatches()
    checkpoints = ModelCheckpoint(tmp_path / "ck", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    fit(tmp_path, [full, checkpoints])
    fit(tmp_path, [resumed, ResumeLoaderPositions()], ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert len(full.seen) == 6 and resumed.seen == full.seen[2:]  # not the epoch's first batches again


def test_the_command_line_and_step_checkpoint_bring_the_one_restoring_callback() -> None:
    from gym_lightning.cli import cli_trainer_defaults

    for trainer in ({}, {"barebones": True}, {"callbacks": [StepCheckpoint()]}):
        added = cli_trainer_defaults(trainer)["callbacks"]
        assert sum(isinstance(c, ResumeLoaderPositions) for c in added) == 1, trainer
    assert CausalLMModule().configure_callbacks() == []  # the module brings none (a Lightning default)
    assert isinstance(StepCheckpoint(), ResumeLoaderPositions)
