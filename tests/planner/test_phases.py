"""Planner: peak per rank in each phase (load, step, save, export), by hand for a small Llama shape.

The figures are checked against measured peaks of real 250M / 1B runs by ``benchmarks/scale.py`` (docs/benchmarks.md);
here the formulas themselves: what each phase holds, what the code's choices (fp32 masters, chunked loss, fused
AdamW, sharded loading, layer-sized ZeRO buckets, streaming export) add or remove, and where bytes are placed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_lightning.loss import CHUNKED_LOSS_MIN_VOCAB as MODULE_THRESHOLD
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner import BUNDLED, Setup, plan
from gym_lightning.planner.estimate import (
    CHUNKED_LOSS_MIN_VOCAB,
    STRATEGY_BY_KEY,
    activation_bytes,
    logits_bytes,
    zero_bucket_elements,
)
from gym_lightning.planner.phases import PHASES, phase_peaks

# 2 layers of h=64 (MHA, 4 heads), I=128, vocabulary 1000, tied: per layer 4*64*64 + 3*64*128 + 2*64 = 41_088;
# embedding 64_000; final norm 64 -> Ψ = 146_240.
SHAPE = ModelShape("small", 64, 128, 2, 4, 4, 16, 1000, True)
PSI, LAYER, EMBED = 146_240, 41_088, 64_000
MiB = 2**20
CPU = Setup(gpus_per_node=2, accelerator="cpu", host_process_overhead=500 * MiB, seq_length=128,
            checkpoint_file_bytes=10 * MiB)  # fmt: skip


def test_shape_counts_by_hand() -> None:
    assert SHAPE.num_params() == PSI and SHAPE.layer_params() == LAYER and SHAPE.embedding_params() == EMBED


def test_fsdp_phases_by_hand_on_cpu_ranks() -> None:
    peaks = phase_peaks(SHAPE, STRATEGY_BY_KEY["fsdp_full"], CPU)
    base = 500 * MiB
    # load: the rank's fp32 shard (4Ψ/2; fp32 masters whatever the checkpoint dtype) + its half of the rows of the
    # largest checkpoint tensor (the embedding) in the checkpoint dtype, read one tensor at a time
    assert peaks.load.host == pytest.approx(base + 4 * PSI / 2 + CPU.checkpoint_dtype_bytes * EMBED / 2)
    # step: 16Ψ/2 states + activations + logits (vocabulary 1000 < 65,536: not chunked) + two gathered bf16 units
    # (the embedding is the largest) + one unit's fp32 gradient; nothing for fused AdamW; on CPU ranks one bf16
    # layer more (gloo's copy makes the all-gather the peak, beside FSDP2's last forward all-gather output)
    extra = activation_bytes(SHAPE, CPU, 1) + logits_bytes(SHAPE, CPU, 1) + 2 * 2 * EMBED + 4 * EMBED + 2 * LAYER
    assert peaks.step.host == pytest.approx(base + 16 * PSI / 2 + extra)
    # save: the states, written from where they are; export: + the largest tensor in fp32 and in bf16
    assert peaks.save.host == pytest.approx(base + 16 * PSI / 2)
    assert peaks.export.host == pytest.approx(base + 16 * PSI / 2 + EMBED * (4 + 2))
    assert all(p.device == 0 for p in peaks.by_phase().values())  # CPU ranks: all of it is host memory


def test_gpu_ranks_place_tensors_on_the_device() -> None:
    gpu = Setup(gpus_per_node=2, host_process_overhead=3 * 2**30, seq_length=128, checkpoint_file_bytes=10 * MiB)
    peaks = phase_peaks(SHAPE, STRATEGY_BY_KEY["fsdp_full"], gpu)
    cpu = phase_peaks(SHAPE, STRATEGY_BY_KEY["fsdp_full"], Setup(**{**gpu.__dict__, "accelerator": "cpu"}))
    # the same tensors but the gathered units: on CPU ranks the root's all-gather and gloo's copy of it beside one
    # bf16 layer; on GPUs the root (the tied embedding) kept gathered beside the layer in use and the prefetched one
    on_cpu, on_gpu = 2 * 2 * EMBED + 2 * LAYER, max(2 * EMBED + 2 * 2 * LAYER, 2 * 2 * EMBED)
    assert peaks.step.host == 3 * 2**30
    assert peaks.step.device == pytest.approx(cpu.step.host - 3 * 2**30 - on_cpu + on_gpu)
    # the rows of the largest tensor (the embedding, bf16) pass through the host, half of them on each rank
    assert peaks.load.host == pytest.approx(3 * 2**30 + 2 * EMBED / 2)


def test_load_sharded_vs_whole() -> None:
    """gym_fsdp reads slices into its shards; DDP holds the whole fp32 model and the bf16 copy it was cast from;
    ZeRO-1/2 hold the whole bf16 model twice while DeepSpeed flattens it."""
    fsdp = phase_peaks(SHAPE, STRATEGY_BY_KEY["fsdp_full"], CPU).load.host - 500 * MiB
    ddp = phase_peaks(SHAPE, STRATEGY_BY_KEY["ddp"], CPU).load.host - 500 * MiB
    assert fsdp == pytest.approx(2 * PSI + 2 * EMBED / 2)  # its fp32 half + half of one bf16 tensor's rows
    assert ddp == pytest.approx(4 * PSI + 2 * PSI)
    fp32_folder = phase_peaks(SHAPE, STRATEGY_BY_KEY["ddp"], Setup(**{**CPU.__dict__, "checkpoint_dtype_bytes": 4}))
    assert fp32_folder.load.host - 500 * MiB == pytest.approx(8 * PSI)  # an fp32 folder: two fp32 copies at once
    fsdp_fp32 = phase_peaks(SHAPE, STRATEGY_BY_KEY["fsdp_full"], Setup(**{**CPU.__dict__, "checkpoint_dtype_bytes": 4}))
    # fp32 shards whatever the checkpoint's dtype; the rows in flight are read in the checkpoint's
    assert fsdp_fp32.load.host - 500 * MiB == pytest.approx(2 * PSI + 4 * EMBED / 2)
    # ZeRO-1/2: the bf16 model, its flat copy, the fp32 master partition and the bf16 clone it is cast from
    zero1 = phase_peaks(SHAPE, STRATEGY_BY_KEY["zero1"], CPU).load.host - 500 * MiB
    assert zero1 == pytest.approx((2 + 2 + 2 / 2 + 4 / 2) * PSI)


def test_zero_buckets_follow_the_layer_size() -> None:
    assert zero_bucket_elements(SHAPE, CPU) == LAYER  # ZeROStrategy's default: one decoder layer
    assert zero_bucket_elements(SHAPE, Setup(bucket_size=200_000_000)) == PSI  # capped at the model
    save = {k: phase_peaks(SHAPE, STRATEGY_BY_KEY[k], CPU).save.host - 500 * MiB for k in ("zero1", "zero2", "zero3")}
    # ZeRO-1/2 after the step: 2Ψ bf16 params + 12Ψ/2 master+Adam (their gradients are freed), one bf16 bucket
    # (ZeRO-2: two, overlap_comm)
    assert save["zero1"] == pytest.approx(2 * PSI + 12 * PSI / 2 + 2 * LAYER)
    assert save["zero2"] == pytest.approx(2 * PSI + 12 * PSI / 2 + 2 * 2 * LAYER)
    # ZeRO-3: 16-bit params and grads, masters and Adam sharded (16Ψ/2), the fp32 gradient copy of one optimizer
    # sub-group (one layer), tensors of at most 10 x hidden elements whole (ZeROStrategy's rule: the 2 x 2 layer
    # norms and the final norm, 5 x 64), one bucket
    assert save["zero3"] == pytest.approx(16 * PSI / 2 + 4 * LAYER + 2 * 5 * 64 + 2 * LAYER)
    # DeepSpeed's own threshold (1e5: every tensor of this toy) keeps them all whole, the setting of a user's JSON
    deepspeed_default = replace(CPU, zero3_param_persistence_threshold=100_000)
    zero3 = phase_peaks(SHAPE, STRATEGY_BY_KEY["zero3"], deepspeed_default).save.host - 500 * MiB
    assert zero3 == pytest.approx(16 * PSI / 2 + 4 * LAYER + 2 * PSI + 2 * LAYER)


def test_chunked_loss_bounds_the_logits() -> None:
    llama3 = BUNDLED["llama-3-8b"]  # vocabulary 128,256 >= 65,536: chunked by default, as the module does
    assert CHUNKED_LOSS_MIN_VOCAB == MODULE_THRESHOLD
    setup = Setup(seq_length=8192)
    assert logits_bytes(llama3, setup, 1) == 1024 * 128_256 * (2 + 8)
    assert logits_bytes(llama3, Setup(seq_length=8192, loss_chunking="off"), 1) == 8192 * 128_256 * (2 + 8)
    assert logits_bytes(llama3, Setup(seq_length=512), 1) == 512 * 128_256 * 10  # fewer positions than a chunk
    assert logits_bytes(SHAPE, Setup(seq_length=8192, loss_chunking="on", loss_chunk_tokens=256), 1) == 256 * 1000 * 10
    on = phase_peaks(llama3, STRATEGY_BY_KEY["fsdp_full"], setup).step.device
    off = phase_peaks(llama3, STRATEGY_BY_KEY["fsdp_full"], Setup(seq_length=8192, loss_chunking="off")).step.device
    assert off - on == pytest.approx((8192 - 1024) * 128_256 * 10)
    assert activation_bytes(llama3, setup, 1) > 0


def test_report_shows_every_phase(tmp_path: object) -> None:
    report = plan(SHAPE, gpus_per_node=2, accelerator="cpu", seq_length=128, checkpoint_file_size="10MB")
    table = report.table()
    assert "Peak per phase, GiB, host RAM per rank (CPU ranks):" in table
    assert all(phase in table for phase in PHASES)
    strategies = report.to_dict()["strategies"]
    fsdp = next(s for s in strategies if s["key"] == "fsdp_full")
    expected = phase_peaks(SHAPE, STRATEGY_BY_KEY["fsdp_full"], report.setup)
    assert fsdp["phases"]["load"]["host"] == round(expected.load.host)
