"""2-rank worker: one rank's gradient turns non-finite (its loss stays finite); every rank must skip that step, or
none may. ``python nonfinite_grad_worker.py OUT [CASE...]`` (on 2 ranks: ``helpers.dist.run_ranks``) runs each of
:data:`CASES` (or those named) in turn in the same pair of processes and writes ``OUT/<case>.rank<r>.json``.

The poison is one element of a gradient, on the ranks :data:`POISON` names in an optimizer step: in the rank's own
gradient shard after backward (gym_fsdp: after the reduce-scatter, before the loss scaler unscales), or in the rank's
local gradient before DeepSpeed reduces it (a hook on the parameter's gradient), so that after the reduction only
one rank's partition holds it. Step 2 poisons rank 1 only; step 3 poisons both ranks (their flags sum to 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.callbacks import NonFiniteGuard, NonFiniteLossError
from helpers.full_state import full_model_state_dict

POISON: dict[int, tuple[int, ...]] = {2: (1,), 3: (0, 1)}  # global_step -> ranks
INIT_SCALE = 16.0
# name: (strategy, precision, guard action or None)
CASES: dict[str, tuple[str, str, str | None]] = {
    "fsdp-16-mixed": ("gym_fsdp", "16-mixed", None),
    "fsdp-bf16-skip": ("gym_fsdp", "bf16-mixed", "skip"),
    "zero2_offload-bf16": ("zero2_offload", "bf16-mixed", "stop"),
    "zero3_offload-bf16": ("zero3_offload", "bf16-mixed", "stop"),
}


class PoisonGradient(pl.Callback):
    """One gradient element becomes ``value`` on the :data:`POISON` ranks of each step (see the module docstring)."""

    def __init__(self, value: float) -> None:
        self.value = value
        self._hook: Any = None

    def _poisoned_here(self, trainer: pl.Trainer) -> bool:
        return trainer.global_rank in POISON.get(trainer.global_step, ())

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(trainer.strategy, DeepSpeedStrategy) and self._poisoned_here(trainer):
            param = next(p for p in module.parameters() if p.requires_grad)
            self._hook = param.register_hook(self._poison)

    def on_after_backward(self, trainer: pl.Trainer, module: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        elif not isinstance(trainer.strategy, DeepSpeedStrategy) and self._poisoned_here(trainer):
            shard = trainer.strategy.local_gradients(module)[0]
            shard.view(-1)[0] = self.value

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = self.value
        return grad


def run_case(out: Path, name: str, train: Path) -> None:
    strategy, precision, action = CASES[name]
    pl.seed_everything(3)
    module = CausalLMModule(
        "tiny-llama", config_overrides={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
        lr=1e-2, scheduler="constant",
    )  # fmt: skip
    guard = NonFiniteGuard(action=action) if action else None
    # 16-mixed on CPU ranks: Lightning would turn the flag into bf16-mixed; the plugin keeps fp16 and its scaler,
    # whose small first scale never overflows by itself here: only the poison backs it off.
    fp16 = precision == "16-mixed"
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    amp = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler)]} if fp16 else {"precision": precision}
    callbacks = [PoisonGradient(float("inf") if fp16 else float("nan")), *([guard] if guard else [])]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=5, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=callbacks, **amp,
    )  # fmt: skip
    error = None
    try:
        trainer.fit(module, CausalLMDataModule(train_files=str(train), batch_size=4, max_seq_length=16))
    except NonFiniteLossError as err:
        error = str(err)
    state = full_model_state_dict(trainer.strategy, module.model)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    result = {
        "error": error,
        "global_step": trainer.global_step,
        "guard_skipped": guard.skipped_steps if guard else None,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scale": scaler.get_scale() if scaler is not None else None,
        "engine_skipped": int(engine.skipped_steps) if engine is not None else None,
        "finite": all(bool(torch.isfinite(v).all()) for v in state.values()),
        "checksum": float(sum(v.double().sum() for v in state.values())) if state else None,
    }
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(out: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i) * (1 + i % 3)} for i in range(48)]
    train = out / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps(record) + "\n" for record in records))
    for name in names or CASES:
        run_case(out, name, train)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
