"""Worker for tests/strategies/test_materialize.py: ``python loading_worker.py SPEC.json`` (Lightning starts the
other rank).

Each phase fits ``CausalLMModule`` for a few optimizer steps with one strategy and precision and writes, from global
rank 0, what the tests check: the full weights the model starts from (gathered through the strategy), the dtypes of
the trainable parameters, of the tensors the optimizer updates and of its state, whether the LM head is still tied to
the embeddings, and the losses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from strategy_worker import TINY_OVERRIDES, RecordLosses, TokenData, build_strategy
from strategy_worker import main as run_phases

from helpers.full_state import full_model_state_dict


class RecordStart(Callback):
    """The full initial weights (saved by rank 0) and the tying of embeddings and LM head, at the start of fit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tied: bool | None = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = full_model_state_dict(trainer.strategy, module.model)
        if trainer.is_global_zero:
            torch.save({key: value.detach().cpu() for key, value in state.items()}, self.path)
        base = module.model.get_base_model() if hasattr(module.model, "get_base_model") else module.model
        self.tied = base.get_output_embeddings().weight is base.get_input_embeddings().weight


def optimizer_dtypes(optimizer: Any) -> dict[str, list[str]]:
    """Dtypes of the tensors a (possibly DeepSpeed-wrapped) optimizer updates and of its state."""
    inner = optimizer
    while hasattr(inner, "optimizer") and hasattr(inner.optimizer, "param_groups"):
        inner = inner.optimizer  # DeepSpeed's ZeRO optimizers wrap the torch optimizer that runs on fp32 partitions
    # ZeRO-1/2 and ZeRO-3 keep their fp32 partitions here (ZeRO-3 hands them to the torch optimizer only in step()).
    params = getattr(optimizer, "single_partition_of_fp32_groups", None)
    params = params or getattr(optimizer, "fp32_partitioned_groups_flat", None)
    params = params or [p for group in inner.param_groups for p in group["params"]]
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    return {"updated": sorted({str(p.dtype) for p in params}), "state": sorted({str(t.dtype) for t in state})}


def run_phase(spec: dict[str, Any], phase: dict[str, Any], out: Path) -> dict[str, Any]:
    from gym_lightning.lora import LoRAArgs
    from gym_lightning.module import CausalLMModule

    pl.seed_everything(spec.get("seed", 7))
    source = spec["model_dir"] if phase.get("pretrained", True) else "tiny-llama"
    module = CausalLMModule(
        model=source,
        config_overrides=None if phase.get("pretrained", True) else TINY_OVERRIDES,
        lora=LoRAArgs(r=4) if phase.get("lora") else None,
        lr=3e-3,
        scheduler="constant",
    )
    recorder, start = RecordLosses(), RecordStart(out / f"{phase['name']}.pt")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=build_strategy(spec, phase),
        precision=phase.get("precision", "32-true"),
        max_steps=phase.get("steps", 2),
        callbacks=[recorder, start],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=TokenData(spec["dataset_size"], spec["batch_size"]))
    trainable = sorted({str(p.dtype) for p in module.parameters() if p.requires_grad})
    return {
        "losses": recorder.losses,
        "trainable": trainable,
        "optimizer": optimizer_dtypes(trainer.optimizers[0]),
        "tied": start.tied,
    }


if __name__ == "__main__":
    run_phases(sys.argv[1], run_phase)
