"""ZeRO's DeepSpeed config: the pure functions of ``strategies.zero.resolve``, and one call of ``run_config`` per
run (a real one-rank fit, whose engine receives the config the code before the change gave it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.dist import run_python

from gym_lightning.errors import GymUserError
from gym_lightning.strategies import ZeRO1Strategy, ZeRO3Strategy, ZeROStrategy
from gym_lightning.strategies.zero.config import apply_gym_defaults, zero_config
from gym_lightning.strategies.zero.hf_auto import TrainingFacts
from gym_lightning.strategies.zero.resolve import (
    alst_sequence_parallel_size,
    checked_stage,
    inference_config,
    remote_device,
    run_config,
)
from gym_lightning.strategies.zero.sizing import BUCKET_KEYS, DEFAULT_BUCKET_SIZE, cap_bucket_sizes

GYM_DEFAULTS = {
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "managed_gradient_accumulation": False,
    "timers": {"throughput": {"synchronized": False}},  # DeepSpeed's timer on host time: no device sync per step
}
# What a one-rank Trainer(max_steps=2) with a DataLoader of batch 4 states (no clipping, fp32).
TRAINER = {"micro_batch_size": 4, "accumulate_grad_batches": 1, "world_size": 1, "precision": "32-true"}
FROM_TRAINER = {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 4}


def _generated(
    stage: int, offload_optimizer: str = "none", offload_parameters: str = "none", bucket_size: int | None = None
) -> dict[str, Any]:
    return apply_gym_defaults(zero_config(stage, offload_optimizer, offload_parameters, None, False, bucket_size))


def test_generated_config_without_module_facts_gets_deepspeeds_defaults() -> None:
    facts = TrainingFacts(**TRAINER)
    for stage in (1, 2, 3):
        config = run_config(_generated(stage), facts, generated=True)
        zero = zero_config(stage, "none", "none", None, False, DEFAULT_BUCKET_SIZE)["zero_optimization"]
        if stage == 3:  # ZeRO-3's limits nobody states: DeepSpeed's defaults (the keys are dropped)
            zero = {key: value for key, value in zero.items() if not key.startswith("stage3_")}
        assert config == {"zero_optimization": zero, **GYM_DEFAULTS, **FROM_TRAINER}


def test_generated_stage3_config_is_sized_by_one_layer() -> None:
    config = run_config(_generated(3), TrainingFacts(**TRAINER, hidden_size=3, layer_numel=6), generated=True)
    assert config["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 6,
        "reduce_bucket_size": 6,
        "stage3_prefetch_bucket_size": 6,
        "stage3_max_live_parameters": 12,
        "stage3_max_reuse_distance": 6,
        "sub_group_size": 6,
        # strategies.zero.rule: vectors (10 x hidden) persist, within a budget of one layer per rank.
        "stage3_param_persistence_threshold": 30,
        "stage3_model_persistence_threshold": 6,
    }
    # Optimizer offload keeps DeepSpeed's sub-group (its swapping works in sub-groups); an explicit bucket stays.
    offload = _generated(3, offload_optimizer="cpu", offload_parameters="cpu", bucket_size=1000)
    zero = run_config(offload, TrainingFacts(**TRAINER, layer_numel=6), generated=True)["zero_optimization"]
    assert "sub_group_size" not in zero and zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 1000


HF_AUTO = {
    **dict.fromkeys(["train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"], "auto"),
    **dict.fromkeys(["gradient_clipping"], "auto"),
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": dict.fromkeys(["lr", "betas", "eps", "weight_decay"], "auto")},
    "scheduler": {"type": "WarmupDecayLR", "params": dict.fromkeys(["warmup_min_lr", "warmup_max_lr"], "auto")},
    "zero_optimization": {
        "stage": 3,
        **dict.fromkeys(["reduce_bucket_size", "stage3_prefetch_bucket_size"], "auto"),
        **dict.fromkeys(["stage3_param_persistence_threshold", "stage3_max_live_parameters"], "auto"),
        "stage3_max_reuse_distance": "auto",
    },
}


def test_a_hugging_face_json_follows_the_hf_rules_and_is_not_modified() -> None:
    user = json.loads(json.dumps(HF_AUTO))
    optimizer = {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    facts = TrainingFacts(**TRAINER, **optimizer, hidden_size=3, layer_numel=6)
    config = run_config(apply_gym_defaults(user), facts, generated=False)
    assert user == HF_AUTO, "the input must not be modified"
    assert config == {
        **GYM_DEFAULTS,
        **FROM_TRAINER,
        "train_batch_size": 4,
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {**optimizer, "betas": [0.9, 0.999]}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 9,  # HF: hidden_size²
            "stage3_prefetch_bucket_size": 6,
            "stage3_param_persistence_threshold": 30,
            "stage3_max_live_parameters": 12,
            "stage3_max_reuse_distance": 6,
        },
    }


@pytest.mark.parametrize(
    "config",
    [
        _generated(2),
        _generated(3, offload_optimizer="cpu", offload_parameters="cpu"),
        {**HF_AUTO, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
    ],
)
def test_no_bucket_auto_survives_the_one_call(config: dict[str, Any]) -> None:
    # Before, the strategy filled the buckets a second time after the build (with 2e8): that was a no-op.
    facts = TrainingFacts(**TRAINER, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, hidden_size=3)
    resolved = run_config(config, facts, generated="optimizer" not in config)
    assert all(resolved["zero_optimization"].get(key) != "auto" for key in BUCKET_KEYS)
    with pytest.raises(GymUserError, match=r"allgather_bucket_size: \"auto\" is only understood"):
        run_config({"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}, facts, generated=False)


def test_stage_resolution_and_its_problems() -> None:
    args = ("none", "none", None, "torch")
    assert checked_stage("ZeROStrategy", None, None, None, *args) == 2
    assert checked_stage("ZeROStrategy", None, None, {"zero_optimization": {"stage": 0}}, *args) == 0
    assert checked_stage("ZeRO3Strategy", 3, None, None, *args) == 3
    with pytest.raises(GymUserError, match=r"stage=1 disagrees with ZeRO3Strategy \(stage 3\)"):
        checked_stage("ZeRO3Strategy", 3, 1, None, *args)
    with pytest.raises(GymUserError, match=r"(?s)Invalid ZeRO1Strategy configuration.*zero_optimization\.stage=3"):
        checked_stage("ZeRO1Strategy", 1, None, {"zero_optimization": {"stage": 3}}, *args)
    assert ZeRO1Strategy().stage == 1 and ZeROStrategy(config={"zero_optimization": {"stage": 3}}).stage == 3


def test_alst_size_is_taken_out_of_the_json_without_touching_it() -> None:
    user = {"sequence_parallel_size": 2, "zero_optimization": {"stage": 2}}
    assert alst_sequence_parallel_size(1, user) == (2, {"zero_optimization": {"stage": 2}})
    assert user["sequence_parallel_size"] == 2, "the input must not be modified"
    assert alst_sequence_parallel_size(2, user)[0] == 2
    assert alst_sequence_parallel_size(4, None) == (4, None)
    with pytest.raises(GymUserError, match="sequence_parallel_size=4 disagrees with the DeepSpeed config's 2"):
        alst_sequence_parallel_size(4, user)
    with pytest.raises(GymUserError, match="must be an integer >= 1"):
        alst_sequence_parallel_size(1, {"sequence_parallel_size": 0})


def test_remote_device_follows_the_parameter_offload() -> None:
    assert remote_device(_generated(3, offload_parameters="cpu", offload_optimizer="cpu"), "cpu") == "cpu"
    assert remote_device({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "none") == "nvme"
    assert remote_device({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}, "none") is None
    assert remote_device(_generated(2), "none") is None
    assert ZeRO3Strategy(offload_optimizer="cpu", offload_parameters="cpu").remote_device == "cpu"


def test_inference_config_keeps_the_precision_and_stage3_partitioning() -> None:
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "x": 1}, "optimizer": {"type": "AdamW"}}
    assert inference_config(config, zero_stage_3=True) == {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "x": 1},
        "zero_allow_untested_optimizer": True,
    }
    assert inference_config({**config, "zero_optimization": {"stage": 2}}, zero_stage_3=False) == {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
    }


# A real one-rank fit and validate under gym_lightning's own stage-3 config, with run_config counted. The expected
# configs are those deepspeed.initialize received before run_config existed (HEAD 52e0342): one layer (6 elements)
# for buckets, limits and sub-group; the validation engine gets the partitioning only.
_ONE_RUN = """
import json, torch, deepspeed, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from gym_lightning.models.facts import ModelFacts
from gym_lightning.strategies import ZeRO3Strategy
from gym_lightning.strategies.zero import strategy as zero_strategy

calls, configs, resolve, initialize = [], [], zero_strategy.run_config, deepspeed.initialize
zero_strategy.run_config = lambda *args, **kwargs: calls.append(1) or resolve(*args, **kwargs)
deepspeed.initialize = lambda *a, **kwargs: configs.append(json.dumps(kwargs["config"])) or initialize(*a, **kwargs)

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 1)
    def training_step(self, batch, index):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def validation_step(self, batch, index):
        self.log("loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)
    def model_facts(self):
        return ModelFacts(hidden_size=3, layer_numel=6)

trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeRO3Strategy(), max_steps=2, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
    num_sanity_val_steps=0)
loader = DataLoader(TensorDataset(torch.randn(16, 64), torch.randn(16, 1)), batch_size=4)
trainer.fit(Module(), loader)
trainer.validate(trainer.lightning_module, loader, verbose=False)
print("RESULT", json.dumps({"calls": len(calls), "configs": [json.loads(c) for c in configs]}))
"""


@pytest.mark.slow
def test_a_zero_run_computes_its_config_once() -> None:
    out = run_python(["-c", _ONE_RUN], timeout=600).stdout
    result = json.loads(out.split("RESULT", 1)[1])
    assert result["calls"] == 1, "fit and validate share one resolved config"
    layer = {"stage3_prefetch_bucket_size": 6, "stage3_max_live_parameters": 12, "stage3_max_reuse_distance": 6}
    layer |= {"stage3_param_persistence_threshold": 30, "stage3_model_persistence_threshold": 6}  # rule.zero_rule
    zero = {**_generated(3)["zero_optimization"], **dict.fromkeys(BUCKET_KEYS, 6), **layer, "sub_group_size": 6}
    fit, validate = result["configs"]
    assert fit == {**GYM_DEFAULTS, **FROM_TRAINER, "zero_optimization": zero}
    assert validate == {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    # The cap by the model's size (65 elements) is the one step after the build; a layer of 6 is below it.
    assert cap_bucket_sizes(fit, 65) == fit
