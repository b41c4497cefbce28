"""The step-time model's terms, each against a hand computation (gym_lightning/planner/timing.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, Setup, param_counts, planner_strategy
from gym_lightning.planner.timing import (
    DDP_BUCKET_BYTES,
    Hardware,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    bus_bandwidth,
    calibrated_efficiency,
    flops_per_token,
    matmul_params,
    offload_seconds,
    optimizer_seconds,
    overlapped_seconds,
    powersgd_elements,
    sequence_parallel_seconds,
    speed,
    step_time,
    traffic,
)

GB = 1e9
# Round figures, so that every expected value below is computed by hand.
HW = Hardware(
    "test",
    peak_flops=1e15,
    compute_efficiency=0.5,
    memory_bandwidth=4e12,
    intra_bandwidth=400 * GB,
    inter_bandwidth=100 * GB,
    intra_latency=0.0,
    inter_latency=0.0,
    host_bandwidth=50 * GB,
    host_memory_bandwidth=200 * GB,
    nvme_bandwidth=10 * GB,
)
# A dense model small enough to count by hand: h 64, I 128, 2 layers, 4 heads of 16, 2 kv heads, vocab 1000, untied.
TINY = ModelShape("tiny", 64, 128, 2, 4, 2, 16, 1000, False)


def test_collectives_follow_nccl_tests_bus_bandwidth() -> None:
    # all-reduce of 8 GB on 8 ranks at 400 GB/s busbw: 2 x 7/8 x 8 / 400 = 35 ms
    assert all_reduce_seconds(8 * GB, 8, 400 * GB, 0.0) == pytest.approx(0.035)
    # all-gather / reduce-scatter of a full 8 GB tensor: 7/8 x 8 / 400 = 17.5 ms; all-to-all the same fraction
    assert all_gather_seconds(8 * GB, 8, 400 * GB, 0.0) == pytest.approx(0.0175)
    assert all_to_all_seconds(8 * GB, 8, 400 * GB, 1e-5) == pytest.approx(0.0175 + 1e-5)
    # one rank moves nothing, whatever the latency
    assert all_reduce_seconds(8 * GB, 1, 400 * GB, 1.0) == 0.0


def test_bus_bandwidth_across_nodes_is_the_fabrics_capped_by_the_node() -> None:
    hw = replace(HW, intra_latency=1e-5, inter_latency=2e-5)
    assert bus_bandwidth(hw, 1) == (400 * GB, 1e-5)
    assert bus_bandwidth(hw, 4) == (100 * GB, pytest.approx(2e-5 * 3))  # 1 + log2(4) latencies
    assert bus_bandwidth(replace(hw, inter_bandwidth=800 * GB), 2)[0] == 400 * GB
    with pytest.raises(ValueError, match="inter-node"):
        bus_bandwidth(replace(hw, inter_bandwidth=0.0), 2)


def test_overlap_hides_all_but_the_exposed_part() -> None:
    # 100 ms compute, 30 ms of collectives of which 5 ms have nothing to hide behind: 105 ms
    assert overlapped_seconds(0.1, 0.03, 0.005) == pytest.approx(0.105)
    # collectives longer than compute set the pace: 100 + 5 exposed + (160 - 5 - 100) beyond compute = 160 ms
    assert overlapped_seconds(0.1, 0.16, 0.005) == pytest.approx(0.16)
    # no overlap (gloo on CPU ranks): the sum
    assert overlapped_seconds(0.1, 0.03, 0.005, overlap=False) == pytest.approx(0.13)


def test_flops_per_token_by_hand() -> None:
    setup = Setup(seq_length=100)
    # Matmul parameters (untied: the input embedding's lookup is not a matmul, the LM head is): per layer
    # q 64x64 + k,v 64x32 each + o 64x64 + 3 x 64x128 + 2 norms of 64 = 4096 + 4096 + 4096 + 24576 + 128 = 36,992;
    # 2 layers 73,984 + final norm 64 + LM head 64,000 = 138,048.
    trainable, frozen, decoder = matmul_params(TINY, setup)
    assert (trainable, frozen, decoder) == (138_048, 0, 73_984)
    flops = flops_per_token(TINY, setup)
    attention = 4 * 2 * 64 * 100  # 4 L H Q T forward
    assert flops.forward == 2 * 138_048 + attention
    assert flops.backward == 4 * 138_048 + 2 * attention
    assert flops.model == 6 * 138_048 + 12 * 2 * 64 * 100  # PaLM's 6N + 12LHQT
    assert flops.recompute == 0
    assert flops_per_token(TINY, replace(setup, activation_checkpointing=True)).recompute == 2 * 73_984 + attention


def test_lora_weights_cost_4n_and_adapters_6n() -> None:
    setup = Setup(seq_length=1, lora_r=2, lora_targets="attention-qv")
    adapters = 2 * (2 * (64 + 64) + 2 * (64 + 32))  # 2 layers; q (64 -> 64) and v (64 -> 32): r (in + out) each
    trainable, frozen, _ = matmul_params(TINY, setup)
    assert trainable == adapters and frozen == 138_048
    flops = flops_per_token(TINY, setup)
    assert flops.model == 6 * adapters + 4 * 138_048 + 12 * 2 * 64


def test_moe_counts_k_of_e_experts() -> None:
    shape = resolve_shape("qwen3-30b-a3b")
    trainable, frozen, _ = matmul_params(shape, Setup(seq_length=1))
    # all active parameters but the (untied) input embedding: 3.35B active - 151,936 x 2048
    assert trainable == shape.active_params() - 151_936 * 2048 and frozen == 0


def test_calibration_inverts_the_step() -> None:
    # 1e14 FLOPs in 0.31 s of which 10 ms optimizer, on a 1e15 peak: 1e14 / (1e15 x 0.30) = 1/3
    assert calibrated_efficiency(1e14, 0.31, 1e15, 0.01) == pytest.approx(1 / 3)


def test_optimizer_step_is_memory_bound() -> None:
    # 1e9 fp32 AdamW elements, 28 B each, at 4 TB/s: 7 ms
    assert optimizer_seconds(1e9, 28, 4e12) == pytest.approx(0.007)
    setup = Setup(gpus_per_node=8, seq_length=100)
    trainable = param_counts(TINY, setup).trainable
    ddp = step_time(TINY, STRATEGY_BY_KEY["ddp"], setup, HW)
    zero2 = step_time(TINY, STRATEGY_BY_KEY["zero2"], setup, HW)
    assert ddp.optimizer == pytest.approx(trainable * 28 / 4e12)  # replicated: every element on every rank
    assert zero2.optimizer == pytest.approx(trainable / 8 * 36 / 4e12)  # its partition, + DeepSpeed's conversions


def test_ddp_all_reduces_fp32_gradients_once_per_step() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100, accumulate_grad_batches=4)
    trainable = param_counts(TINY, setup).trainable
    moved = traffic(TINY, STRATEGY_BY_KEY["ddp"], setup, HW)
    assert moved.last_backward == pytest.approx(2 * 7 / 8 * 4 * trainable / (400 * GB))
    assert moved.forward == moved.backward == 0.0
    assert 4 * trainable < DDP_BUCKET_BYTES  # the tiny model is one bucket: all of it exposed
    assert moved.last_backward_exposed == pytest.approx(moved.last_backward)
    half = traffic(TINY, STRATEGY_BY_KEY["ddp"], replace(setup, gradient_compression="bf16"), HW)
    assert half.last_backward == pytest.approx(moved.last_backward / 2)
    # one rank: gym_ddp runs no DDP, nothing moves
    assert traffic(TINY, STRATEGY_BY_KEY["ddp"], replace(setup, gpus_per_node=1), HW).last_backward == 0.0


def test_powersgd_sends_low_rank_factors() -> None:
    # rank 1: each matrix m x n sends m + n; vectors whole. Per layer q 64+64, k 64+32, v 64+32, o 64+64,
    # gate/up 64+128 twice, down 128+64 -> 128 + 96 + 96 + 128 + 576 = 1,024, norms 128; 2 layers 2,304;
    # embedding and LM head 1000 + 64 each = 2,128; final norm 64: 4,496.
    assert powersgd_elements(TINY, Setup(), 1) == 4_496


def test_fsdp_gathers_twice_and_reduce_scatters_every_micro_batch() -> None:
    setup = Setup(gpus_per_node=4, seq_length=100)
    n = param_counts(TINY, setup).total_with_adapters
    full = traffic(TINY, STRATEGY_BY_KEY["fsdp_full"], setup, HW)
    gather = 3 / 4 * 2 * n / (400 * GB)  # bf16 parameters
    scatter = 3 / 4 * 4 * n / (400 * GB)  # fp32 gradients
    assert full.forward == pytest.approx(gather)
    assert full.backward == pytest.approx(gather + scatter)
    grad_op = traffic(TINY, STRATEGY_BY_KEY["fsdp_grad_op"], setup, HW)
    assert grad_op.backward == pytest.approx(scatter)  # kept gathered from forward to backward


def test_hybrid_shards_within_the_node_and_all_reduces_across() -> None:
    setup = Setup(gpus_per_node=4, nodes=2, seq_length=100)
    n = param_counts(TINY, setup).total_with_adapters
    hybrid = planner_strategy("h", "FSDP hybrid", "fsdp", {"sharding": "hybrid"})
    moved = traffic(TINY, hybrid, setup, HW)
    within = 3 / 4 * (4 * n) / (400 * GB)  # reduce-scatter over the node's 4 ranks at NVLink speed
    across = 2 * 1 / 2 * (4 * n / 4) / (100 * GB)  # its quarter all-reduced over 2 nodes on the fabric
    assert moved.backward == pytest.approx(3 / 4 * 2 * n / (400 * GB) + within + across)


def test_zero_stages_move_their_bytes() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100)
    counts = param_counts(TINY, setup)
    t = counts.trainable
    z1 = traffic(TINY, STRATEGY_BY_KEY["zero1"], setup, HW)
    z2 = traffic(TINY, STRATEGY_BY_KEY["zero2"], setup, HW)
    z3 = traffic(TINY, STRATEGY_BY_KEY["zero3"], setup, HW)
    bf16 = 7 / 8 * 2 * t / (400 * GB)  # a 16-bit all-gather or reduce-scatter of every trainable element
    assert z1.after_step == pytest.approx(2 * bf16) and z1.backward == 0.0  # reduce after backward, gather after step
    assert z2.backward == pytest.approx(bf16) and z2.after_step == pytest.approx(bf16)
    gathered = 7 / 8 * 2 * (t - counts.persistent) / (400 * GB)  # persistent tensors are never gathered
    assert z3.forward == pytest.approx(gathered) and z3.backward == pytest.approx(gathered + bf16)
    assert z3.after_step == 0.0


def test_offload_moves_partitions_over_pcie_and_steps_on_the_host() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100)
    elements = param_counts(TINY, setup).trainable / 8
    seconds = offload_seconds(TINY, STRATEGY_BY_KEY["zero2_offload"], setup, HW)
    pcie = (2 * elements + 2 * elements) / (50 * GB)  # 16-bit gradients down, 16-bit parameters up
    host_step = 8 * elements * 36 / (200 * GB)  # the node's 8 ranks step at once on its DRAM
    assert seconds == pytest.approx(pcie + host_step)
    assert offload_seconds(TINY, STRATEGY_BY_KEY["zero2"], setup, HW) == 0.0
    assert step_time(TINY, STRATEGY_BY_KEY["zero2_offload"], setup, HW).optimizer == 0.0  # not on the device


def test_sequence_parallel_all_to_alls() -> None:
    setup = Setup(gpus_per_node=4, seq_length=400, sequence_parallel_size=4)
    per_layer = 100 * (2 * 64 + 2 * 32) * 2  # 100 local tokens: q and out (64 each), k and v (32 each), bf16
    expected = 2 * 2 * 3 / 4 * per_layer / (400 * GB)  # forward + backward, 2 layers
    assert sequence_parallel_seconds(TINY, setup, HW) == pytest.approx(expected)
    assert sequence_parallel_seconds(TINY, replace(setup, sequence_parallel_size=1), HW) == 0.0


def test_accumulation_hides_ddp_only_behind_the_last_backward() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100, accumulate_grad_batches=4)
    hw = replace(HW, intra_bandwidth=1 * GB)  # slow enough that the all-reduce outlasts one backward
    one = step_time(TINY, STRATEGY_BY_KEY["ddp"], setup, hw)
    moved = traffic(TINY, STRATEGY_BY_KEY["ddp"], setup, hw)
    assert one.communication == pytest.approx(moved.last_backward)  # once per optimizer step, not per micro-batch
    assert one.exposed_communication == pytest.approx(moved.last_backward)  # one bucket: nothing to hide behind
    assert one.compute == pytest.approx(4 * 100 * flops_per_token(TINY, setup).model / 5e14)


def test_speed_reports_tokens_mfu_and_scaling() -> None:
    setup = Setup(gpus_per_node=1, micro_batch_size=2, seq_length=100)
    result = speed(TINY, STRATEGY_BY_KEY["ddp"], setup, HW)
    assert result.tokens_per_step == 200
    assert result.tokens_per_second_per_gpu == pytest.approx(200 / result.step.total)
    assert result.mfu == pytest.approx(200 * flops_per_token(TINY, setup).model / result.step.total / 1e15)
    assert result.scaling == pytest.approx(1.0)
    assert result.hours(200 * 3600, 1) == pytest.approx(result.step.total)
    eight = speed(TINY, STRATEGY_BY_KEY["ddp"], replace(setup, gpus_per_node=8), replace(HW, intra_bandwidth=1 * GB))
    assert eight.scaling < 1.0  # its all-reduce shows


def test_gather_and_scatter_shares_slow_only_their_collectives() -> None:
    hw = replace(HW, gather_share=0.5, scatter_share=0.25)  # gloo: its all-gather and reduce-scatter run slower
    setup = Setup(gpus_per_node=4, seq_length=100)
    n = param_counts(TINY, setup).total_with_adapters
    moved = traffic(TINY, STRATEGY_BY_KEY["fsdp_full"], setup, hw)
    gather = 3 / 4 * 2 * n / (200 * GB)
    assert moved.forward == pytest.approx(gather)
    assert moved.backward == pytest.approx(gather + 3 / 4 * 4 * n / (100 * GB))
    ddp = traffic(TINY, STRATEGY_BY_KEY["ddp"], setup, hw)
    assert ddp.last_backward == pytest.approx(traffic(TINY, STRATEGY_BY_KEY["ddp"], setup, HW).last_backward)
