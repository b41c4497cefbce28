"""Planner: what a gathered unit holds on CPU ranks, measured by ``benchmarks/qlora_peak.py --sizes moe-400m``
(docs/benchmarks.md, "QLoRA on MoE experts") and ``benchmarks/scale.py --sizes 246m-untied`` ("gym_fsdp's
vocabulary units"): gym_fsdp gathers one vocabulary matrix at a time and keeps an untied LM head gathered through
backward, and gloo receives every all-gather into a temporary of the whole gathered size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_lightning.planner import BUNDLED, Setup
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, buffer_bytes, layer_bytes, unit_bytes
from gym_lightning.planner.families.fsdp import LAYOUT, fsdp_units

QLORA = Setup(lora_r=16, quantization="nf4", lora_target_parameters=("all-experts",), accelerator="cpu")


def test_fsdp_gathers_one_vocabulary_matrix_at_a_time_and_keeps_an_untied_head() -> None:
    assert LAYOUT == "split"  # strategies.fsdp: vocabulary units of their own (issue 55)
    untied = BUNDLED["qwen3-30b-a3b"]
    assert not untied.tied_embeddings
    tied = replace(untied, tied_embeddings=True)
    names = [u.name for u in fsdp_units(untied, Setup(), 2) if u.name != "layer"]
    assert names == ["embedding", "norm+head"] and next(u.name for u in fsdp_units(tied, Setup(), 2)) == "root"
    kept = [u for u in fsdp_units(untied, Setup(), 2) if u.kept]
    assert [u.name for u in kept] == ["norm+head"]  # the head stays gathered through backward; the embedding not
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    # Under QLoRA the bf16 embedding outweighs a 4-bit decoder layer: the largest unit; untied, the head (2 bytes per
    # parameter) stays gathered beside the embedding's second all-gather.
    assert unit_bytes(untied, QLORA, 2) == 2 * untied.embedding_params()
    extra = buffer_bytes(untied, fsdp, QLORA) - buffer_bytes(tied, fsdp, QLORA)
    assert extra == pytest.approx(2 * untied.embedding_params(), rel=1e-4)


def test_gloo_all_gathers_add_a_copy_on_cpu_ranks_only() -> None:
    shape, zero3 = BUNDLED["qwen3-30b-a3b"], STRATEGY_BY_KEY["zero3"]
    gpu = replace(QLORA, accelerator="gpu")
    extra = buffer_bytes(shape, zero3, QLORA) - buffer_bytes(shape, zero3, gpu)
    assert extra == pytest.approx(2 * unit_bytes(shape, gpu, 2))
    # FSDP2 on GPUs: the untied head (kept gathered through backward) beside the embedding gathered again for its
    # backward. On CPU ranks gloo's copy makes the embedding's all-gather the peak: its output and gloo's copy beside
    # the kept head and the previous forward's last all-gather output (one decoder layer) FSDP2 keeps.
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    vocab, layer = 2 * shape.embedding_params(), layer_bytes(shape, gpu, 2)
    on_gpu = max(vocab + 2 * layer, 2 * vocab)  # the head beside two layers, or beside the embedding's re-gathering
    extra = buffer_bytes(shape, fsdp, QLORA) - buffer_bytes(shape, fsdp, gpu)
    assert extra == pytest.approx(3 * vocab + layer - on_gpu, rel=1e-4)
    assert on_gpu <= buffer_bytes(shape, fsdp, gpu) < on_gpu + layer  # + one unit's fp32 adapter grads
    assert buffer_bytes(shape, STRATEGY_BY_KEY["fsdp_grad_op"], QLORA) == buffer_bytes(
        shape, STRATEGY_BY_KEY["fsdp_grad_op"], gpu
    )  # grad_op keeps every unit gathered: nothing is re-gathered in flight
