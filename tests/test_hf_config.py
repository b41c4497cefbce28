"""Hugging Face-style DeepSpeed JSON resolution (pure functions, no Trainer, no DeepSpeed engine)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from gym_lightning.strategies.hf_deepspeed_config import (
    TrainingFacts,
    adopted_accumulation,
    hidden_size_of,
    load_deepspeed_json,
    module_hidden_size,
    needs_hidden_size,
    needs_total_steps,
    resolve_hf_deepspeed_config,
    zero_plus_plus_problems,
)

SHIPPED = sorted((Path(__file__).resolve().parents[1] / "configs" / "deepspeed").glob("*.json"))

FACTS = TrainingFacts(
    micro_batch_size=4,
    accumulate_grad_batches=2,
    world_size=2,
    gradient_clip_val=1.0,
    precision="bf16-mixed",
    lr=3e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    warmup_steps=0,
    total_steps=100,
    hidden_size=32,
)


def _all_auto(stage: int = 3) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }


def test_every_auto_resolved_as_the_hf_integration_does() -> None:
    config = _all_auto()
    resolved = resolve_hf_deepspeed_config(config, FACTS)
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 2 * 4 * 2
    assert resolved["gradient_clipping"] == 1.0
    assert resolved["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    # warmup_num_steps: HF keeps it >= 1 because DeepSpeed >= 0.19.6 rejects 0.
    assert resolved["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 1,
        "total_num_steps": 100,
    }
    assert resolved["fp16"]["enabled"] is False and resolved["bf16"]["enabled"] is True
    zero = resolved["zero_optimization"]
    assert zero["reduce_bucket_size"] == 32 * 32
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert zero["stage3_param_persistence_threshold"] == 10 * 32
    assert config["train_batch_size"] == "auto", "the caller's dict must not be modified"


@pytest.mark.parametrize(("precision", "fp16", "bf16"), [("32-true", False, False), ("16-mixed", True, False)])
def test_precision_auto(precision: str, fp16: bool, bf16: bool) -> None:
    resolved = resolve_hf_deepspeed_config(_all_auto(), replace(FACTS, precision=precision))
    assert (resolved["fp16"]["enabled"], resolved["bf16"]["enabled"]) == (fp16, bf16)


def test_explicit_values_that_agree_pass_and_missing_keys_are_not_added() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
    }
    resolved = resolve_hf_deepspeed_config(config, FACTS)
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 5e8  # sizes are never checked
    assert "fp16" not in resolved and "eps" not in resolved["optimizer"]["params"]
    # The two shared settings always carry the single effective value.
    assert resolved["gradient_clipping"] == 1.0 and resolved["gradient_accumulation_steps"] == 2


def test_every_conflict_is_listed_in_one_message_with_both_values_and_the_fix() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 16,
        "train_batch_size": 1024,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_max_lr": 1e-5, "warmup_num_steps": 50, "total_num_steps": 7},
        },
        "fp16": {"enabled": True},
        "bf16": {"enabled": False},
    }
    with pytest.raises(ValueError) as info:
        resolve_hf_deepspeed_config(config, FACTS)
    message = str(info.value)
    expected = [
        ("train_micro_batch_size_per_gpu=8", "data.batch_size gives 4", "--per_device_train_batch_size"),
        ("gradient_accumulation_steps=16", "trainer.accumulate_grad_batches gives 2", "--gradient_accumulation_steps"),
        ("train_batch_size=1024", "gives 16", "--devices"),
        ("gradient_clipping=0.5", "trainer.gradient_clip_val gives 1.0", "--max_grad_norm"),
        ("optimizer.params.lr=1e-05", "model.lr gives 0.0003", "--learning_rate"),
        ("optimizer.params.betas=[0.9, 0.999]", "model.betas gives [0.9, 0.95]", "--adam_beta1/--adam_beta2"),
        ("optimizer.params.eps=1e-06", "model.eps gives 1e-08", "--adam_epsilon"),
        ("optimizer.params.weight_decay=0", "model.weight_decay gives 0.1", "--weight_decay"),
        ("scheduler.params.warmup_max_lr=1e-05", "model.lr gives 0.0003", "--learning_rate"),
        ("scheduler.params.warmup_num_steps=50", "gives 1", "--warmup_steps"),
        ("scheduler.params.total_num_steps=7", "gives 100", "--max_steps"),
        ("fp16.enabled=true", "trainer.precision='bf16-mixed'", "trainer.precision=16-mixed (gym train: --fp16)"),
        ("bf16.enabled=false", "trainer.precision='bf16-mixed'", "trainer.precision=32-true"),
    ]
    assert f"({len(expected)} problem(s))" in message
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(lines) == len(expected)
    for json_side, trainer_side, fix in expected:
        (line,) = [line for line in lines if line.startswith(f"  - {json_side} ")]
        assert trainer_side in line and fix in line, line
        assert '"auto"' in line, "every conflict says the JSON side of the fix too"


def test_shared_settings_are_adopted_from_the_json_when_the_trainer_left_them_unset() -> None:
    unset = replace(FACTS, accumulate_grad_batches=None, gradient_clip_val=None)
    resolved = resolve_hf_deepspeed_config({"gradient_accumulation_steps": 8, "gradient_clipping": 0.3}, unset)
    assert resolved["gradient_accumulation_steps"] == 8 and resolved["gradient_clipping"] == 0.3
    # ... and "auto" (or nothing) with the Trainer's unset gives Lightning's defaults: no accumulation, no clipping.
    for config in ({"gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}, {}):
        resolved = resolve_hf_deepspeed_config(config, unset)
        assert resolved["gradient_accumulation_steps"] == 1 and resolved["gradient_clipping"] == 0.0
    # train_batch_size uses the adopted accumulation.
    resolved = resolve_hf_deepspeed_config({"gradient_accumulation_steps": 8, "train_batch_size": "auto"}, unset)
    assert resolved["train_batch_size"] == 2 * 4 * 8


def test_adopted_accumulation_treats_the_trainer_default_as_unset() -> None:
    assert adopted_accumulation({"gradient_accumulation_steps": 8}, 1) == 8
    assert adopted_accumulation({"gradient_accumulation_steps": "auto"}, 1) == 1
    assert adopted_accumulation({"gradient_accumulation_steps": 8}, 4) == 4  # the resolver then reports the conflict
    assert adopted_accumulation({}, 3) == 3


def test_unresolvable_and_unknown_auto_are_reported_together() -> None:
    config = _all_auto()
    config["zero_optimization"]["stage3_max_live_parameters"] = "auto"
    with pytest.raises(ValueError) as info:
        resolve_hf_deepspeed_config(config, TrainingFacts(precision="32-true"))
    message = str(info.value)
    for key in ("train_micro_batch_size_per_gpu", "optimizer.params.lr", "scheduler.params.total_num_steps"):
        assert f'{key}: "auto" needs a value that is not known here' in message
    assert "zero_optimization.reduce_bucket_size" in message and "no hidden_size" in message
    assert 'zero_optimization.stage3_max_live_parameters: "auto" is only understood' in message


def test_needs_helpers_avoid_costly_facts() -> None:
    assert needs_total_steps(_all_auto()) and needs_hidden_size(_all_auto())
    plain = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}
    assert not needs_total_steps(plain) and not needs_hidden_size(plain)


def test_hidden_size_as_hf_picks_it() -> None:
    assert hidden_size_of(SimpleNamespace(hidden_size=64)) == 64
    assert hidden_size_of(SimpleNamespace(hidden_sizes=[32, 96, 64])) == 96
    assert hidden_size_of(SimpleNamespace(text_config=SimpleNamespace(hidden_size=48))) == 48
    assert hidden_size_of(SimpleNamespace()) is None
    # Before configure_model (ZeRO-3 resolves first), the size comes from the module's model config.
    module = SimpleNamespace(model=None, hparams={"model": "tiny-llama", "config_overrides": {"hidden_size": 48}})
    assert module_hidden_size(module) == 48


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_deepspeed_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ValueError, match=r"broken.json:1: invalid JSON"):
        load_deepspeed_json(broken)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_resolve_completely(path: Path) -> None:
    resolved = resolve_hf_deepspeed_config(path, replace(FACTS, precision="32-true"))
    assert "auto" not in json.dumps(resolved)
    assert resolved["fp16"]["enabled"] is False and resolved["bf16"]["enabled"] is False


def test_all_shipped_configs_exist() -> None:
    names = {path.name for path in SHIPPED}
    assert names == {
        "ds_zero1.json",
        "ds_zero2.json",
        "ds_zero2_offload.json",
        "ds_zero3.json",
        "ds_zero3_offload.json",
        "ds_zero_infinity.json",
    }


# ------------------------------------------------------------------------------------------------------- ZeRO++
ZPP = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}


def test_zero_plus_plus_on_cpu_says_it_needs_gpus() -> None:
    problems = zero_plus_plus_problems({"zero_optimization": ZPP}, "cpu", world_size=2)
    assert len(problems) == 1
    for text in ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size=2", "cpu ranks"):
        assert text in problems[0]
    assert "CUDA GPUs" in problems[0] and "Remove these keys" in problems[0]


def test_zero_plus_plus_passes_through_on_gpus() -> None:
    assert zero_plus_plus_problems({"zero_optimization": ZPP}, "cuda", world_size=8) == []
    # Off / absent ZeRO++ keys are fine anywhere.
    off = {"stage": 2, "zero_quantized_weights": False, "zero_hpz_partition_size": 1}
    assert zero_plus_plus_problems({"zero_optimization": off}, "cpu", world_size=2) == []


def test_zero_plus_plus_needs_stage_3_and_a_dividing_hpz() -> None:
    problems = zero_plus_plus_problems(
        {"zero_optimization": {**ZPP, "stage": 2, "zero_hpz_partition_size": 3}}, "cuda", 8
    )
    assert len(problems) == 2
    assert "needs zero_optimization.stage=3, got 2" in problems[0]
    assert "zero_hpz_partition_size=3" in problems[1] and "divides the world size (8)" in problems[1]
