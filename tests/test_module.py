"""CausalLMModule: token-normalised loss under accumulation, optimiser groups, schedules, validation, predict."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from gym_lightning import CausalLMDataModule, CausalLMModule, GenerationArgs
from gym_lightning.optim import lr_multiplier, resolve_warmup_steps, weight_decay_groups

SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64}


class GradientCapture(pl.Callback):
    """Keeps a copy of every parameter's gradient just before the first optimizer step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


class PlainBatches(CausalLMDataModule):
    """The same data served by a plain DataLoader, i.e. without the step token count (Lightning's usual mean)."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(
            loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn, shuffle=False
        )


def first_step_gradients(data_file: Path, micro_batch: int, accumulation: int, plain: bool = False) -> dict:
    pl.seed_everything(7)
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, attn_implementation="eager", lr=1e-3)
    data_cls = PlainBatches if plain else CausalLMDataModule
    data = data_cls(train_files=str(data_file), batch_size=micro_batch, seed=3)
    capture = GradientCapture()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=accumulation, callbacks=[capture],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return capture.grads


def test_accumulation_gives_the_same_gradients_as_one_big_batch(variable_length_jsonl: Path) -> None:
    big = first_step_gradients(variable_length_jsonl, micro_batch=8, accumulation=1)
    accumulated = first_step_gradients(variable_length_jsonl, micro_batch=2, accumulation=4)
    assert big.keys() == accumulated.keys() and big
    for name, grad in big.items():
        # fp32: the two runs differ only in summation order (micro-batches vs one batch), ~1e-7 relative.
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_plain_mean_per_micro_batch_would_differ(variable_length_jsonl: Path) -> None:
    """The check above can fail: Lightning's usual normalisation (mean per micro-batch) gives other gradients."""
    big = first_step_gradients(variable_length_jsonl, micro_batch=8, accumulation=1, plain=True)
    accumulated = first_step_gradients(variable_length_jsonl, micro_batch=2, accumulation=4, plain=True)
    largest_gap = max((accumulated[n] - g).abs().max().item() / g.abs().max().item() for n, g in big.items())
    assert largest_gap > 1e-2


def test_weight_decay_skips_biases_and_norm_weights() -> None:
    module = CausalLMModule("tiny-qwen3", config_overrides=SMALL)
    module.configure_model()
    decayed, plain = weight_decay_groups(module.model.named_parameters(), 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    norm_weights = [p for n, p in module.model.named_parameters() if "norm" in n]
    assert norm_weights and all(any(p is q for q in plain["params"]) for p in norm_weights)


def test_weight_decay_reads_the_full_shape_of_a_zero3_partition() -> None:
    # Under ZeRO-3 configure_optimizers sees each parameter as an empty 1-D partition with its shape in ds_shape;
    # reading ndim there put every matrix in the no-decay group (weight decay silently off under zero3).
    matrix, norm = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    matrix.ds_shape, norm.ds_shape = torch.Size([64, 32]), torch.Size([32])
    decayed, plain = weight_decay_groups([("w", matrix), ("n", norm)], 0.1)
    assert decayed["params"] == [matrix] and plain["params"] == [norm]


@pytest.mark.parametrize(
    ("name", "step", "expected"),
    [
        ("constant", 10, 1.0),
        ("linear", 4, 1.0),  # first step after 4 warm-up steps
        ("linear", 54, 0.5),  # half-way through 100 decay steps
        ("cosine", 54, 0.5),
        ("cosine", 104, 0.0),
        ("cosine", 0, 0.2),  # warm-up: (0 + 1) / (4 + 1)
    ],
)
def test_lr_schedule_values(name: str, step: int, expected: float) -> None:
    value = lr_multiplier(step, name=name, warmup_steps=4, total_steps=104, min_lr_ratio=0.0)
    assert value == pytest.approx(expected, abs=1e-9)


def test_min_lr_ratio_and_warmup_ratio() -> None:
    assert lr_multiplier(100, name="cosine", warmup_steps=0, total_steps=100, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert resolve_warmup_steps(0, 0.1, 95) == 10
    assert resolve_warmup_steps(3, 0.5, 95) == 3


def test_scheduler_total_steps_come_from_the_trainer(tmp_path: Path) -> None:
    module = CausalLMModule("tiny-llama", config_overrides=SMALL, scheduler="linear", warmup_steps=0)
    data = CausalLMDataModule(dataset="addition", batch_size=500)
    trainer = pl.Trainer(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, data)
    # Three steps of a linear decay over max_steps=3: the factor after the last step is 0.
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.0)


def test_invalid_settings_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        CausalLMModule(lr=-1, warmup_ratio=1.5, generation=GenerationArgs(max_new_tokens=0))
    message = str(info.value)
    assert "lr must be > 0" in message and "warmup_ratio" in message and "max_new_tokens" in message


def test_validation_metrics_and_predict(tmp_path: Path) -> None:
    module = CausalLMModule(
        "tiny-llama", config_overrides=SMALL, val_exact_match=True, generation=GenerationArgs(max_new_tokens=3)
    )
    data = CausalLMDataModule(dataset="addition", batch_size=64, eval_batch_size=128)
    trainer = pl.Trainer(
        max_steps=2, val_check_interval=2, limit_val_batches=2, limit_predict_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    assert {"train/loss", "val/loss", "val/ppl", "val/exact_match"} <= set(metrics)
    assert metrics["val/ppl"] == pytest.approx(torch.exp(metrics["val/loss"]).item(), rel=1e-5)
    assert 0.0 <= metrics["val/exact_match"].item() <= 1.0
    predictions = trainer.predict(module, data)
    assert len(predictions[0]) == 128 and {"prompt", "completion"} <= set(predictions[0][0])
    assert predictions[0][0]["prompt"].endswith("=")


def test_lora_settings_given_as_plain_data_mean_the_same_as_lora_args() -> None:
    # What a gym fit checkpoint stores (LightningCLI's instantiator keeps the parsed config: a dict) and what a
    # YAML-minded Python caller passes: both are read through LoRAArgs.from_value.
    from gym_lightning import LoRAArgs
    from gym_lightning.errors import GymUserError

    settings = {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}
    assert LoRAArgs.from_value(settings) == LoRAArgs(r=4, alpha=8, target_modules=["q_proj"])
    assert LoRAArgs.from_value(None) is None
    assert CausalLMModule(lora=settings).lora == LoRAArgs(r=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(GymUserError, match=r"unknown settings \['rank'\]"):
        LoRAArgs.from_value({"rank": 4})
    with pytest.raises(GymUserError, match=r"lora\.r must be >= 1"):
        CausalLMModule(lora={"r": 0})
