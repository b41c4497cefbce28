"""FLOPs-per-token formula against hand-computed counts (PaLM appendix B convention, see metrics/flops.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.tiny import TINY

from gym_lightning.metrics.flops import (
    TransformerFlops,
    attention_shape,
    expert_patterns,
    expert_routing,
    is_routed_expert,
    matmul_param_counts,
    transformer_flops,
)

# Hand count for TINY: per layer q 32*32 + k 32*16 + v 32*16 + o 32*32 + mlp 3*32*64 + 2 norms*32 = 9280;
# 2 layers = 18560; final norm 32; lm_head 256*32 = 8192; embedding 8192 (excluded: a lookup, not a matmul).
TINY_TOTAL = 34976
TINY_MATMUL = 26784


def _tiny(**overrides: object) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))


def test_tiny_llama_counts_by_hand() -> None:
    model = _tiny()
    assert sum(p.numel() for p in model.parameters()) == TINY_TOTAL
    assert matmul_param_counts(model) == (TINY_MATMUL, 0)
    flops = transformer_flops(model, model.config)
    assert flops == TransformerFlops(TINY_MATMUL, 0, num_layers=2, attention_dim=32)
    # 6N + 12*L*H*Q*T at T=16: 6*26784 + 12*2*32*16
    assert flops.per_token(16) == 160704 + 12288 == 172992


def test_tied_embedding_still_counts_lm_head_matmul() -> None:
    model = _tiny(tie_word_embeddings=True)
    assert sum(p.numel() for p in model.parameters()) == TINY_TOTAL - 8192  # one shared matrix
    assert matmul_param_counts(model) == (TINY_MATMUL, 0)  # the lm_head matmul still runs


def test_llama2_7b_matches_published_size_and_palm_formula() -> None:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616  # "7B": 6.74e9 in the Llama 2 paper
    n = 6_738_415_616 - 32000 * 4096  # minus the input embedding
    flops = transformer_flops(model, config)
    assert flops.trainable_params == n
    assert flops.per_token(4096) == 6 * n + 12 * 32 * 4096 * 4096 == 46_086_512_640


def test_lora_frozen_params_cost_four_flops_trainable_six() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # per layer: q A 32x4 + B 4x32 = 256; v A 32x4 + B 4x16 = 192 -> 448; 2 layers = 896
    assert matmul_param_counts(model) == (896, TINY_MATMUL)
    flops = transformer_flops(model, model.config)
    assert flops.dense_per_token == 6 * 896 + 4 * TINY_MATMUL


def test_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=16
    )
    assert attention_shape(config) == (3, 64)


def test_padding_counts_only_real_tokens_per_sequence() -> None:
    flops = TransformerFlops(trainable_params=10, frozen_params=5, num_layers=2, attention_dim=8)
    lengths = [3, 7]  # two sequences padded to the same width
    expected = sum(n * flops.per_token(n) for n in lengths)
    assert flops.for_tokens(sum(lengths), sum(n * n for n in lengths)) == expected


def test_config_without_attention_shape_is_a_clear_error() -> None:
    class Config:
        hidden_size = 32

    with pytest.raises(ValueError, match="flops_per_token"):
        attention_shape(Config())


# ------------------------------------------------------------------------------------------- mixture of experts
def _tiny_qwen3_moe() -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_moe_routed_experts_count_k_over_e_by_hand() -> None:
    model = _tiny_qwen3_moe()
    # Hand count: q 16x16 + k 16x8 + v 16x8 + o 16x16 + q/k norms 2x8 + 2 layer norms 2x16 + router 4x16 = 880;
    # final norm 16; lm_head 32x16 = 512 -> 1408 always active. Experts: gate_up 4x16x16 + down 4x16x8 = 1536, of
    # which a token uses 2 of 4: 768. The input embedding (32x16) is a lookup, not counted.
    flops = transformer_flops(model, model.config)
    assert (flops.expert_params, flops.experts_per_token, flops.num_experts) == (1536, 2, 4)
    assert flops.trainable_params == 1408 + 768 and flops.frozen_params == 0
    assert matmul_param_counts(model) == (1408 + 1536, 0)  # without the routing: every expert whole


@pytest.mark.parametrize(
    ("shape", "total", "active"),
    [
        (dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, moe_intermediate_size=768), 30.5, 3.3),
        (dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, moe_intermediate_size=1536), 235, 22),
    ],
    ids=["Qwen3-30B-A3B", "Qwen3-235B-A22B"],
)
def test_qwen3_moe_active_parameters_match_the_model_cards(shape: dict[str, int], total: float, active: float) -> None:
    """The config.json shapes of the two models (128 experts, 8 per token, 4 KV heads of 128); the cards publish
    30.5B / 3.3B activated and 235B / 22B activated, embeddings included."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        tie_word_embeddings=False, **shape,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    flops = transformer_flops(model, config)
    embedding = config.vocab_size * config.hidden_size
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(total, rel=0.005)
    assert (flops.trainable_params + embedding) / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize(
    ("model_type", "routed", "whole"),
    [
        ("qwen2_moe", "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.shared_expert.up_proj.weight"),
        ("deepseek_v3", "model.layers.3.mlp.experts.down_proj", "model.layers.3.mlp.shared_experts.down_proj.weight"),
        ("gpt_oss", "base_model.model.model.layers.1.mlp.experts.down_proj_bias", "model.layers.1.mlp.router.weight"),
        ("mixtral", "model.layers.12.mlp.experts.gate_up_proj", "model.layers.12.mlp.gate.weight"),
    ],
)
def test_routed_experts_come_from_the_model_config_shared_experts_and_routers_count_whole(
    model_type: str, routed: str, whole: str
) -> None:
    config = transformers.AutoConfig.for_model(model_type)
    patterns = expert_patterns(config)
    assert is_routed_expert(routed, patterns) and not is_routed_expert(whole, patterns)
    assert expert_routing(config) is not None
    assert not expert_patterns(transformers.LlamaConfig()) and expert_routing(transformers.LlamaConfig()) is None


def test_moe_under_lora_frozen_base_counts_active_experts() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_qwen3_moe(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    flops = transformer_flops(model, model.config)
    # LoRA: q A 16x2 + B 2x16 = 64, v A 16x2 + B 2x8 = 48; the frozen base is the dense model's active count.
    assert (flops.trainable_params, flops.frozen_params) == (112, 1408 + 768)


def test_the_plans_router_rule_is_not_an_expert() -> None:
    # transformers 5.17 (the GPU image's) lists the router in the expert-parallel plan; 5.25 does not.
    plan = {
        "layers.*.mlp.gate": "ep_router",
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    patterns = expert_patterns(SimpleNamespace(base_model_ep_plan=plan))
    assert is_routed_expert("model.layers.3.mlp.experts.gate_up_proj", patterns)
    assert not is_routed_expert("model.layers.3.mlp.gate.weight", patterns)


def test_expert_adapters_count_k_over_e_and_are_trainable() -> None:
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], target_parameters=["experts.gate_up_proj",
                           "experts.down_proj"])  # fmt: skip
    model = peft.get_peft_model(_tiny_qwen3_moe(), lora)
    flops = transformer_flops(model, model.config)
    # expert adapters r E (in + out): gate_up 2*4*(16 + 16) = 256, down 2*4*(8 + 16) = 192 -> 448, a token runs
    # 2 of the 4 experts' adapters: 224; the attention adapters 112 (test above) count whole
    assert (flops.trainable_params, flops.frozen_params) == (112 + 224, 1408 + 768)


def _qwen3_moe_nf4() -> tuple[transformers.PreTrainedModel, transformers.PreTrainedModel]:
    """The same tiny Qwen3-MoE (h 64, I 64, 4 experts, 2 per token) in 16 bits and with its attention linears and
    both expert weights in NF4, as QLoRA builds it."""
    from gym_lightning.quant import experts as nf4_experts
    from gym_lightning.quant.config import QuantizationArgs
    from gym_lightning.quant.linear import NF4Linear, linears_built_as

    config = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    classes = nf4_experts.experts_classes(transformers.Qwen3MoeForCausalLM)

    def choose(fan_in: int, fan_out: int) -> type[NF4Linear] | None:
        # q_proj and o_proj (out 64) in NF4; k/v (out 32), the router (out 4) and the LM head (32 = vocab) 16-bit
        return NF4Linear if fan_out == 64 else None

    with nf4_experts.experts_built_as_nf4(classes, QuantizationArgs()), linears_built_as(choose):
        quantised = transformers.Qwen3MoeForCausalLM(config)
    return transformers.Qwen3MoeForCausalLM(config), quantised


def test_nf4_weights_count_as_the_16_bit_matmul() -> None:
    plain, quantised = _qwen3_moe_nf4()
    assert any(p.dtype == torch.uint8 for p in quantised.parameters())
    names = {n for n, p in quantised.named_parameters() if p.dtype == torch.uint8}
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"} <= names
    for p in quantised.parameters():
        p.requires_grad_(False)
    for p in plain.parameters():
        p.requires_grad_(False)
    assert transformer_flops(quantised, quantised.config) == transformer_flops(plain, plain.config)
    assert matmul_param_counts(quantised) == matmul_param_counts(plain)
