"""Gradient clipping under mixed precision with the module's fused AdamW: on one process and on 2 CPU ranks under
every strategy, clipping by the global norm of the step's gradients.

Lightning's ``MixedPrecision`` refused any clipping with an optimizer that unscales inside its step (torch's fused
AdamW, the module's and HF's default), so ``bf16-mixed`` + ``gradient_clip_val`` (HF's default ``max_grad_norm=1``)
crashed on one process, under gym_ddp and under gym_fsdp. ``precision.GymMixedPrecision`` clips there.

How the clipped gradients are seen through ``gym fit``: with AdamW's ``eps`` far above every gradient entry, the
first step moves each weight by ``-lr * g / (|g| + eps)``, i.e. by ``-g`` within ``|g| / eps`` (below 1e-3
relative here) when ``lr == eps``. The exported weights after one step, minus those before it, are the clipped
gradient, for DDP's full gradients, FSDP2's shards and ZeRO's partitions alike; their norm must be
``gradient_clip_val`` (a rank that clipped by its own shard's norm would give up to sqrt(2) x that), and they must
equal one process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers.cli_runs import fit_in_one_launch, tensors_of
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision, Precision

from gym_lightning.precision import GymMixedPrecision, clipping_precision
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy

CLIP = 0.05
# The tiny Llama's unclipped first gradient has norm 5.8: clipped 11x. Large enough that ZeRO's bf16 weights (its
# engine trains a bf16 module beside fp32 masters, and the export reads the module) round the update by ~7 %.
RUN_CLIP = 0.5
# |update - one process's| / |one process's|: measured 0.002 (gym_ddp), 0.006 (gym_fsdp), 0.066 (zero2/zero3, the bf16
# rounding of the exported weights above). A rank clipping by its own shard's norm moves the norm itself by ~40 %.
SAME_UPDATE = {"gym_ddp": 0.02, "gym_fsdp": 0.02, "zero2": 0.1, "zero3": 0.1}
EPS = 100.0  # >> every gradient entry: AdamW's first step is then -lr * g / eps (see the module docstring)
STRATEGIES = {
    "gym_ddp": {"class_path": "gym_lightning.strategies.GymDDPStrategy"},
    "gym_fsdp": {"class_path": "gym_lightning.strategies.GymFSDPStrategy"},
    "zero2": "zero2",
    "zero3": "zero3",
}


# ----------------------------------------------------------------------------------------------- the plugin
def test_only_lightnings_own_mixed_precision_is_replaced() -> None:
    bf16 = clipping_precision(MixedPrecision("bf16-mixed", "cpu"))
    assert type(bf16) is GymMixedPrecision and bf16.precision == "bf16-mixed" and bf16.scaler is None
    scaler = torch.amp.GradScaler(device="cpu")
    fp16 = clipping_precision(MixedPrecision("16-mixed", "cpu", scaler))
    assert type(fp16) is GymMixedPrecision and fp16.scaler is scaler  # same scaler, same state
    for other in (Precision(), DeepSpeedPrecision("bf16-mixed"), GymMixedPrecision("bf16-mixed", "cpu")):
        assert clipping_precision(other) is other


@pytest.mark.parametrize("strategy", [GymDDPStrategy, GymFSDPStrategy])
def test_gym_strategies_take_the_clipping_plugin_from_the_trainer(strategy: type) -> None:
    instance = strategy()
    instance.precision_plugin = MixedPrecision("bf16-mixed", "cpu")  # what Lightning's connector does
    assert type(instance.precision_plugin) is GymMixedPrecision
    instance.precision_plugin = None
    assert type(instance.precision_plugin) is Precision


class _FusedModule(LightningModule):
    """A linear layer trained by a fused optimizer; records the update of its first step."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 16)
        self.optimizer = optimizer
        self.update: torch.Tensor | None = None
        self.poison = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = 100.0 * self.layer(batch).float().pow(2).mean()
        if self.poison:  # an inf gradient: the scaler must skip the step
            loss = loss * torch.tensor(float("inf"))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":  # fused SGD, lr 1: the update is the clipped gradient
            return torch.optim.SGD(self.parameters(), lr=1.0, fused=True)
        return torch.optim.AdamW(self.parameters(), lr=EPS, eps=EPS, weight_decay=0.0, fused=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._before = torch.cat([p.detach().flatten().clone() for p in self.parameters()])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.update = self._before - torch.cat([p.detach().flatten() for p in self.parameters()])


def _fit(module: _FusedModule, plugin: Precision, clip: float | None) -> torch.Tensor:
    data = torch.utils.data.DataLoader(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), batch_size=8)
    trainer = Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], gradient_clip_val=clip, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    assert module.update is not None
    return module.update


def test_bf16_mixed_clips_with_fused_adamw_where_lightning_refused() -> None:
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(_FusedModule("adamw"), MixedPrecision("bf16-mixed", "cpu"), CLIP)
    update = _fit(_FusedModule("adamw"), GymMixedPrecision("bf16-mixed", "cpu"), CLIP)
    unclipped = _fit(_FusedModule("adamw"), GymMixedPrecision("bf16-mixed", "cpu"), None)
    assert unclipped.norm() > 10 * CLIP  # clipping had work to do
    assert update.norm() == pytest.approx(CLIP, rel=1e-3)


def test_fp16_mixed_keeps_the_scalers_rules_with_a_fused_optimizer() -> None:
    # 16-mixed on a CPU: Lightning's Trainer would switch the flag to bf16, a plugin instance is taken as it is.
    # A scale of 2^8: the default 2^16 overflows this layer's fp16 gradients, and the first step would be skipped.
    plugin = GymMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler(device="cpu", init_scale=2.0**8))
    update = _fit(_FusedModule("sgd"), plugin, CLIP)
    # Clipped after unscaling: the step moves by the true clipped gradient (clipping the scaled gradients and
    # letting the fused step unscale would move by CLIP / 2^8).
    assert update.norm() == pytest.approx(CLIP, rel=1e-3)
    scale = plugin.scaler.get_scale()
    poisoned = _FusedModule("sgd")
    poisoned.poison = True
    assert _fit(poisoned, plugin, CLIP).abs().max() == 0  # inf gradients: no step
    assert plugin.scaler.get_scale() == scale / 2  # and the scale backs off


# ------------------------------------------------------------------------------------- the user's path, 2 ranks
def _config(out: Path, folder: str, strategy: Any, devices: int, lr: float, clip: float | None) -> Path:
    config = {
        "seed_everything": 42,
        "trainer": {
            "accelerator": "cpu", "devices": devices, "strategy": strategy, "precision": "bf16-mixed",
            "max_steps": 1, "gradient_clip_val": clip, "limit_val_batches": 0, "enable_checkpointing": False,
            "enable_progress_bar": False, "default_root_dir": str(out),
        },
        "model": {
            "model": folder, "optim": "adamw_torch_fused", "lr": lr, "eps": EPS, "weight_decay": 0.0,
            "scheduler": "constant",
        },
        "export": {"output_dir": str(out / "hf")},
        "data": {"dataset": "addition", "batch_size": 8 // devices, "max_seq_length": 32, "seed": 42},
    }  # fmt: skip
    out.mkdir(parents=True)
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _update(before: Path, after: Path) -> torch.Tensor:
    start, end = tensors_of(before / "hf"), tensors_of(after / "hf")
    return torch.cat([(start[name].double() - end[name].double()).flatten() for name in sorted(start)])


@pytest.mark.slow
def test_bf16_mixed_clips_by_the_global_norm_under_every_strategy(tmp_path: Path) -> None:
    folder = "tiny-llama"
    one = {name: tmp_path / name for name in ("start", "unclipped", "clipped")}
    fit_in_one_launch(
        [
            _config(one["start"], folder, "auto", 1, lr=1e-30, clip=None),  # the weights before the step
            _config(one["unclipped"], folder, "auto", 1, lr=EPS, clip=None),
            _config(one["clipped"], folder, "auto", 1, lr=EPS, clip=RUN_CLIP),
        ],
        nproc=1,
    )
    runs = {name: tmp_path / name for name in STRATEGIES}
    fit_in_one_launch([_config(runs[name], folder, s, 2, lr=EPS, clip=RUN_CLIP) for name, s in STRATEGIES.items()])
    reference = _update(one["start"], one["clipped"])
    assert _update(one["start"], one["unclipped"]).norm() > 10 * RUN_CLIP  # clipping had work to do
    assert reference.norm().item() == pytest.approx(RUN_CLIP, rel=1e-3)
    for name, out in runs.items():
        update = _update(one["start"], out)
        assert update.norm().item() == pytest.approx(RUN_CLIP, rel=1e-2), name
        # bf16 autocast on 8 rows vs 2 x 4 rows, reduced in another order: close, not bit-equal.
        assert (update - reference).norm() / reference.norm() < SAME_UPDATE[name], name
