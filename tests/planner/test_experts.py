"""Planner: LoRA on a mixture of experts' fused expert weights (``lora.target_parameters``) and 4-bit experts under
QLoRA (``planner.experts``): adapter counts against peft's own, NF4 expert bytes against the quant package's
tensors, the step-time FLOPs, ``gym plan``'s flags and ``--config`` YAML, and the three verdicts docs/planner.md
shows ("Mixture-of-experts LoRA and QLoRA")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml

from gym_lightning.cli import main
from gym_lightning.commands.plan import plan_arguments
from gym_lightning.errors import GymUserError
from gym_lightning.lora import EXPERTS_SHORTHAND
from gym_lightning.models.shapes import ModelShape, shape_from_config
from gym_lightning.planner import BUNDLED, Setup, plan
from gym_lightning.planner.compute import matmul_params
from gym_lightning.planner.estimate import (
    NF4_CHUNK_BYTES,
    STRATEGY_BY_KEY,
    activation_bytes_per_layer,
    dequant_bytes,
    model_states,
    nf4_tensors,
    param_counts,
    quantized_base,
)
from gym_lightning.planner.experts import (
    EXPERT_WEIGHTS,
    expert_adapter_params,
    skipped_expert_weights,
    targeted_weights,
)
from gym_lightning.planner.experts import (
    EXPERTS_SHORTHAND as PLANNER_SHORTHAND,
)
from gym_lightning.quant import experts as nf4_experts
from gym_lightning.quant.config import QuantizationArgs

QWEN3_30B, QWEN3_235B = BUNDLED["qwen3-30b-a3b"], BUNDLED["qwen3-235b-a22b"]
ALL = ("all-experts",)
PEFT_NAMES = ["experts.gate_up_proj", "experts.down_proj"]


def _tiny_config(moe_intermediate_size: int = 32) -> transformers.Qwen3MoeConfig:
    """2 layers, h 64, 4 experts of which 2 per token; ``moe_intermediate_size`` 32 leaves down_proj (in = I)
    16-bit under QLoRA, 64 quantises both expert weights."""
    return transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, moe_intermediate_size=moe_intermediate_size, intermediate_size=96, num_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip


def _tiny_shape(config: transformers.Qwen3MoeConfig) -> ModelShape:
    return shape_from_config(config.to_dict(), "tiny-qwen3-moe")


def test_the_vocabulary_is_the_runtime_s() -> None:
    assert PLANNER_SHORTHAND == EXPERTS_SHORTHAND
    assert EXPERT_WEIGHTS == nf4_experts.EXPERT_WEIGHTS


@pytest.mark.parametrize(
    "targets", [PEFT_NAMES, ["experts.down_proj"], ["mlp.experts.gate_up_proj"]], ids=["both", "down", "prefixed"]
)
def test_adapter_counts_are_peft_s(targets: list[str]) -> None:
    peft = pytest.importorskip("peft")
    config = _tiny_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=3, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=targets)
    model = peft.get_peft_model(model, lora)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    experts = sum(n for name, n in trainable.items() if ".experts." in name)
    shape = _tiny_shape(config)
    # r E (in + out) per adapted weight and layer: gate_up 3*4*(64 + 64) = 1536, down 3*4*(32 + 64) = 1152
    assert experts == expert_adapter_params(shape, 3, targets) > 0
    setup = Setup(lora_r=3, lora_target_parameters=tuple(targets))
    assert param_counts(shape, setup).trainable == sum(trainable.values())


def test_all_experts_is_both_weights_and_experts_alone_drops_the_linears() -> None:
    assert targeted_weights(ALL) == targeted_weights(PEFT_NAMES) == EXPERT_WEIGHTS
    assert targeted_weights(["down_proj"]) == ("down_proj",)
    shape = _tiny_shape(_tiny_config())
    alone = param_counts(shape, Setup(lora_r=3, lora_targets="none", lora_target_parameters=ALL))
    assert alone.trainable == expert_adapter_params(shape, 3, ALL) == 2 * (1536 + 1152)
    # Qwen3-30B-A3B at r=16: 16*128*((2048 + 1536) + (768 + 2048)) = 13.1M a layer, 629M in all: 47 x attention's
    assert expert_adapter_params(QWEN3_30B, 16, ALL) == 48 * 16 * 128 * (3584 + 2816) == 629_145_600


def test_nf4_expert_bytes_are_the_quant_package_s() -> None:
    for width, quantised in ((64, EXPERT_WEIGHTS), (32, ("gate_up_proj",))):  # in = I = 32: down stays 16-bit
        config = _tiny_config(width)
        with nf4_experts.experts_built_as_nf4(
            nf4_experts.experts_classes(transformers.Qwen3MoeForCausalLM), QuantizationArgs()
        ):
            model = transformers.Qwen3MoeForCausalLM(config)
        experts = model.model.layers[0].mlp.experts
        built = sum(p.numel() * p.element_size() for n, p in experts.named_parameters() if p.dtype != torch.float32)
        assert tuple(nf4_experts.nf4_weights_of(experts)) == quantised
        shape, setup = _tiny_shape(config), Setup(lora_r=4, quantization="nf4")
        quant = quantized_base(shape, setup)
        linears = sum(n * b for i, o in shape.linear_shapes().values() for n, b in nf4_tensors(i, o).values())
        assert quant.layer_bytes - linears == built
        assert quant.expert_weights == 2 * sum(experts.num_experts * i * o for i, o in _dims(shape, quantised))


def _dims(shape: ModelShape, names: tuple[str, ...]) -> list[tuple[int, int]]:
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    dims = {"gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}
    return [dims[name] for name in names]


def test_qwen3_30b_experts_in_nf4_by_hand() -> None:
    setup = Setup(gpus_per_node=1, lora_r=16, quantization="nf4", activation_checkpointing=True)
    quant = quantized_base(QWEN3_30B, setup)
    # per layer 128 x (gate_up 2048 -> 1536 + down 768 -> 2048) = 603,979,776 expert weights, x 48
    assert quant.expert_weights == 48 * 128 * (2048 * 1536 + 768 * 2048) == 28_991_029_248
    gate_up = 1536 * 2048 * (0.5 + 1 / 64) + 1536 * 4 * 2  # 32 scales a row: 1 + ceil(32/256) = 2 stats
    down = 2048 * 768 * (0.5 + 1 / 64) + 2048 * 4 * 2  # 12 scales a row
    attention = sum(sum(n * b for n, b in nf4_tensors(i, o).values()) for i, o in QWEN3_30B.linear_shapes().values())
    assert quant.layer_bytes == pytest.approx(128 * (gate_up + down) + attention)
    # the dequantised transient is one expert's or one linear's weight, never the [E, out, in] stack:
    # q_proj 2048 -> 4096 (8.4M) is larger than one expert's gate_up (3.1M)
    assert quant.largest_linear == 2048 * 4096
    assert dequant_bytes(QWEN3_30B, setup) == 2 * 2048 * 4096 + 12 * 2048 * 4096 / 64 + NF4_CHUNK_BYTES
    skipped = Setup(lora_r=16, quantization="nf4", quantization_skip_modules=("lm_head", "experts"))
    assert quantized_base(QWEN3_30B, skipped).expert_weights == 0
    assert skipped_expert_weights(["experts.down_proj"]) == ("down_proj",)
    assert skipped_expert_weights(["lm_head", "mlp.gate"]) == ()


@pytest.mark.parametrize("key", ["fsdp_full", "zero3"])
def test_sharded_expert_states_divide_by_the_ranks(key: str) -> None:
    strategy = STRATEGY_BY_KEY[key]
    settings: dict[str, Any] = {"lora_r": 16, "quantization": "nf4", "lora_target_parameters": ALL}
    one, eight = (Setup(gpus_per_node=n, zero3_param_persistence_threshold=0, **settings) for n in (1, 8))
    assert model_states(QWEN3_235B, strategy, eight).total == pytest.approx(
        model_states(QWEN3_235B, strategy, one).params / 8
        + model_states(QWEN3_235B, strategy, one).optimizer_state / 8
        + model_states(QWEN3_235B, strategy, eight).grads,
    )


def test_expert_adapter_flops_and_activations_follow_the_routed_experts() -> None:
    plain, experts = Setup(lora_r=16), Setup(lora_r=16, lora_target_parameters=ALL)
    trainable, frozen, _ = matmul_params(QWEN3_30B, experts)
    base_trainable, base_frozen, _ = matmul_params(QWEN3_30B, plain)
    # a token runs the adapters of its 8 routed experts: 8/128 of them
    assert trainable - base_trainable == 629_145_600 * 8 // 128 and frozen == base_frozen
    # each routed expert saves x A_e^T (r = 16 values, bf16) for each of the two adapted weights
    extra = activation_bytes_per_layer(QWEN3_30B, experts, 1) - activation_bytes_per_layer(QWEN3_30B, plain, 1)
    assert extra == 8 * 2 * 16 * 2 * 2048


def _verdicts(model: str, gpus: int, memory: str, **extra: Any) -> dict[str, Any]:
    report = plan(
        model, gpus_per_node=gpus, gpu_memory=memory, lora_r=16, quantization="nf4", activation_checkpointing=True,
        lora_target_parameters=["all-experts"], **extra,
    )  # fmt: skip
    return {e.strategy.key: e for e in report.estimates if e.modelled} | {"best": report.recommendation}


def test_the_documented_verdicts() -> None:
    """docs/planner.md, "Mixture-of-experts LoRA and QLoRA"."""
    one = _verdicts("qwen3-30b-a3b", 1, "24GB")
    assert one["best"] is None  # 0.64B adapters (10 GB of fp32 states) beside the 16.9 GiB 4-bit base
    assert 26 * 2**30 < one["ddp"].gpu_total < 29 * 2**30
    attention_only = plan("qwen3-30b-a3b", gpus_per_node=1, gpu_memory="24GB", lora_r=16, quantization="nf4",
                          activation_checkpointing=True)  # fmt: skip
    assert attention_only.recommendation is not None and attention_only.recommendation.strategy.key == "ddp"
    two = _verdicts("qwen3-30b-a3b", 2, "24GB")
    assert two["best"].strategy.key == "fsdp_full" and two["zero3"].fits and not two["ddp"].fits
    big = _verdicts("qwen3-235b-a22b", 8, "80GB")
    assert big["best"].strategy.key == "fsdp_full" and big["zero3"].fits
    assert not any(big[k].fits for k in ("ddp", "zero1", "zero2", "fsdp_grad_op"))
    assert big["fsdp_full"].gpu_total < 30 * 2**30


def test_the_flag_takes_names_commas_and_the_shorthand(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "qwen3-30b-a3b", "--lora_r", "8"]

    def planned(*flags: str) -> tuple[str, ...]:
        args = plan_arguments([*base, "--lora_target_parameters", *flags])
        args.pop("json")
        return plan(**args).setup.lora_target_parameters

    assert planned("all-experts") == ("all-experts",)
    assert planned("experts.gate_up_proj,experts.down_proj") == tuple(PEFT_NAMES)
    main(["plan", *base, "--lora_target_parameters", *PEFT_NAMES, "--lora_targets", "none", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["lora_target_parameters"] == PEFT_NAMES
    assert report["parameters"]["trainable"] == expert_adapter_params(QWEN3_30B, 8, ALL)


def test_bad_values_are_one_error_listing_each() -> None:
    with pytest.raises(GymUserError) as error:
        plan("llama-3-8b", lora_r=0, lora_target_parameters=["experts.up_proj", "all-experts"])
    message = str(error.value)
    assert "\n" not in message and message.count("Invalid planner settings") == 1
    assert "'experts.up_proj' name no expert weight" in message and "experts.gate_up_proj" in message
    assert "set lora_r > 0" in message and "llama-3-8b is dense" in message
    with pytest.raises(GymUserError, match="nothing to train"):
        plan("qwen3-30b-a3b", lora_r=8, lora_targets="none")
    with pytest.raises(GymUserError, match="must be a list of names"):
        plan("qwen3-30b-a3b", lora_r=8, lora_target_parameters=[5])  # type: ignore[list-item]
    # One name alone is a list of it, as in a run's YAML.
    assert plan("qwen3-30b-a3b", lora_r=8, lora_target_parameters="all-experts").setup.lora_target_parameters == (
        "all-experts",
    )


def _yaml(tmp_path: Path, lora: Any, quantization: Any = None) -> str:
    model: dict[str, Any] = {"model": "Qwen/Qwen3-30B-A3B", "lora": lora}
    if quantization is not None:
        model["quantization"] = quantization
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": model, "trainer": {"devices": 2, "precision": "bf16-mixed"}}))
    return str(path)


def test_the_yaml_s_target_parameters_and_skip_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _yaml(tmp_path, {"r": 16, "target_parameters": ["all-experts"]}, {"skip_modules": ["lm_head", "experts"]})
    args = plan_arguments(["--config", path])
    assert (args["lora_target_parameters"], args["lora_targets"]) == (["all-experts"], "none")
    assert args["quantization"] == "nf4" and args["quantization_skip_modules"] == ["lm_head", "experts"]
    report = plan(**{k: v for k, v in args.items() if k not in ("json", "auto")})
    assert (
        report.setup.skip_expert_weights == EXPERT_WEIGHTS
        and quantized_base(QWEN3_30B, report.setup).expert_weights == 0
    )
    path = _yaml(tmp_path, {"r": 16, "target_modules": ["all-linear"], "target_parameters": "experts.down_proj"}, "nf4")
    args = plan_arguments(["--config", path])
    assert (args["lora_target_parameters"], args["lora_targets"]) == (["experts.down_proj"], "all-linear")
    with pytest.raises(GymUserError, match=r"model.lora.target_parameters must be a list .* got 5"):
        plan_arguments(["--config", _yaml(tmp_path, {"r": 16, "target_parameters": 5})])
    capsys.readouterr()
