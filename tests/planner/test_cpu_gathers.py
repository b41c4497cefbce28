"""Planner: what a gathered unit holds on CPU ranks, measured by ``benchmarks/qlora_peak.py --sizes moe-400m``
(docs/benchmarks.md, "QLoRA on MoE experts") and ``benchmarks/scale.py --sizes 246m-untied`` ("gym_fsdp's
vocabulary units"): gym_fsdp gathers one vocabulary matrix at a time and keeps an untied LM head gathered through
backward, and gloo receives every all-gather into a temporary of the whole gathered size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_lightning.planner import BUNDLED, Setup
from gym_lightning.planner.estimate import (
    STRATEGY_BY_KEY,
    buffer_bytes,
    fsdp_kept_head_params,
    fsdp_root_params,
    layer_bytes,
    unit_bytes,
)

QLORA = Setup(lora_r=16, quantization="nf4", lora_target_parameters=("all-experts",), accelerator="cpu")


def test_fsdp_gathers_one_vocabulary_matrix_at_a_time_and_keeps_an_untied_head() -> None:
    untied = BUNDLED["qwen3-30b-a3b"]
    assert not untied.tied_embeddings
    tied = replace(untied, tied_embeddings=True)
    assert fsdp_root_params(untied) == fsdp_root_params(tied) == untied.embedding_params()
    assert fsdp_kept_head_params(untied) == untied.embedding_params() and fsdp_kept_head_params(tied) == 0
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    # Under QLoRA the bf16 embedding outweighs a 4-bit decoder layer: the largest unit; untied, the head (2 bytes per
    # parameter) stays gathered beside its all-gather.
    assert unit_bytes(untied, QLORA, 2) == 2 * fsdp_root_params(untied)
    extra = buffer_bytes(untied, fsdp, QLORA) - buffer_bytes(tied, fsdp, QLORA)
    assert extra == pytest.approx(2 * untied.embedding_params())


def test_gloo_all_gathers_add_a_copy_on_cpu_ranks_only() -> None:
    shape, zero3 = BUNDLED["qwen3-30b-a3b"], STRATEGY_BY_KEY["zero3"]
    gpu = replace(QLORA, accelerator="gpu")
    extra = buffer_bytes(shape, zero3, QLORA) - buffer_bytes(shape, zero3, gpu)
    assert extra == pytest.approx(2 * unit_bytes(shape, gpu, 2))
    # FSDP2 on GPUs: the untied head (kept gathered through backward) beside the layer in use and the prefetched
    # one. On CPU ranks gloo's copy makes the embedding's all-gather the peak: its output and gloo's copy beside
    # the kept head and the previous forward's last all-gather output (one decoder layer) FSDP2 keeps.
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    root, layer = 2 * fsdp_root_params(shape), layer_bytes(shape, gpu, 2)
    kept = 2 * fsdp_kept_head_params(shape)
    extra = buffer_bytes(shape, fsdp, QLORA) - buffer_bytes(shape, fsdp, gpu)
    assert extra == pytest.approx(kept + root - layer)
    assert root + 2 * layer <= buffer_bytes(shape, fsdp, gpu) < root + 3 * layer  # + one unit's fp32 adapter grads
    assert buffer_bytes(shape, STRATEGY_BY_KEY["fsdp_grad_op"], QLORA) == buffer_bytes(
        shape, STRATEGY_BY_KEY["fsdp_grad_op"], gpu
    )  # grad_op keeps every unit gathered: nothing is re-gathered in flight
