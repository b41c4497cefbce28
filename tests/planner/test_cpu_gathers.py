"""Planner: what a gathered unit holds on CPU ranks, measured by ``benchmarks/qlora_peak.py --sizes moe-400m``
(docs/benchmarks.md, "QLoRA on MoE experts"): gym_fsdp's root unit holds an untied LM head beside the embedding,
and gloo receives every ZeRO-3 all-gather into a temporary of the whole gathered size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner import BUNDLED, Setup
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, buffer_bytes, layer_bytes, unit_bytes
from gym_lightning.planner.families.fsdp import fsdp_units

QLORA = Setup(lora_r=16, quantization="nf4", lora_target_parameters=("all-experts",), accelerator="cpu")


def fsdp_root_params(shape: ModelShape) -> int:
    """The root unit's elements in gym_fsdp's "root" layout: the embedding and, untied, the LM head."""
    root = fsdp_units(shape, Setup(), 2, layout="root")[0]
    assert root.name == "root" and root.kept
    return root.elements


def test_fsdp_root_unit_holds_an_untied_lm_head_beside_the_embedding() -> None:
    untied = BUNDLED["qwen3-30b-a3b"]
    assert not untied.tied_embeddings
    tied = replace(untied, tied_embeddings=True)
    assert fsdp_root_params(untied) == 2 * fsdp_root_params(tied) == 2 * untied.embedding_params()
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    # Under QLoRA the bf16 root outweighs a 4-bit decoder layer: the two gathered units are the root, 2 x 2 bytes
    # per parameter more for the LM head.
    assert unit_bytes(untied, QLORA, 2) < 2 * fsdp_root_params(untied)
    extra = buffer_bytes(untied, fsdp, QLORA) - buffer_bytes(tied, fsdp, QLORA)
    assert extra == pytest.approx(2 * 2 * untied.embedding_params())


def test_gloo_all_gathers_add_a_copy_on_cpu_ranks_only() -> None:
    shape, zero3 = BUNDLED["qwen3-30b-a3b"], STRATEGY_BY_KEY["zero3"]
    gpu = replace(QLORA, accelerator="gpu")
    extra = buffer_bytes(shape, zero3, QLORA) - buffer_bytes(shape, zero3, gpu)
    assert extra == pytest.approx(2 * unit_bytes(shape, gpu, 2))
    # FSDP2 on GPUs: the root (kept gathered from forward to backward) beside the layer in use and the prefetched
    # one. On CPU ranks gloo's copy makes the root's all-gather the peak: its output and gloo's copy beside the
    # previous forward's last all-gather output (one decoder layer) FSDP2 keeps.
    fsdp = STRATEGY_BY_KEY["fsdp_full"]
    root, layer = 2 * fsdp_root_params(shape), layer_bytes(shape, gpu, 2)
    extra = buffer_bytes(shape, fsdp, QLORA) - buffer_bytes(shape, fsdp, gpu)
    assert extra == pytest.approx(root - layer)
    assert root + 2 * layer <= buffer_bytes(shape, fsdp, gpu) < root + 3 * layer  # + one unit's fp32 adapter grads
    assert buffer_bytes(shape, STRATEGY_BY_KEY["fsdp_grad_op"], QLORA) == buffer_bytes(
        shape, STRATEGY_BY_KEY["fsdp_grad_op"], gpu
    )  # grad_op keeps every unit gathered: nothing is re-gathered in flight
