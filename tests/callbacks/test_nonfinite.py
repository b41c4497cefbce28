"""NonFiniteGuard on a plain LightningModule (no CausalLMModule): stop, skip, gradient checks, checkpointed count.

The 2-rank runs (one rank's loss NaN, every rank decides the same) are in callbacks/test_nonfinite_multirank.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from gym_lightning.callbacks import NonFiniteGuard, NonFiniteLossError
from gym_lightning.errors import GymUserError
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy


class Regression(pl.LightningModule):
    """A linear fit whose loss is poisoned (``"loss"``: NaN; ``"grad"``: finite loss, NaN gradients) at the
    micro-batch indices in ``poison``."""

    def __init__(self, poison: dict[int, str] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.poison = poison or {}
        self.seen = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        kind, self.seen = self.poison.get(self.seen), self.seen + 1
        if kind == "loss":
            return loss * float("nan")
        if kind == "grad":  # sqrt'(0) is inf, times the zero inner gradient: NaN gradients, loss stays 0 + loss
            return loss + torch.sqrt((self.layer.weight * 0).sum())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WeightsPerStep(pl.Callback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.weights.append(module.layer.weight.detach().clone())


def fit(module: pl.LightningModule, callbacks: list[pl.Callback], root: Path, **kwargs: Any) -> pl.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    kwargs = {"max_steps": 4, "accelerator": "cpu", "devices": 1, **kwargs}
    trainer = pl.Trainer(
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=root, callbacks=callbacks, **kwargs,
    )  # fmt: skip
    trainer.fit(module, DataLoader(torch.randn(64, 4), batch_size=8), ckpt_path=ckpt_path)
    return trainer


def test_stop_raises_naming_the_step_before_the_update(tmp_path: Path) -> None:
    module = Regression(poison={2: "loss"})
    weights = WeightsPerStep()
    expected = r"loss \(NaN or inf\) on rank\(s\) \[0\] in optimizer step 3 \(epoch 0; 2 steps completed\)"
    with pytest.raises(NonFiniteLossError, match=expected):
        fit(module, [NonFiniteGuard(), weights], tmp_path)
    assert torch.equal(module.layer.weight, weights.weights[-1]) and torch.isfinite(module.layer.weight).all()


def test_stop_catches_nonfinite_gradients_of_a_finite_loss(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLossError, match=r"gradient \(NaN or inf\) .* optimizer step 2"):
        fit(Regression(poison={1: "grad"}), [NonFiniteGuard()], tmp_path)


def test_skip_drops_the_window_with_one_bad_micro_batch_and_counts_it(tmp_path: Path) -> None:
    # Micro-batch 3 is the second of optimizer step 2's window: the flag must survive across micro-batches.
    module, guard, weights = Regression(poison={3: "loss"}), NonFiniteGuard(action="skip"), WeightsPerStep()
    trainer = fit(module, [guard, weights], tmp_path, accumulate_grad_batches=2)
    assert trainer.global_step == 4 and guard.skipped_steps == 1
    after = weights.weights[1::2]  # the weights after each optimizer step
    assert torch.equal(after[1], after[0]) and not torch.equal(after[2], after[1])
    assert torch.isfinite(module.layer.weight).all()
    assert trainer.callback_metrics["train/skipped_nonfinite_steps"] == 1


def test_skipped_count_round_trips_a_checkpoint(tmp_path: Path) -> None:
    guard = NonFiniteGuard(action="skip")
    trainer = fit(Regression(poison={1: "loss", 2: "grad"}), [guard], tmp_path)
    assert guard.skipped_steps == 2
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["callbacks"]["NonFiniteGuard"] == {"skipped_steps": 2}
    resumed = NonFiniteGuard(action="skip")
    fit(Regression(poison={0: "loss"}), [resumed], tmp_path, max_steps=6, ckpt_path=tmp_path / "a.ckpt")
    assert resumed.skipped_steps == 3


class EngineOwnsGradients(SingleDeviceStrategy):
    def local_gradients(self, module: torch.nn.Module) -> None:
        return None


def test_skip_is_refused_at_fit_start_where_the_strategy_owns_the_gradients(tmp_path: Path) -> None:
    module = Regression()
    with pytest.raises(GymUserError, match="cannot drop an optimizer step under EngineOwnsGradients"):
        fit(module, [NonFiniteGuard(action="skip")], tmp_path, strategy=EngineOwnsGradients(torch.device("cpu")))
    assert module.seen == 0
    # "stop" still checks the loss there, the only signal left: the first micro-batch's flag must reach the step.
    strategy = EngineOwnsGradients(torch.device("cpu"))
    with pytest.raises(NonFiniteLossError, match=r"loss \(NaN or inf\) .* optimizer step 1 "):
        fit(Regression(poison={0: "loss"}), [NonFiniteGuard()], tmp_path, strategy=strategy, accumulate_grad_batches=2)


def test_gym_strategies_say_which_gradients_the_guard_can_see() -> None:
    module = torch.nn.Linear(2, 1)
    module.weight.grad = torch.ones(1, 2)
    for strategy in (GymDDPStrategy(), GymFSDPStrategy()):  # (FSDP's DTensor shards: the 2-rank test)
        assert [id(g) for g in strategy.local_gradients(module)] == [id(module.weight.grad)]
    assert ZeROStrategy(stage=2).local_gradients(module) is None  # the engine's: nothing to inspect or drop


def test_action_must_be_stop_or_skip() -> None:
    with pytest.raises(GymUserError, match="'stop' or 'skip', got 'ignore'"):
        NonFiniteGuard(action="ignore")  # type: ignore[arg-type]


def test_flags_go_through_the_strategy_without_a_default_process_group() -> None:
    from gym_lightning.callbacks.nonfinite import sum_over_ranks

    class Strategy:
        def __init__(self) -> None:
            self.ops: list[str] = []

        def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
            self.ops.append(reduce_op)
            return tensor * 2  # stands in for the sum over 2 ranks

    strategy = Strategy()
    # No process group in this process: the strategy's own reduce (any Lightning strategy) sums the flags.
    assert sum_over_ranks(torch.tensor([0.0, 1.0]), strategy, 2).tolist() == [0.0, 2.0]  # type: ignore[arg-type]
    assert strategy.ops == ["sum"]
