"""FLOPs-per-token formula against hand-computed counts (PaLM appendix B convention, see metrics/flops.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.tiny import TINY

from gym_lightning.metrics.flops import TransformerFlops, attention_shape, matmul_param_counts, transformer_flops

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
