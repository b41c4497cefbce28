"""NonFiniteGuard with a fused optimizer: the flags reach the optimizer as ``found_inf`` (no host sync per step) and
are read a step later; a bad step must still never be applied, and "stop" must still stop before a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_nonfinite import Regression, WeightsPerStep, fit

from gym_lightning.callbacks import NonFiniteGuard, NonFiniteLossError


class FusedRegression(Regression):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)


def test_skip_leaves_weights_and_adam_state_untouched_without_reading_flags_at_once(tmp_path: Path) -> None:
    guard, weights = NonFiniteGuard(action="skip"), WeightsPerStep()
    module = FusedRegression(poison={1: "grad"})
    trainer = fit(module, [guard, weights], tmp_path)
    assert trainer.global_step == 4 and guard.skipped_steps == 1  # counted a step late, settled by on_train_end
    torch.testing.assert_close(weights.weights[1], weights.weights[0])  # step 2 dropped by the fused kernel
    assert not torch.equal(weights.weights[2], weights.weights[1])
    state = trainer.optimizers[0].state[module.layer.weight]
    assert int(state["step"]) == 3 and torch.isfinite(state["exp_avg_sq"]).all()  # the bad step left no trace
    assert "found_inf" not in vars(trainer.optimizers[0])  # handed back after each step


def test_stop_raises_before_the_next_update_with_the_bad_step_unapplied(tmp_path: Path) -> None:
    weights = WeightsPerStep()
    with pytest.raises(NonFiniteLossError, match=r"loss \(NaN or inf\) on rank\(s\) \[0\] in optimizer step 2 "):
        fit(FusedRegression(poison={1: "loss"}), [NonFiniteGuard(), weights], tmp_path)
    assert len(weights.weights) == 2  # raised in step 3's on_before_optimizer_step, before its update
    torch.testing.assert_close(weights.weights[1], weights.weights[0])


class SaveAfterStep(pl.Callback):
    """``trainer.save_checkpoint`` right after optimizer step ``step``, as a step checkpoint would."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_stop_settles_the_step_in_flight_before_a_checkpoint_is_written(tmp_path: Path) -> None:
    path = tmp_path / "after_step_2.ckpt"
    with pytest.raises(NonFiniteLossError, match="optimizer step 2 "):
        fit(FusedRegression(poison={1: "loss"}), [NonFiniteGuard(), SaveAfterStep(path, 2)], tmp_path)
    assert not path.exists()  # no checkpoint holds the bad step
