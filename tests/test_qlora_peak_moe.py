"""benchmarks/qlora_peak.py on a mixture of experts (issue 49): the MoE sizes adapt the experts, the theory's base
counts the NF4 expert weights at their real sizes, the planner is given the expert adapters, and the MoE runs get
their own section (the dense section is left as it is)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def qlora_peak() -> ModuleType:
    from benchmarks import qlora_peak

    return qlora_peak


def test_moe_sizes_adapt_the_experts(qlora_peak: ModuleType) -> None:
    assert qlora_peak.lora_settings("moe-400m")["target_parameters"] == ["all-experts"]
    assert "target_parameters" not in qlora_peak.lora_settings("250m")
    assert qlora_peak.lora_settings("moe-400m")["target_modules"] == ["all-linear"]


def test_base_counts_the_nf4_experts_and_their_adapters(qlora_peak: ModuleType, tmp_path: Path) -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(config.to_json_string())
    base = qlora_peak.base_bytes(tmp_path, qlora_peak.lora_settings("moe-400m"))
    experts = 2 * 4 * 3 * 64 * 128  # layers x experts x (gate, up, down) x I x h
    attention = 2 * (128 * 128 * 2 + 128 * 64 * 2)  # q, o (128 -> 128) and k, v (128 -> 64) per layer
    # NF4: half a byte per weight plus the block scales and row statistics; nothing of the experts left in bf16.
    assert 0.5 * (experts + attention) < base.nf4 < 0.6 * (experts + attention)
    assert base.sixteen_bit < 2 * (2 * 256 * 128 + 2 * 4 * 128 + 10 * 128 * 2)  # embeddings, routers, norms
    expert_adapters = 2 * 16 * 4 * ((128 + 128) + (64 + 128))  # layers x r x E x (gate_up: h + 2I, down: I + h)
    assert base.adapters > 4 * expert_adapters


def test_moe_runs_get_their_own_section(qlora_peak: ModuleType, tmp_path: Path) -> None:
    results = {"moe-400m/zero3/qlora": {"failed": 1, "seconds": 3.0}}
    assert qlora_peak.render(results, tmp_path, 2, 4, moe=False) is None  # the dense section is not rewritten
    section = qlora_peak.render(results, tmp_path, 2, 4, moe=True)
    assert section.startswith(qlora_peak.SECTION_MOE) and "| moe-400m | zero3 | — | failed (exit 1) |" in section
    assert '"target_parameters": ["all-experts"]' in section
