"""Hugging Face-style DeepSpeed JSON resolution (pure functions, no Trainer, no DeepSpeed engine), and the facts
the module and data module state for it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from helpers.dist import REPO_ROOT
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI

from gym_lightning.cli import accumulation_from_strategy_config
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.errors import GymUserError
from gym_lightning.models.facts import ModelFacts, hidden_size_of, model_facts_of
from gym_lightning.module import CausalLMModule
from gym_lightning.protocols import (
    OptimizerFacts,
    ProvidesMicroBatchSize,
    ProvidesModelFacts,
    ProvidesOptimizerFacts,
    micro_batch_size_of,
    optimizer_facts_of,
)
from gym_lightning.strategies import ZeROStrategy
from gym_lightning.strategies.zero.config import load_deepspeed_json, zero_plus_plus_problems
from gym_lightning.strategies.zero.hf_auto import (
    TrainingFacts,
    adopted_accumulation,
    needs_total_steps,
    resolve_hf_deepspeed_config,
)
from gym_lightning.strategies.zero.resolve import training_facts

SHIPPED = sorted((REPO_ROOT / "configs" / "deepspeed").glob("*.json"))

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
    with pytest.raises(GymUserError) as info:
        resolve_hf_deepspeed_config(config, FACTS)
    message = str(info.value)
    # The fix names the Lightning setting only; `gym train` adds its flags (tests/commands/test_train.py).
    expected = [
        ("train_micro_batch_size_per_gpu=8", "data.batch_size gives 4", "change data.batch_size to 8"),
        ("gradient_accumulation_steps=16", "trainer.accumulate_grad_batches gives 2", "change trainer.accumulate"),
        ("train_batch_size=1024", "gives 16", "trainer.devices x trainer.num_nodes"),
        ("gradient_clipping=0.5", "trainer.gradient_clip_val gives 1.0", "change trainer.gradient_clip_val to 0.5"),
        ("optimizer.params.lr=1e-05", "model.lr gives 0.0003", "change model.lr to 1e-05"),
        ("optimizer.params.betas=[0.9, 0.999]", "model.betas gives [0.9, 0.95]", "change model.betas"),
        ("optimizer.params.eps=1e-06", "model.eps gives 1e-08", "change model.eps to 1e-06"),
        ("optimizer.params.weight_decay=0", "model.weight_decay gives 0.1", "change model.weight_decay to 0"),
        ("scheduler.params.warmup_max_lr=1e-05", "model.lr gives 0.0003", "change model.lr"),
        ("scheduler.params.warmup_num_steps=50", "gives 1", "model.warmup_steps/model.warmup_ratio"),
        ("scheduler.params.total_num_steps=7", "gives 100", "trainer.max_steps"),
        ("fp16.enabled=true", "trainer.precision is 'bf16-mixed'", "set trainer.precision to 16-mixed"),
        ("bf16.enabled=false", "trainer.precision is 'bf16-mixed'", "set trainer.precision to 32-true"),
    ]
    assert message.startswith(f"The DeepSpeed config disagrees with the Trainer/module ({len(expected)} problem(s))")
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(lines) == len(expected)
    for json_side, trainer_side, fix in expected:
        (line,) = [line for line in lines if line.startswith(f"  - {json_side} ")]
        assert trainer_side in line and fix in line, line
        assert '"auto"' in line, "every conflict says the JSON side of the fix too"
        assert "--" not in line, "gym train's flags are not the strategy's business"


def test_accumulation_mismatch_with_the_trainer_default_says_where_the_json_is_adopted() -> None:
    with pytest.raises(GymUserError) as info:
        resolve_hf_deepspeed_config({"gradient_accumulation_steps": 8}, replace(FACTS, accumulate_grad_batches=1))
    message = str(info.value)
    assert (
        "gradient_accumulation_steps=8 in the DeepSpeed config but trainer.accumulate_grad_batches gives 1" in message
    )
    assert "adopted only before the Trainer is built" in message and "Trainer(accumulate_grad_batches=...)" in message


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


def _zero(config: object, class_path: str = "gym_lightning.strategies.ZeROStrategy") -> dict:
    return {"class_path": class_path, "init_args": {"config": config}}


def test_accumulation_from_strategy_config_adopts_the_json_before_the_trainer_is_built(tmp_path: Path) -> None:
    explicit = {"gradient_accumulation_steps": 8}
    assert accumulation_from_strategy_config(_zero(explicit), 1) == 8
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(explicit))
    for name in ("ZeRO1Strategy", "ZeRO2Strategy", "ZeRO3Strategy", "zero.strategy.ZeROStrategy"):
        assert accumulation_from_strategy_config(_zero(str(path), f"gym_lightning.strategies.{name}"), 1) == 8
    # A user's own subclass is a ZeRO strategy too: the class is imported and checked, not matched by name.
    assert accumulation_from_strategy_config(_zero(explicit, f"{__name__}.MyZeRO"), 1) == 8
    # LightningCLI hands the strategy over as a (jsonargparse) namespace.
    namespace = Namespace(class_path="gym_lightning.strategies.ZeROStrategy", init_args=Namespace(config=str(path)))
    assert accumulation_from_strategy_config(namespace, 1) == 8


def test_accumulation_from_strategy_config_leaves_everything_else_alone() -> None:
    explicit = {"gradient_accumulation_steps": 8}
    assert accumulation_from_strategy_config(_zero(explicit), 2) == 2  # set by the user: the strategy reports it
    assert accumulation_from_strategy_config(_zero({"gradient_accumulation_steps": "auto"}), 1) == 1
    assert accumulation_from_strategy_config(_zero(None), 3) == 3
    assert accumulation_from_strategy_config("zero3", 1) == 1
    assert accumulation_from_strategy_config(None, 1) == 1
    other = _zero(explicit, "lightning.pytorch.strategies.DeepSpeedStrategy")
    assert accumulation_from_strategy_config(other, 1) == 1
    assert accumulation_from_strategy_config(_zero(explicit, "no.such.Strategy"), 1) == 1  # LightningCLI reports it
    with pytest.raises(GymUserError, match="not found"):
        accumulation_from_strategy_config(_zero("missing.json"), 1)


class MyZeRO(ZeROStrategy):
    """A user's own ZeRO strategy (found by ``accumulation_from_strategy_config`` by its class path)."""


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


class _AdoptingCLI(LightningCLI):
    """The hook GymCLI runs (the code the report hands to cli.py's owner), on a real LightningCLI namespace."""

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config["trainer"]
        trainer["accumulate_grad_batches"] = accumulation_from_strategy_config(
            trainer["strategy"], trainer["accumulate_grad_batches"]
        )


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.parametrize(("flags", "expected"), [([], 8), (["--trainer.accumulate_grad_batches=2"], 2)])
def test_the_cli_hook_adopts_on_a_lightning_cli_namespace(tmp_path: Path, flags: list[str], expected: int) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}))
    strategy = json.dumps(_zero(str(path)))
    cli = _AdoptingCLI(
        _Tiny,
        run=False,
        seed_everything_default=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.logger=false",
            f"--trainer.strategy={strategy}",
            *flags,
        ],
    )
    assert cli.trainer.accumulate_grad_batches == expected


def test_unresolvable_and_unknown_auto_are_reported_together() -> None:
    config = _all_auto()
    config["zero_optimization"]["stage3_max_live_parameters"] = "auto"  # resolvable: needs the layer size
    config["zero_optimization"]["sub_group_size"] = "auto"  # never resolvable
    with pytest.raises(GymUserError) as info:
        resolve_hf_deepspeed_config(config, TrainingFacts(precision="32-true"))
    message = str(info.value)
    for key in ("train_micro_batch_size_per_gpu", "optimizer.params.lr", "scheduler.params.total_num_steps"):
        assert f'{key}: "auto" needs a value that is not known here' in message
    assert "zero_optimization.reduce_bucket_size" in message and "no hidden_size" in message
    assert "zero_optimization.stage3_max_live_parameters" in message and "no layer_numel" in message
    assert 'zero_optimization.sub_group_size: "auto" is only understood' in message


def test_needs_helpers_avoid_costly_facts() -> None:
    assert needs_total_steps(_all_auto())
    plain = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}
    assert not needs_total_steps(plain)


def test_hidden_size_as_hf_picks_it() -> None:
    assert hidden_size_of(SimpleNamespace(hidden_size=64)) == 64
    assert hidden_size_of(SimpleNamespace(hidden_sizes=[32, 96, 64])) == 96
    assert hidden_size_of(SimpleNamespace(text_config=SimpleNamespace(hidden_size=48))) == 48
    assert hidden_size_of(SimpleNamespace()) is None


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(GymUserError, match="not found"):
        load_deepspeed_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(GymUserError, match=r"broken.json:1: invalid JSON"):
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


# ------------------------------------------------------------------------------------------ facts from the Trainer
def _trainer(**overrides: object) -> SimpleNamespace:
    values = {
        "accumulate_grad_batches": 1,
        "world_size": 2,
        "gradient_clip_val": None,
        "precision": "bf16-mixed",
        "estimated_stepping_batches": 50,
    }
    return SimpleNamespace(**(values | overrides))


def test_training_facts_take_the_module_facts_and_resolve_warm_up_from_the_total() -> None:
    config = _all_auto()
    stated = OptimizerFacts(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, warmup_ratio=0.1)
    model = ModelFacts(hidden_size=64, layer_numel=1000)
    facts = training_facts(_trainer(), stated, model, config, micro_batch_size=4)
    assert (facts.lr, facts.betas, facts.eps, facts.weight_decay, facts.hidden_size, facts.layer_numel) == (
        1e-3,
        (0.9, 0.95),
        1e-6,
        0.1,
        64,
        1000,
    )
    assert facts.total_steps == 50 and facts.warmup_steps == 5  # ceil(0.1 x 50), as optim.resolve_warmup_steps
    assert training_facts(_trainer(), replace(stated, warmup_steps=7), model, config, 4).warmup_steps == 7
    # The Trainer's accumulation is what it is (1 included): the strategy never adopts, it reports.
    assert facts.accumulate_grad_batches == 1 and facts.world_size == 2 and facts.precision == "bf16-mixed"
    endless = training_facts(_trainer(estimated_stepping_batches=float("inf")), stated, model, config, 4)
    assert endless.total_steps is None and endless.warmup_steps is None


def test_a_module_without_facts_leaves_them_unknown_even_with_matching_hparams() -> None:
    plain = SimpleNamespace(hparams={"lr": 1e-3, "warmup_steps": 2})  # read by name before; never again
    optimizer, model = optimizer_facts_of(plain), model_facts_of(plain)
    facts = training_facts(_trainer(), optimizer, model, _all_auto(), micro_batch_size=None)
    assert (facts.lr, facts.betas, facts.warmup_steps, facts.hidden_size, facts.micro_batch_size) == (None,) * 5
    with pytest.raises(GymUserError) as info:
        resolve_hf_deepspeed_config(_all_auto(), facts)
    message = str(info.value)
    assert 'optimizer.params.lr: "auto" needs a value that is not known here (model.lr is not known' in message
    assert "ProvidesOptimizerFacts" in message and "ProvidesMicroBatchSize" in message
    assert "ProvidesModelFacts" in message


def test_micro_batch_size_comes_from_the_first_provider_that_states_one() -> None:
    data = SimpleNamespace(micro_batch_size=4)
    assert micro_batch_size_of(None, SimpleNamespace(batch_size=8), data) == 4
    assert micro_batch_size_of(SimpleNamespace(micro_batch_size=None), SimpleNamespace()) is None
    assert isinstance(CausalLMDataModule(dataset="addition", batch_size=3), ProvidesMicroBatchSize)
    assert micro_batch_size_of(CausalLMDataModule(dataset="addition", batch_size=3)) == 3


def test_causal_lm_module_states_its_optimizer_and_model_facts() -> None:
    module = CausalLMModule(
        model="tiny-llama",
        config_overrides={"hidden_size": 48},
        lr=2e-4,
        betas=(0.8, 0.9),
        eps=1e-7,
        weight_decay=0.05,
        warmup_steps=3,
        warmup_ratio=0.2,
    )
    assert isinstance(module, ProvidesOptimizerFacts) and isinstance(module, ProvidesModelFacts)
    expected = OptimizerFacts(lr=2e-4, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05, warmup_steps=3, warmup_ratio=0.2)
    assert module.optimizer_facts() == expected
    # Before configure_model (ZeRO-3 resolves the JSON first) the model facts come from the model config ...
    # q/k/v/o: 4 heads and 4 kv heads of the preset's head_dim 32 (set from its own width 128, kept by the override),
    # SwiGLU 384, 2 norms.
    layer = 4 * 48 * (4 * 32) + 3 * 48 * 384 + 2 * 48
    assert module.model_facts() == ModelFacts(hidden_size=48, layer_numel=layer)
    # ... and afterwards from the built model.
    module.configure_model()
    module.model.config.hidden_size = 40  # only to tell the two sources apart
    assert module.model_facts().hidden_size == 40


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
