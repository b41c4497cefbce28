"""2-rank worker: the loss turns NaN on one rank only; every rank must take the same decision.

``python nonfinite_worker.py OUT STRATEGY ACTION`` (on 2 ranks: ``helpers.dist.run_ranks``). Rank 1's loss
is NaN in optimizer step 3 (global_step 2). Each rank writes ``OUT/rank<r>.json``: the error it raised (or None),
the steps done, the skipped-step count and a checksum of its full weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.callbacks import NonFiniteGuard, NonFiniteLossError
from helpers.full_state import full_model_state_dict

BAD_RANK, BAD_STEP = 1, 2


def poisoned(summed: Any) -> Any:
    """A micro-batch's ``SummedLoss`` with its loss multiplied by NaN."""
    return summed._replace(loss=summed.loss * float("nan"))


class PoisonLossOnOneRank(pl.Callback):
    """Multiply one rank's summed loss by NaN in one optimizer step (the model itself stays finite)."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == BAD_RANK and trainer.global_step == BAD_STEP:
            engine = module.engine
            summed = type(engine).token_loss
            engine.token_loss = lambda model, b: poisoned(summed(engine, model, b))
        elif "token_loss" in vars(module.engine):
            del module.engine.token_loss


def main(out: Path, strategy: str, action: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(3)
    module = CausalLMModule(
        "tiny-llama", config_overrides={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
        lr=1e-2, scheduler="constant",
    )  # fmt: skip
    guard = NonFiniteGuard(action=action)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=5, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[guard, PoisonLossOnOneRank()],
    )  # fmt: skip
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i) * (1 + i % 3)} for i in range(48)]
    train = out / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps(record) + "\n" for record in records))
    error = None
    try:
        trainer.fit(module, CausalLMDataModule(train_files=str(train), batch_size=4, max_seq_length=16))
    except NonFiniteLossError as err:
        error = str(err)
    state = full_model_state_dict(trainer.strategy, module.model) if error is None else {}
    result = {
        "error": error,
        "global_step": trainer.global_step,
        "skipped": guard.skipped_steps,
        "finite": all(bool(torch.isfinite(p).all()) for p in module.model.parameters()),
        "checksum": float(sum(v.double().sum() for v in state.values())) if state else None,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
