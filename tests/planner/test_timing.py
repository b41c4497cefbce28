"""The step-time model's terms, each against a hand computation (planner.comm, planner.compute, planner.timing and
the families' traffic)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.comm import (
    Group,
    Network,
    collective_seconds,
    contention_seconds,
    expected_maximum,
    overlapped_seconds,
    ring_latency,
    slowest_of,
    tree_latency,
)
from gym_lightning.planner.compute import (
    KERNEL_PASSES,
    Kernels,
    attention_flops,
    calibrated_efficiency,
    elementwise_bytes,
    expert_loop_seconds,
    flops_per_token,
    gemm_seconds,
    layer_gemms,
    matmul_params,
    micro_batch_compute,
)
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, Setup, param_counts, planner_strategy
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.families.replicated import DDP_BUCKET_BYTES, powersgd_elements
from gym_lightning.planner.hardware import Hardware, HostFigures
from gym_lightning.planner.timing import optimizer_seconds, sequence_parallel_seconds, speed, step_time

GB = 1e9
# Round figures, so that every expected value below is computed by hand: no latency, no size term, no losses.
NET = Network(intra_bandwidth=400 * GB, inter_bandwidth=100 * GB, intra_latency=0.0, inter_latency=0.0)
KERNELS = Kernels(peak_flops=1e15, memory_bandwidth=4e12, efficiency=0.5)
HW = Hardware("test", KERNELS, NET, HostFigures(50 * GB, 200 * GB, 10 * GB))
# A dense model small enough to count by hand: h 64, I 128, 2 layers, 4 heads of 16, 2 kv heads, vocab 1000, untied.
TINY = ModelShape("tiny", 64, 128, 2, 4, 2, 16, 1000, False)


def traffic(shape: ModelShape, key: str, setup: Setup, hw: Hardware = HW):  # type: ignore[no-untyped-def]
    return cost_model(STRATEGY_BY_KEY[key], shape, setup).traffic(hw)


# ---------------------------------------------------------------------------------------------- collectives
def test_collectives_follow_nccl_tests_bus_bandwidth() -> None:
    node = Group(8, 1, NET)
    # all-reduce of 8 GB on 8 ranks at 400 GB/s busbw: 2 x 7/8 x 8 / 400 = 35 ms
    assert node.all_reduce(8 * GB) == pytest.approx(0.035)
    # all-gather / reduce-scatter of a full 8 GB tensor: 7/8 x 8 / 400 = 17.5 ms; all-to-all the same fraction
    assert node.all_gather(8 * GB) == pytest.approx(0.0175) == node.reduce_scatter(8 * GB)
    assert Group(8, 1, replace(NET, intra_latency=1e-5)).all_to_all(8 * GB) == pytest.approx(0.0175 + 1e-5)
    # one rank moves nothing, whatever the latency
    assert Group(1, 1, replace(NET, intra_latency=1.0)).all_reduce(8 * GB) == 0.0
    assert collective_seconds(8 * GB, 0.0, 400 * GB, 1.0) == 0.0


def test_latency_grows_with_the_ring_and_the_tree() -> None:
    net = replace(NET, intra_latency=30e-6, inter_latency=50e-6, intra_hop=2e-6, inter_hop=10e-6)
    assert ring_latency(8, 1, net) == pytest.approx(30e-6 + 7 * 2e-6)
    # 64 nodes of 8: 448 steps inside nodes, 64 across them
    assert ring_latency(512, 64, net) == pytest.approx(50e-6 + 448 * 2e-6 + 64 * 10e-6)
    assert tree_latency(8, 1, net) == pytest.approx(30e-6 + 14 * 2e-6)
    # all-reduce: a ring of 2(8 - 1) steps in the node, 2 log2(64) = 12 steps across
    assert tree_latency(512, 64, net) == pytest.approx(50e-6 + 14 * 2e-6 + 12 * 10e-6)
    assert ring_latency(1, 1, net) == tree_latency(1, 1, net) == 0.0


def test_bus_bandwidth_falls_as_the_per_rank_message_shrinks() -> None:
    net = replace(NET, inter_latency=50e-6, intra_hop=2e-6, inter_hop=10e-6)

    def busbw(nbytes: float, ranks: int) -> float:
        group = Group(ranks, ranks // 8, net)
        return (ranks - 1) / ranks * nbytes / group.all_gather(nbytes)

    # 128 MB over 16 ranks (8 MB each): 1.2 ms on the 100 GB/s fabric beside 98 us of latency (50 + 14 x 2 + 2 x 10);
    # over 512 ranks (0.25 MB each) beside 1.6 ms (50 + 448 x 2 + 64 x 10): under half the fabric's bandwidth
    assert busbw(128e6, 16) > 0.92 * 100 * GB
    assert busbw(128e6, 512) < 0.5 * 100 * GB
    assert busbw(128e6, 512) < busbw(128e6, 128) < busbw(128e6, 16)


def test_across_nodes_the_fabric_caps_the_ring() -> None:
    assert Group(16, 2, NET).bandwidth == 100 * GB and Group(8, 1, NET).bandwidth == 400 * GB
    assert Group(16, 2, replace(NET, inter_bandwidth=800 * GB)).bandwidth == 400 * GB
    with pytest.raises(ValueError, match="inter-node"):
        _ = Group(16, 2, replace(NET, inter_bandwidth=0.0)).bandwidth


def test_overlap_hides_all_but_the_exposed_part_and_contends() -> None:
    # 100 ms compute, 30 ms of collectives of which 5 ms have nothing to hide behind: 105 ms
    assert overlapped_seconds(0.1, 0.03, 0.005) == pytest.approx(0.105)
    # collectives longer than compute set the pace: 100 + 5 exposed + (160 - 5 - 100) beyond compute = 160 ms
    assert overlapped_seconds(0.1, 0.16, 0.005) == pytest.approx(0.16)
    assert overlapped_seconds(0.1, 0.03, 0.005, overlap=False) == pytest.approx(0.13)  # gloo: the sum
    # the 25 ms hidden behind compute slow it by 12 % of themselves; at most the compute's length is hidden
    assert contention_seconds(0.1, 0.03, 0.005, 0.12) == pytest.approx(0.12 * 0.025)
    assert contention_seconds(0.1, 0.5, 0.005, 0.12) == pytest.approx(0.12 * 0.1)


def test_the_slowest_rank() -> None:
    # Blom's approximation of the expected maximum of n standard normals: Φ⁻¹((n - 0.375)/(n + 0.25))
    assert expected_maximum(1) == 0.0
    assert expected_maximum(2) == pytest.approx(0.5895, abs=1e-3)  # exact: 1/√π = 0.5642
    assert expected_maximum(8) == pytest.approx(1.4342, abs=1e-3)  # exact: 1.4236
    assert expected_maximum(512) == pytest.approx(3.0307, abs=1e-3)
    assert slowest_of(2.0, 8, 0.01) == pytest.approx(2.0 * 0.01 * expected_maximum(8))


# ---------------------------------------------------------------------------------------------- compute
def test_flops_per_token_by_hand() -> None:
    setup = Setup(seq_length=100)
    # Matmul parameters (untied: the input embedding's lookup is not a matmul, the LM head is): per layer
    # q 64x64 + k,v 64x32 each + o 64x64 + 3 x 64x128 + 2 norms of 64 = 36,992; 2 layers 73,984 + final norm 64 +
    # LM head 64,000 = 138,048.
    assert matmul_params(TINY, setup) == (138_048, 0, 73_984)
    flops = flops_per_token(TINY, setup)
    attention = 4 * 2 * 64 * 100  # 4 L H Q T forward
    assert attention_flops(TINY, setup) == attention
    assert flops.forward == 2 * 138_048 + attention and flops.backward == 4 * 138_048 + 2 * attention
    assert flops.model == 6 * 138_048 + 12 * 2 * 64 * 100  # PaLM's 6N + 12LHQT
    assert flops.recompute == 0
    assert flops_per_token(TINY, replace(setup, activation_checkpointing=True)).recompute == 2 * 73_984 + attention


def test_lora_weights_cost_4n_and_adapters_6n() -> None:
    setup = Setup(seq_length=1, lora_r=2, lora_targets="attention-qv")
    adapters = 2 * (2 * (64 + 64) + 2 * (64 + 32))  # 2 layers; q (64 -> 64) and v (64 -> 32): r (in + out) each
    trainable, frozen, _ = matmul_params(TINY, setup)
    assert trainable == adapters and frozen == 138_048
    assert flops_per_token(TINY, setup).model == 6 * adapters + 4 * 138_048 + 12 * 2 * 64


def test_moe_counts_k_of_e_experts() -> None:
    shape = resolve_shape("qwen3-30b-a3b")
    trainable, frozen, _ = matmul_params(shape, Setup(seq_length=1))
    assert trainable == shape.active_params() - 151_936 * 2048 and frozen == 0


def test_a_gemm_takes_its_flops_at_the_peak_share_plus_an_overhead() -> None:
    kernels = Kernels(peak_flops=1e15, memory_bandwidth=1e12, gemm_peak=0.8, gemm_overhead=5e-6)
    # 4096^3: 137.4 GFLOP at 800 TFLOP/s = 171.8 us, + 5 us
    assert gemm_seconds(4096, 4096, 4096, kernels) == pytest.approx(2 * 4096**3 / 0.8e15 + 5e-6)
    # small GEMMs reach less of the peak: 256^3 runs at 5 % of the large one's rate
    rate = {n: 2 * n**3 / gemm_seconds(n, n, n, kernels) for n in (256, 4096)}
    assert rate[256] < 0.06 * rate[4096]
    assert gemm_seconds(0, 10, 10, kernels) == 0.0


def test_the_micro_batch_s_gemms() -> None:
    gemms = layer_gemms(TINY, Setup(), 100)
    # q, k, v, o, gate, up, down per layer (x 2 layers) and the LM head
    assert [(g.m, g.n, g.k, g.count) for g in gemms[:2]] == [(100, 64, 64, 2), (100, 32, 64, 2)]
    assert (gemms[-1].n, gemms[-1].k, gemms[-1].count) == (1000, 64, 1)
    assert sum(2 * g.m * g.n * g.k * g.count for g in gemms) == 2 * 100 * (138_048 - 2 * 2 * 64 - 64)  # no norms
    lora = layer_gemms(TINY, Setup(lora_r=4, lora_targets="attention-qv"), 100)
    assert [(g.n, g.k) for g in lora if g.trainable] == [(4, 64), (64, 4), (4, 64), (32, 4)]  # q and v, A then B
    moe = resolve_shape("qwen3-30b-a3b")
    experts = [g for g in layer_gemms(moe, Setup(), 4096) if g.count == 48 * 128]
    assert [(g.m, g.n, g.k) for g in experts] == [(256.0, 1536, 2048), (256.0, 2048, 768)]  # 4096 x 8 / 128 rows


def test_elementwise_bytes_by_hand() -> None:
    layer, head = elementwise_bytes(TINY, Setup())
    # 88h + a_b (7 (q + kv) + 2q + 5I) = 5632 + 2 x (7 x 96 + 128 + 640) = 8,512; the loss 3 (2 + 8) V
    assert (layer, head) == (88 * 64 + 2 * (7 * 96 + 2 * 64 + 5 * 128), 3 * 10 * 1000)
    compute = micro_batch_compute(TINY, Setup(micro_batch_size=1, seq_length=100), KERNELS)
    forward = 100 * (2 * layer + head) / 4e12
    assert compute.memory == pytest.approx(3 * forward / 0.5)  # forward + twice that backward, over the efficiency
    compiled = micro_batch_compute(TINY, Setup(micro_batch_size=1, seq_length=100, kernels="compiled"), KERNELS)
    assert compiled.memory == pytest.approx(compute.memory * KERNEL_PASSES["compiled"])


def test_the_expert_loop_waits_for_the_host() -> None:
    moe = resolve_shape("qwen3-30b-a3b")
    fast = Kernels(peak_flops=1e15, memory_bandwidth=1e12, launch=0.0)
    assert expert_loop_seconds(moe, Setup(), 4096, fast) == 0.0
    slow = replace(fast, launch=10e-6)
    # 128 experts hit, 9 kernels each in forward and 3x with backward, 48 layers, 10 us each
    host = 3 * 9 * 128 * 48 * 10e-6
    device = 3 * 48 * 128 * (2 * 256 * 1536 * 2048 + 2 * 256 * 2048 * 768) / 1e15
    assert expert_loop_seconds(moe, Setup(), 4096, slow) == pytest.approx(host - device)
    assert expert_loop_seconds(TINY, Setup(), 4096, slow) == 0.0  # dense: no loop


def test_calibration_inverts_the_step() -> None:
    # a step predicted at 0.16 s at efficiency 1, of which 10 ms optimizer, measured at 0.31 s: 0.15 / 0.30
    assert calibrated_efficiency(0.16, 0.31, 0.01) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------- families' bytes
def test_optimizer_step_is_memory_bound() -> None:
    assert optimizer_seconds(1e9, 28, 4e12) == pytest.approx(0.007)  # 1e9 fp32 AdamW elements, 28 B each
    setup = Setup(gpus_per_node=8, seq_length=100)
    trainable = param_counts(TINY, setup).trainable
    ddp = step_time(TINY, STRATEGY_BY_KEY["ddp"], setup, HW)
    zero2 = step_time(TINY, STRATEGY_BY_KEY["zero2"], setup, HW)
    assert ddp.optimizer == pytest.approx(trainable * 28 / 4e12)  # replicated: every element on every rank
    assert zero2.optimizer == pytest.approx(trainable / 8 * 36 / 4e12)  # its partition, + DeepSpeed's conversions


def test_ddp_all_reduces_fp32_gradients_once_per_step() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100, accumulate_grad_batches=4)
    trainable = param_counts(TINY, setup).trainable
    moved = traffic(TINY, "ddp", setup)
    assert moved.last_backward == pytest.approx(2 * 7 / 8 * 4 * trainable / (400 * GB))
    assert moved.forward == moved.backward == 0.0
    assert 4 * trainable < DDP_BUCKET_BYTES  # the tiny model is one bucket: all of it exposed
    assert moved.last_backward_exposed == pytest.approx(moved.last_backward)
    half = traffic(TINY, "ddp", replace(setup, gradient_compression="bf16"))
    assert half.last_backward == pytest.approx(moved.last_backward / 2)
    assert traffic(TINY, "ddp", replace(setup, gpus_per_node=1)).last_backward == 0.0  # one rank: no DDP


def test_powersgd_sends_low_rank_factors() -> None:
    # rank 1: each matrix m x n sends m + n; vectors whole. Per layer q 64+64, k 64+32, v 64+32, o 64+64,
    # gate/up 64+128 twice, down 128+64 -> 1,024, norms 128; 2 layers 2,304; embedding and LM head 1064 each;
    # final norm 64: 4,496.
    assert powersgd_elements(cost_model(STRATEGY_BY_KEY["ddp"], TINY, Setup())) == 4_496


def test_fsdp_gathers_twice_and_reduce_scatters_every_micro_batch() -> None:
    setup = Setup(gpus_per_node=4, seq_length=100)
    n = param_counts(TINY, setup).total_with_adapters
    full = traffic(TINY, "fsdp_full", setup)
    gather, scatter = 3 / 4 * 2 * n / (400 * GB), 3 / 4 * 4 * n / (400 * GB)  # bf16 parameters, fp32 gradients
    assert full.forward == pytest.approx(gather) and full.backward == pytest.approx(gather + scatter)
    # the first unit gathered (the root: embedding + head) shows, as does the last reduce-scatter (a layer)
    units = cost_model(STRATEGY_BY_KEY["fsdp_full"], TINY, setup).units()  # type: ignore[attr-defined]
    whole = sum(u.gathered for u in units)
    assert full.forward_exposed == pytest.approx(gather * units[0].gathered / whole)
    assert full.backward_exposed == pytest.approx(scatter * units[-1].gathered / whole)
    assert traffic(TINY, "fsdp_grad_op", setup).backward == pytest.approx(scatter)  # kept gathered


def test_hybrid_shards_within_the_node_and_all_reduces_across() -> None:
    setup = Setup(gpus_per_node=4, nodes=2, seq_length=100)
    n = param_counts(TINY, setup).total_with_adapters
    hybrid = planner_strategy("h", "FSDP hybrid", "fsdp", {"sharding": "hybrid"})
    moved = cost_model(hybrid, TINY, setup).traffic(HW)
    within = 3 / 4 * (4 * n) / (400 * GB)  # reduce-scatter over the node's 4 ranks at NVLink speed
    across = 2 * 1 / 2 * (4 * n / 4) / (100 * GB)  # its quarter all-reduced over 2 nodes on the fabric
    assert moved.backward == pytest.approx(3 / 4 * 2 * n / (400 * GB) + within + across)


def test_zero_stages_move_their_bytes() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100)
    counts = param_counts(TINY, setup)
    t = counts.trainable
    z1, z2, z3 = (traffic(TINY, key, setup) for key in ("zero1", "zero2", "zero3"))
    bf16 = 7 / 8 * 2 * t / (400 * GB)  # a 16-bit all-gather or reduce-scatter of every trainable element
    assert z1.after_step == pytest.approx(2 * bf16) and z1.backward == 0.0  # reduce after backward, gather after step
    assert z2.backward == pytest.approx(bf16) and z2.after_step == pytest.approx(bf16)
    gathered = 7 / 8 * 2 * (t - counts.persistent) / (400 * GB)  # persistent tensors are never gathered
    assert z3.forward == pytest.approx(gathered) and z3.backward == pytest.approx(gathered + bf16)
    assert z3.after_step == 0.0


def test_zero3_pays_a_host_fetch_per_hooked_module() -> None:
    hw = replace(HW, host=replace(HW.host, zero3_fetch=1e-3))
    zero3 = STRATEGY_BY_KEY["zero3"]
    leaf = cost_model(zero3, TINY, Setup())
    # gym's rule: each decoder layer whole, the embedding and the untied LM head; forward and backward
    assert leaf.fetched_modules() == 2 + 2  # type: ignore[attr-defined]
    assert leaf.hook_seconds(hw) == pytest.approx(2 * 4 * 1e-3)
    per_module = cost_model(zero3, TINY, Setup(zero3_leaf_layers=False))
    assert per_module.fetched_modules() == 2 * (7 + 2) + 2  # type: ignore[attr-defined]  # 7 linears, 2 norms
    checkpointed = cost_model(zero3, TINY, Setup(activation_checkpointing=True))
    assert checkpointed.hook_seconds(hw) == pytest.approx(3 * 4 * 1e-3)  # the recompute fetches again
    assert cost_model(STRATEGY_BY_KEY["zero2"], TINY, Setup()).hook_seconds(hw) == 0.0
    assert step_time(TINY, zero3, Setup(accumulate_grad_batches=2), hw).hooks == pytest.approx(2 * 8e-3)


def test_offload_moves_partitions_over_pcie_and_steps_on_the_host() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100)
    elements = param_counts(TINY, setup).trainable / 8
    seconds = cost_model(STRATEGY_BY_KEY["zero2_offload"], TINY, setup).offload_seconds(HW)
    pcie = (2 * elements + 2 * elements) / (50 * GB)  # 16-bit gradients down, 16-bit parameters up
    host_step = 8 * elements * 36 / (200 * GB)  # the node's 8 ranks step at once on its DRAM
    assert seconds == pytest.approx(pcie + host_step)
    assert cost_model(STRATEGY_BY_KEY["zero2"], TINY, setup).offload_seconds(HW) == 0.0
    assert step_time(TINY, STRATEGY_BY_KEY["zero2_offload"], setup, HW).optimizer == 0.0  # not on the device


def test_sequence_parallel_all_to_alls() -> None:
    setup = Setup(gpus_per_node=4, seq_length=400, sequence_parallel_size=4)
    per_layer = 100 * (2 * 64 + 2 * 32) * 2  # 100 local tokens: q and out (64 each), k and v (32 each), bf16
    expected = 2 * 2 * 3 / 4 * per_layer / (400 * GB)  # forward + backward, 2 layers
    assert sequence_parallel_seconds(TINY, setup, HW) == pytest.approx(expected)
    assert sequence_parallel_seconds(TINY, replace(setup, sequence_parallel_size=1), HW) == 0.0


# ---------------------------------------------------------------------------------------------- the step
def test_accumulation_hides_ddp_only_behind_the_last_backward() -> None:
    setup = Setup(gpus_per_node=8, seq_length=100, accumulate_grad_batches=4)
    hw = replace(HW, network=replace(NET, intra_bandwidth=1 * GB))  # the all-reduce outlasts one backward
    one = step_time(TINY, STRATEGY_BY_KEY["ddp"], setup, hw)
    moved = traffic(TINY, "ddp", setup, hw)
    assert one.communication == pytest.approx(moved.last_backward)  # once per optimizer step, not per micro-batch
    assert one.exposed_communication == pytest.approx(moved.last_backward)  # one bucket: nothing to hide behind
    c = micro_batch_compute(TINY, setup, KERNELS)
    assert one.compute == pytest.approx(4 * (c.forward + c.backward))


def test_contention_and_the_slowest_rank_join_the_step() -> None:
    setup = Setup(gpus_per_node=4, seq_length=100, micro_batch_size=64)
    net = replace(NET, contention=0.1, dispersion=0.02)
    hw = replace(HW, network=net)
    lossless = step_time(TINY, STRATEGY_BY_KEY["fsdp_full"], setup, HW)
    step = step_time(TINY, STRATEGY_BY_KEY["fsdp_full"], setup, hw)
    moved = traffic(TINY, "fsdp_full", setup, hw)
    c = micro_batch_compute(TINY, setup, KERNELS)
    expected = 0.1 * (min(moved.forward - moved.forward_exposed, c.forward))
    expected += 0.1 * (min(moved.backward - moved.backward_exposed, c.backward))
    assert step.contention == pytest.approx(expected)
    assert step.dispersion == pytest.approx(0.02 * expected_maximum(4) * (c.forward + c.backward))
    assert step.total == pytest.approx(lossless.total + step.contention + step.dispersion)


def test_speed_reports_tokens_mfu_and_scaling() -> None:
    setup = Setup(gpus_per_node=1, micro_batch_size=2, seq_length=100)
    result = speed(TINY, STRATEGY_BY_KEY["ddp"], setup, HW)
    assert result.tokens_per_step == 200
    assert result.tokens_per_second_per_gpu == pytest.approx(200 / result.step.total)
    assert result.mfu == pytest.approx(200 * flops_per_token(TINY, setup).model / result.step.total / 1e15)
    assert result.scaling == pytest.approx(1.0)
    assert result.hours(200 * 3600, 1) == pytest.approx(result.step.total)
    slow = replace(HW, network=replace(NET, intra_bandwidth=1 * GB))
    assert speed(TINY, STRATEGY_BY_KEY["ddp"], replace(setup, gpus_per_node=8), slow).scaling < 1.0


def test_gather_and_scatter_shares_slow_only_their_collectives() -> None:
    hw = replace(HW, network=replace(NET, gather_share=0.5, scatter_share=0.25))  # gloo's
    setup = Setup(gpus_per_node=4, seq_length=100)
    n = param_counts(TINY, setup).total_with_adapters
    moved = traffic(TINY, "fsdp_full", setup, hw)
    gather = 3 / 4 * 2 * n / (200 * GB)
    assert moved.forward == pytest.approx(gather)
    assert moved.backward == pytest.approx(gather + 3 / 4 * 4 * n / (100 * GB))
    assert traffic(TINY, "ddp", setup, hw).last_backward == pytest.approx(traffic(TINY, "ddp", setup).last_backward)
