"""Time of one optimizer step per strategy: pure functions of FLOPs, bytes and bandwidths, no torch.

A step is compute plus whatever communication, host traffic and optimizer work compute does not hide. Every term is
a function below with a unit test against a hand computation (tests/planner/test_timing.py); docs/planner.md, "Step
time", derives them and validates the sum against measured runs. There is NO per-strategy efficiency constant:
strategies differ only in the bytes they move, what of it overlaps with compute, and what they recompute.

* **Compute** (:func:`flops_per_token`): the package's own FLOP count (``metrics.flops``: PaLM's 6N + 12LHQT per
  token, 4N for frozen weights, MoE at k/E of the experts and of their LoRA adapters; an NF4 weight as the 16-bit
  matmul it is dequantised for) at ``Hardware.compute_efficiency`` of the dense peak;
  activation checkpointing adds the decoder layers' forward again. The efficiency is calibrated once, on the plain
  PyTorch loop's row (:data:`PLAIN_LOOP`, :func:`calibrated_efficiency`), never per strategy.
* **Collectives** (:func:`all_reduce_seconds`, :func:`all_gather_seconds`, :func:`all_to_all_seconds`): nccl-tests'
  bus-bandwidth convention (``busbw = algbw x 2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter
  and all-to-all), so a link's catalogued ``busbw`` gives the time of any size on any rank count, plus a latency of
  ``1 + log2(nodes)`` small-message latencies (NCCL's trees). A collective that spans nodes runs at the fabric's
  bus bandwidth, capped by the node's (:func:`bus_bandwidth`).
* **Overlap** (:func:`overlapped_seconds`): collectives on their own stream hide behind the compute of the same
  phase, except the part that has nothing to hide behind: the first gather of the forward, the last bucket or
  reduce-scatter of the backward. DeepSpeed's ZeRO-1 reduces after backward and every ZeRO stage below 3 gathers the
  updated parameters after the step: neither overlaps. On CPU ranks gloo computes on the same cores as the model,
  so nothing overlaps there (``Hardware.overlap``).
* **Optimizer step** (:func:`optimizer_seconds`): memory-bound, bytes per trainable element read and written over
  the device's memory bandwidth; sharded strategies step only their partition.
* **Offload** (:func:`offload_seconds`): parameter and gradient copies over PCIe, the CPU optimizer over the host's
  memory bandwidth (shared by the node's ranks), NVMe swaps over the node's disks; not hidden.
* **Gradient accumulation**: compute and per-micro-batch collectives (FSDP's and ZeRO-2/3's reduce-scatter, every
  gather) scale with the micro-batches; DDP's all-reduce and ZeRO-1's reduction run once per optimizer step and
  hide only behind the last micro-batch's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.estimate import (
    OPTIMIZER_STATE_BYTES,
    Setup,
    Strategy,
    frozen_bytes,
    local_tokens,
    param_counts,
    tensor_groups,
)
from gym_lightning.planner.experts import expert_adapter_params

# What the scaling efficiency compares with: one GPU, no wrapper, the whole optimizer step on the device.
PLAIN = Strategy("plain", "plain loop", "none", "torch", 0)
# DDP's bucket (torch's ``bucket_cap_mb`` default, 25 MiB): the last one reduced after backward has ended.
DDP_BUCKET_BYTES = 25 * 2**20

# The plain PyTorch loop of issue 47's table (one H200, torch 2.11+cu130, Qwen3-1.7B shape, fp32 parameters with
# bf16 autocast, SDPA, fused torch AdamW, micro-batch 4 x 2048, 10 timed steps after 3): the one GPU row the
# compute efficiency is calibrated on. Every other measured row validates the model (docs/planner.md).
PLAIN_LOOP = {"model": "qwen3-1.7b", "gpu": "h200-sxm", "micro_batch": 4, "seq_length": 2048, "tokens_per_s": 25_764}


@dataclass(frozen=True)
class Hardware:
    """The figures of one machine type the step-time model reads (``planner.machines`` fills it from the catalog,
    ``gym_lightning/assets/hardware.yaml``; each can be overridden).

    Args:
        name: Shown in the report (``"8 x H100 SXM, NVLink 4; InfiniBand NDR 400"``).
        peak_flops: Dense FLOP/s of one device in the compute dtype.
        compute_efficiency: The fraction of ``peak_flops`` a plain training loop's model FLOPs reach (calibrated on
            :data:`PLAIN_LOOP`).
        memory_bandwidth: Device memory bytes/s (the optimizer step is bound by it).
        intra_bandwidth: All-reduce bus bandwidth among the GPUs of one node, bytes/s (nccl-tests ``busbw``).
        inter_bandwidth: Bus bandwidth of a collective spanning nodes, bytes/s (0 when there is one node).
        intra_latency: Seconds of a small collective within a node.
        inter_latency: Seconds of a small collective across nodes.
        host_bandwidth: Pinned host <-> device copy bytes/s of one device (PCIe).
        host_memory_bandwidth: Host DRAM bytes/s of one node (the CPU optimizer), shared by its ranks.
        nvme_bandwidth: NVMe bytes/s of one node, shared by its ranks.
        overlap: Whether collectives run beside compute (NCCL's own stream); gloo on CPU ranks does not.
        gather_share: All-gather bus bandwidth / all-reduce bus bandwidth (1 for NCCL, whose nccl-tests figures are
            alike; measured for gloo, whose all-gather reached a third of its all-reduce).
        scatter_share: Reduce-scatter bus bandwidth / all-reduce bus bandwidth, as ``gather_share``.
    """

    name: str
    peak_flops: float
    compute_efficiency: float
    memory_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float = 0.0
    intra_latency: float = 10e-6
    inter_latency: float = 20e-6
    host_bandwidth: float = 25e9
    host_memory_bandwidth: float = 200e9
    nvme_bandwidth: float = 6e9
    overlap: bool = True
    gather_share: float = 1.0
    scatter_share: float = 1.0

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one rank, by term (``total`` is their sum)."""

    compute: float  # forward + backward of the model FLOPs, every micro-batch
    recompute: float  # activation checkpointing's second forward
    communication: float  # every collective of the step, hidden or not
    exposed_communication: float  # the part compute did not hide
    sequence_parallel: float  # Ulysses all-to-alls (between attention and the rest: nothing to hide behind)
    optimizer: float  # the optimizer step on the device
    offload: float  # PCIe copies, the CPU optimizer, NVMe swaps

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.recompute
            + self.exposed_communication
            + self.sequence_parallel
            + self.optimizer
            + self.offload
        )

    def as_dict(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


# ---------------------------------------------------------------------------------------------------------------
# FLOPs


@dataclass(frozen=True)
class TokenFlops:
    """Training FLOPs of one token: forward, backward, and the forward activation checkpointing recomputes."""

    forward: float
    backward: float
    recompute: float

    @property
    def model(self) -> float:
        """Model FLOPs (MFU's numerator): forward + backward."""
        return self.forward + self.backward


def matmul_params(shape: ModelShape, setup: Setup) -> tuple[float, float, float]:
    """``(trainable, frozen, decoder)`` active matmul parameters, as ``metrics.flops`` counts them: every parameter but
    the input embedding's lookup, the LM head always (tied or not), routed experts at ``k / E``; ``decoder`` is the
    decoder layers' share (what activation checkpointing recomputes)."""
    counts = param_counts(shape, setup)
    # Expert adapters run for the k routed experts of a token only: k/E of them, like the experts they adapt.
    experts = expert_adapter_params(shape, setup.lora_r, setup.lora_target_parameters)
    routed = experts * shape.experts_per_token // shape.num_experts if experts else 0
    adapters = counts.total_with_adapters - shape.num_params() - experts + routed  # LoRA adapters, as active
    active = shape.active_params() + adapters
    decoder = active - shape.embedding_params() * (1 if shape.tied_embeddings else 2) - shape.hidden_size
    lookup = 0 if shape.tied_embeddings else shape.embedding_params()  # a tied embedding is the LM head's matmul
    matmul = active - lookup
    trainable = counts.trainable - experts + routed - (lookup if setup.lora_r == 0 else 0)
    if setup.lora_r == 0 and shape.is_moe:  # every trainable weight, experts at k/E
        trainable = matmul
    return float(trainable), float(matmul - trainable), float(decoder)


def flops_per_token(shape: ModelShape, setup: Setup) -> TokenFlops:
    """Forward, backward and recomputed FLOPs of one token at ``setup.seq_length`` (``metrics.flops``' convention:
    ``2N`` forward; ``4N`` backward for trainable weights, ``2N`` for frozen ones (input gradient only); attention
    ``4LHQT`` forward, ``8LHQT`` backward). Activation checkpointing recomputes the decoder layers' forward."""
    trainable, frozen, decoder = matmul_params(shape, setup)
    attention = 4 * shape.num_layers * shape.q_width * setup.seq_length
    forward = 2 * (trainable + frozen) + attention
    backward = 4 * trainable + 2 * frozen + 2 * attention
    recompute = 2 * decoder + attention if setup.activation_checkpointing else 0.0
    return TokenFlops(forward, backward, recompute)


def calibrated_efficiency(step_flops: float, step_seconds: float, peak_flops: float, optimizer_seconds: float) -> float:
    """The compute efficiency that makes the model's one-device step (compute + optimizer step) last ``step_seconds``:
    ``step_flops / (peak x (step_seconds - optimizer_seconds))``."""
    return step_flops / (peak_flops * (step_seconds - optimizer_seconds))


# ---------------------------------------------------------------------------------------------------------------
# Collectives


def all_reduce_seconds(nbytes: float, ranks: int, bus_bandwidth: float, latency: float, calls: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks`` in ``calls`` collectives (buckets): ``2(n-1)/n x bytes / busbw``
    (nccl-tests' ``busbw``) plus one latency per call."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bus_bandwidth + calls * latency


def all_gather_seconds(nbytes: float, ranks: int, bus_bandwidth: float, latency: float, calls: int = 1) -> float:
    """All-gather (or reduce-scatter) whose full tensors are ``nbytes`` in ``calls`` collectives (one per FSDP unit):
    ``(n-1)/n x bytes / busbw`` plus one latency per call."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bus_bandwidth + calls * latency


def all_to_all_seconds(nbytes: float, ranks: int, bus_bandwidth: float, latency: float, calls: int = 1) -> float:
    """All-to-all of ``nbytes`` held by each rank: ``(n-1)/n`` of them leave it."""
    return all_gather_seconds(nbytes, ranks, bus_bandwidth, latency, calls)


@dataclass(frozen=True)
class Group:
    """The ranks a collective spans: how many, at which all-reduce bus bandwidth and latency, and the all-gather's
    and reduce-scatter's bus bandwidth as shares of the all-reduce's (:class:`Hardware`)."""

    ranks: int
    bandwidth: float
    latency: float
    gather_share: float = 1.0
    scatter_share: float = 1.0

    def all_reduce(self, nbytes: float, calls: int = 1) -> float:
        return all_reduce_seconds(nbytes, self.ranks, self.bandwidth, self.latency, calls)

    def all_gather(self, nbytes: float, calls: int = 1) -> float:
        return all_gather_seconds(nbytes, self.ranks, self.bandwidth * self.gather_share, self.latency, calls)

    def reduce_scatter(self, nbytes: float, calls: int = 1) -> float:
        return all_gather_seconds(nbytes, self.ranks, self.bandwidth * self.scatter_share, self.latency, calls)

    def all_to_all(self, nbytes: float, calls: int = 1) -> float:
        return all_to_all_seconds(nbytes, self.ranks, self.bandwidth, self.latency, calls)


def bus_bandwidth(hw: Hardware, nodes: int) -> tuple[float, float]:
    """``(bus bandwidth, latency)`` of a collective over ``nodes`` nodes: the node's link within one; across nodes
    the fabric's, capped by the node's (a ring crosses both), and ``1 + log2(nodes)`` fabric latencies."""
    if nodes <= 1:
        return hw.intra_bandwidth, hw.intra_latency
    if hw.inter_bandwidth <= 0:
        raise GymUserError(
            f"{hw.name}: {nodes} nodes need an inter-node bus bandwidth: name an --interconnect (a fabric such as "
            "ib-ndr400) or pass --inter_node_bandwidth."
        )
    return min(hw.intra_bandwidth, hw.inter_bandwidth), hw.inter_latency * (1 + math.log2(nodes))


def group(hw: Hardware, ranks: int, gpus_per_node: int) -> Group:
    """The :class:`Group` of ``ranks`` consecutive ranks (a node holds ``gpus_per_node`` of them)."""
    nodes = -(-ranks // gpus_per_node)
    return Group(ranks, *bus_bandwidth(hw, nodes), hw.gather_share, hw.scatter_share)


def overlapped_seconds(compute: float, communication: float, exposed: float, overlap: bool = True) -> float:
    """Seconds of a phase whose collectives run beside ``compute``: ``exposed`` seconds of them have nothing to hide
    behind (the first gather, the last bucket), the rest hides behind compute and shows only beyond it."""
    if not overlap:
        return compute + communication
    exposed = min(exposed, communication)
    return compute + exposed + max(0.0, communication - exposed - compute)


# ---------------------------------------------------------------------------------------------------------------
# Bytes per strategy


@dataclass(frozen=True)
class Traffic:
    """Seconds of the collectives one rank's strategy runs in one optimizer step, by phase, and how much of each
    phase compute cannot hide.

    Args:
        forward: Collective seconds during each micro-batch's forward (parameter gathers).
        forward_exposed: Of which nothing hides (the first gather).
        backward: Collective seconds during each micro-batch's backward (gathers, reduce-scatters).
        backward_exposed: Of which nothing hides (the last bucket / reduce-scatter).
        last_backward: Collective seconds during the last micro-batch's backward only (DDP's all-reduce).
        last_backward_exposed: Of which nothing hides.
        after_step: Collective seconds outside any compute (ZeRO-1's reduction, ZeRO-1/2's parameter all-gather).
    """

    forward: float = 0.0
    forward_exposed: float = 0.0
    backward: float = 0.0
    backward_exposed: float = 0.0
    last_backward: float = 0.0
    last_backward_exposed: float = 0.0
    after_step: float = 0.0


def gathered_bytes(strategy: Strategy, setup: Setup) -> int:
    """Bytes per element of a gathered parameter: the compute dtype under ``bf16-mixed`` (FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16)``, DeepSpeed's 16-bit model), else fp32."""
    return 2 if setup.precision == "bf16-mixed" else 4


def reduced_bytes(strategy: Strategy, setup: Setup) -> int:
    """Bytes per element of a reduced gradient: torch's DDP and FSDP2 reduce fp32 gradients (``reduce_dtype=fp32``)
    unless a compression hook halves them; DeepSpeed reduces in its 16-bit model dtype."""
    half = setup.precision == "bf16-mixed"
    if strategy.framework == "deepspeed":
        return 2 if half else 4
    return 2 if setup.gradient_compression in ("fp16", "bf16") else 4


def powersgd_elements(shape: ModelShape, setup: Setup, rank: int) -> float:
    """Elements PowerSGD all-reduces for the trainable weights: ``r (m + n)`` per matrix (its P and Q factors, Vogels
    et al. 2019), vectors whole."""
    groups = tensor_groups(shape, setup)
    shapes = {f"layer.{name}": dims for name, dims in shape.linear_shapes().items()}
    shapes |= {"embed_tokens": (shape.vocab_size, shape.hidden_size), "lm_head": (shape.vocab_size, shape.hidden_size)}
    total = 0.0
    for g in groups:
        if not g.trainable:
            continue
        m, n = shapes.get(g.name, (0, 0))
        total += g.count * (rank * (m + n) if m and n and rank * (m + n) < g.numel else g.numel)
    return total


def gradient_bytes(shape: ModelShape, strategy: Strategy, setup: Setup) -> float:
    """Bytes of every trainable gradient as reduced (PowerSGD: its low-rank factors, fp32)."""
    trainable = param_counts(shape, setup).trainable
    if setup.gradient_compression == "powersgd" and strategy.ddp:
        return 4 * powersgd_elements(shape, setup, setup.powersgd_rank)
    return reduced_bytes(strategy, setup) * trainable


def parameter_bytes(shape: ModelShape, strategy: Strategy, setup: Setup, exclude_persistent: bool = False) -> float:
    """Bytes of the whole model as gathered: trainable parameters in the gathered dtype, the frozen base as stored
    (an NF4 base in its 4-bit bytes); ZeRO-3's persistent tensors are never gathered."""
    counts = param_counts(shape, setup)
    per = gathered_bytes(strategy, setup)
    total = per * counts.trainable + frozen_bytes(shape, setup, per)
    return total - (per * counts.persistent if exclude_persistent else 0.0)


def traffic(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> Traffic:
    """The collectives of ``strategy`` for one optimizer step (see :class:`Traffic`)."""
    if strategy.stage == 0:
        return _replicated_traffic(shape, strategy, setup, hw)
    if strategy.framework == "torch":
        return _fsdp_traffic(shape, strategy, setup, hw)
    return _zero_traffic(shape, strategy, setup, hw)


def _replicated_traffic(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> Traffic:
    """DDP (and FSDP ``none``): one all-reduce of the gradients per optimizer step, in buckets during the last
    micro-batch's backward; the last bucket after it. gym_ddp on one rank without a hook runs no DDP at all."""
    world = group(hw, setup.world_size, setup.gpus_per_node)
    grads = gradient_bytes(shape, strategy, setup)
    total = world.all_reduce(grads, calls=math.ceil(grads / DDP_BUCKET_BYTES))
    last = world.all_reduce(min(DDP_BUCKET_BYTES, grads))
    return Traffic(last_backward=total, last_backward_exposed=last)


def _fsdp_traffic(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> Traffic:
    """FSDP2, one unit per decoder layer: every micro-batch gathers the parameters in forward and (``full``) again in
    backward, and reduce-scatters the gradients (no ``no_sync`` under accumulation). Hybrid sharding does this within
    the node and all-reduces its gradient shard across nodes."""
    counts = param_counts(shape, setup)
    shard = group(hw, setup.gpus_per_node if strategy.hybrid else setup.world_size, setup.gpus_per_node)
    params, grads = parameter_bytes(shape, strategy, setup), gradient_bytes(shape, strategy, setup)
    unit = counts.largest_unit / max(counts.total_with_adapters, 1)  # one unit's share of the model
    units = shape.num_layers + 1  # one per decoder layer and the root (embedding, norm, head)
    gather, scatter = shard.all_gather(params, units), shard.reduce_scatter(grads, units)
    backward = scatter + (0.0 if strategy.keep_gathered else gather)
    if strategy.hybrid and setup.nodes > 1:
        replicas = group(hw, setup.nodes, 1)  # one rank per node: every hop crosses the fabric
        backward += replicas.all_reduce(grads / setup.gpus_per_node)
    return Traffic(gather, gather * unit, backward, scatter * unit)


def _zero_traffic(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> Traffic:
    """DeepSpeed ZeRO: stage 1 reduce-scatters once per optimizer step after backward; stage 2 reduce-scatters every
    micro-batch during backward (``overlap_comm``, the last layer-sized bucket after it); both all-gather the updated
    16-bit parameters after the step. Stage 3 gathers in forward and backward (prefetched: the first gather shows)
    and reduce-scatters during backward; its persistent tensors never move."""
    counts = param_counts(shape, setup)
    world = group(hw, setup.world_size, setup.gpus_per_node)
    grads = gradient_bytes(shape, strategy, setup)
    layer_share = counts.layer / max(counts.total_with_adapters, 1)
    buckets = math.ceil(1 / layer_share) if strategy.stage >= 2 else 1  # ZeROStrategy's layer-sized buckets
    scatter = world.reduce_scatter(grads, buckets)
    if strategy.stage == 1:
        updated = world.all_gather(gathered_bytes(strategy, setup) * counts.trainable)
        return Traffic(after_step=scatter + updated)
    if strategy.stage == 2:
        updated = world.all_gather(gathered_bytes(strategy, setup) * counts.trainable)
        return Traffic(backward=scatter, backward_exposed=scatter * layer_share, after_step=updated)
    gather = world.all_gather(parameter_bytes(shape, strategy, setup, exclude_persistent=True), shape.num_layers + 1)
    unit = counts.largest_unit / max(counts.total_with_adapters, 1)
    return Traffic(gather, gather * unit, gather + scatter, scatter * layer_share)


# ---------------------------------------------------------------------------------------------------------------
# Optimizer, offload, sequence parallelism

# Bytes read and written per trainable element by one optimizer step on the device (fp32 state): AdamW reads the
# parameter, gradient, momentum and variance and writes three of them back (16 + 12); SGD with momentum 12 + 8;
# Adafactor's factored moment is O(rows + cols), so parameter and gradient in, parameter out. DeepSpeed adds the
# 16-bit gradient partition's conversion to fp32 (2 in, 4 out) and the 16-bit parameter copy written after it (2).
OPTIMIZER_TRAFFIC: dict[str, int] = {"adamw": 28, "sgd": 20, "adafactor": 12}
DEEPSPEED_STEP_EXTRA = 8


def optimizer_seconds(elements: float, bytes_per_element: float, memory_bandwidth: float) -> float:
    """A memory-bound optimizer step: ``elements x bytes / bandwidth``."""
    return elements * bytes_per_element / memory_bandwidth


def step_traffic_bytes(strategy: Strategy, setup: Setup) -> int:
    """Bytes per trainable element of one optimizer step (see :data:`OPTIMIZER_TRAFFIC`)."""
    extra = DEEPSPEED_STEP_EXTRA if strategy.framework == "deepspeed" else 0
    return OPTIMIZER_TRAFFIC[setup.optimizer] + extra


def sharded_elements(shape: ModelShape, strategy: Strategy, setup: Setup) -> float:
    """Trainable elements one rank steps: all of them when replicated, its partition when sharded."""
    trainable = param_counts(shape, setup).trainable
    if strategy.stage == 0:
        return float(trainable)
    shards = setup.gpus_per_node if strategy.hybrid else setup.world_size
    return trainable / shards


def offload_seconds(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> float:
    """Host traffic of one optimizer step on one rank, not hidden: the gradient partition down and the updated
    parameters up over PCIe, the optimizer step over the node's host memory bandwidth (all its ranks step at once),
    NVMe swaps of the optimizer state (read and written) and, with parameters offloaded, the parameter partition up
    for every gather (forward, and backward unless kept gathered), from NVMe first when they live there."""
    if strategy.offload_optimizer == "none" and strategy.offload_parameters == "none":
        return 0.0
    elements = sharded_elements(shape, strategy, setup)
    ranks = setup.gpus_per_node
    grads, params = reduced_bytes(strategy, setup) * elements, gathered_bytes(strategy, setup) * elements
    if strategy.framework == "torch":  # FSDP2's CPUOffloadPolicy: fp32 shards on the host, fp32 gradients down
        grads, params = 4 * elements, 4 * elements
    seconds = (grads * setup.accumulate_grad_batches + params) / hw.host_bandwidth
    state = (4 + 4 + OPTIMIZER_STATE_BYTES[setup.optimizer]) * elements
    seconds += optimizer_seconds(elements * ranks, step_traffic_bytes(strategy, setup), hw.host_memory_bandwidth)
    if strategy.offload_optimizer == "nvme":
        seconds += 2 * state * ranks / hw.nvme_bandwidth
    if strategy.offload_parameters != "none":
        shards = setup.gpus_per_node if strategy.hybrid else setup.world_size
        partition = parameter_bytes(shape, strategy, setup) / shards
        gathers = (1 if strategy.keep_gathered else 2) * setup.accumulate_grad_batches
        seconds += gathers * partition / hw.host_bandwidth
        if strategy.offload_parameters == "nvme":
            seconds += gathers * partition * ranks / hw.nvme_bandwidth
    return seconds


def sequence_parallel_seconds(shape: ModelShape, setup: Setup, hw: Hardware) -> float:
    """Ulysses' all-to-alls of one micro-batch (DeepSpeed Ulysses, Jacobs et al. 2023): per layer, q, k and v in
    and the attention output back, in forward and again for their gradients in backward (and once more when
    activation checkpointing recomputes the forward); ``tokens x width x a_b`` bytes each."""
    sp = setup.sequence_parallel_size
    if sp <= 1:
        return 0.0
    a_b = 2 if setup.precision == "bf16-mixed" else 4
    tokens = local_tokens(setup, setup.micro_batch_size)
    per_layer = tokens * (2 * shape.q_width + 2 * shape.kv_width) * a_b
    passes = 3 if setup.activation_checkpointing else 2
    sp_group = group(hw, sp, setup.gpus_per_node)
    return passes * shape.num_layers * sp_group.all_to_all(per_layer)


# ---------------------------------------------------------------------------------------------------------------
# The step


def step_time(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> StepTime:
    """Seconds of one optimizer step of ``setup.accumulate_grad_batches`` micro-batches on one rank."""
    flops = flops_per_token(shape, setup)
    tokens = local_tokens(setup, setup.micro_batch_size)
    forward = tokens * flops.forward / hw.achieved_flops
    backward = tokens * flops.backward / hw.achieved_flops
    recompute = tokens * flops.recompute / hw.achieved_flops
    micro = setup.accumulate_grad_batches
    moved = traffic(shape, strategy, setup, hw)
    fwd = overlapped_seconds(forward, moved.forward, moved.forward_exposed, hw.overlap)
    bwd = overlapped_seconds(backward + recompute, moved.backward, moved.backward_exposed, hw.overlap)
    last = overlapped_seconds(
        bwd, moved.last_backward, moved.last_backward_exposed, hw.overlap
    )  # the last micro-batch's backward also carries DDP's all-reduce
    phases = (micro - 1) * (fwd + bwd) + fwd + last
    exposed = phases + moved.after_step - micro * (forward + backward + recompute)
    communication = micro * (moved.forward + moved.backward) + moved.last_backward + moved.after_step
    device_step = 0.0 if strategy.offload_optimizer != "none" else sharded_elements(shape, strategy, setup)
    return StepTime(
        compute=micro * (forward + backward),
        recompute=micro * recompute,
        communication=communication,
        exposed_communication=max(0.0, exposed),
        sequence_parallel=micro * sequence_parallel_seconds(shape, setup, hw),
        optimizer=optimizer_seconds(device_step, step_traffic_bytes(strategy, setup), hw.memory_bandwidth),
        offload=offload_seconds(shape, strategy, setup, hw),
    )


@dataclass(frozen=True)
class Speed:
    """What :func:`speed` predicts for one strategy.

    Args:
        step: The step's terms.
        tokens_per_step: Tokens of one optimizer step over the whole job.
        tokens_per_second_per_gpu: Job tokens per second / GPUs.
        mfu: Model FLOPs per second per GPU / the dense peak.
        scaling: Tokens per second per GPU / a plain loop's on one GPU (no strategy, memory aside): 1.0 is linear
            scaling; above it, sharding the optimizer step saved more than communication cost.
    """

    step: StepTime
    tokens_per_step: int
    tokens_per_second_per_gpu: float
    mfu: float
    scaling: float

    def hours(self, tokens: float, gpus: int) -> float:
        """Wall-clock hours of training ``tokens`` on ``gpus`` GPUs."""
        return tokens / (self.tokens_per_second_per_gpu * gpus) / 3600


def speed(shape: ModelShape, strategy: Strategy, setup: Setup, hw: Hardware) -> Speed:
    """Step time, tokens/s per GPU, MFU and scaling efficiency of ``strategy`` (see :class:`Speed`)."""
    step = step_time(shape, strategy, setup, hw)
    tokens = setup.seq_length * setup.micro_batch_size * setup.accumulate_grad_batches * setup.data_parallel_size
    per_gpu = tokens / step.total / setup.world_size
    flops = flops_per_token(shape, setup).model * tokens / step.total / setup.world_size
    alone = Setup(**{**_fields(setup), "gpus_per_node": 1, "nodes": 1, "sequence_parallel_size": 1})
    single = step_time(shape, PLAIN, alone, hw)
    single_rate = setup.seq_length * setup.micro_batch_size * setup.accumulate_grad_batches / single.total
    return Speed(step, tokens, per_gpu, flops / hw.peak_flops, per_gpu / single_rate)


def _fields(setup: Setup) -> dict[str, object]:
    return {f.name: getattr(setup, f.name) for f in fields(setup)}
