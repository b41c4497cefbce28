"""Compute time of one micro-batch on one rank: a roofline over the step's GEMMs, attention and memory-bound work.

Model FLOPs (MFU's numerator, :func:`flops_per_token`) follow ``metrics.flops``: PaLM's ``6N + 12LHQT`` per token,
``4N`` for frozen weights, routed experts and their adapters at ``k/E``. The time is not FLOPs at one efficiency:

* every GEMM of the micro-batch (:func:`layer_gemms`: forward, input gradient, and weight gradient where trainable)
  takes ``2mnk / (peak x gemm_peak) + gemm_overhead`` (:func:`gemm_seconds`), so small GEMMs (a mixture of experts'
  per-expert products, LoRA's rank-r factors, a small model's) reach less of the peak than large ones, as measured
  GEMM tables show (docs/planner.md, "Kernels");
* flash attention's FLOPs run at ``attention_peak`` of the peak;
* the elementwise work (norms, residual adds, RoPE, SwiGLU, the loss's softmax) is memory-bound: bytes counted per
  token and layer (:func:`elementwise_bytes`) over the device's achieved memory bandwidth, times the kernel path's
  share (:data:`KERNEL_PASSES`: eager, ``torch.compile``, Liger's fused kernels);
* a mixture of experts also pays its routing (gathers, scatters, the router's softmax) and, where the host
  launches the per-expert kernels slower than the device runs them, the difference (:func:`expert_loop_seconds`);
* a preference stage adds its forwards without gradient (:func:`no_grad_seconds`): a reference's over every row,
  KTO's KL rows through the policy.

The sum is divided by ``Kernels.efficiency``: how close the project's kernels come to this roofline, one figure per
(project, GPU) calibrated on one row (``planner.machines``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gym_lightning.models.shapes import ModelShape, lora_target_names
from gym_lightning.planner.experts import expert_adapter_params, targeted_weights
from gym_lightning.planner.params import param_counts
from gym_lightning.planner.spec import RunSpec, local_tokens

# Share of the eager path's elementwise bytes each kernel path moves (docs/planner.md, "Kernels": torch.compile's
# share calibrated on torchtitan's 8-GPU eager / compiled pair; Liger's fused RMSNorm, SwiGLU, RoPE and linear
# cross-entropy assumed alike).
KERNEL_PASSES: dict[str, float] = {"eager": 1.0, "compiled": 0.46, "liger": 0.46}
# Kernels the host launches per routed expert and MoE layer in gym's routed forward (models.experts.route_experts:
# index, gather, gate_up, split, SiLU, multiply, down, weight, index_add), and three times that with backward.
EXPERT_KERNELS = 9


@dataclass(frozen=True)
class Kernels:
    """One device's compute figures.

    Args:
        peak_flops: Dense FLOP/s in the compute dtype.
        memory_bandwidth: Achieved memory bytes/s (STREAM-like).
        efficiency: How close the project's kernels come to this roofline (calibrated; 1: on it).
        gemm_peak: The share of the peak a large GEMM reaches.
        gemm_overhead: Seconds each GEMM adds (launch and tail): what small GEMMs lose.
        attention_peak: The share of the peak flash attention's FLOPs reach.
        launch: Host seconds to launch one kernel (the per-expert loop waits on it when its kernels are shorter).
    """

    peak_flops: float
    memory_bandwidth: float
    efficiency: float = 1.0
    gemm_peak: float = 1.0
    gemm_overhead: float = 0.0
    attention_peak: float = 1.0
    launch: float = 0.0

    @property
    def achieved_flops(self) -> float:
        """FLOP/s of a large GEMM at the project's efficiency."""
        return self.peak_flops * self.gemm_peak * self.efficiency


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


def matmul_params(shape: ModelShape, spec: RunSpec) -> tuple[float, float, float]:
    """``(trainable, frozen, decoder)`` active matmul parameters, as ``metrics.flops`` counts them: every parameter but
    the input embedding's lookup, the LM head always (tied or not), routed experts at ``k / E``; ``decoder`` is the
    decoder layers' share (what activation checkpointing recomputes)."""
    counts = param_counts(shape, spec)
    experts = expert_adapter_params(shape, spec.lora_r, spec.lora_target_parameters)
    routed = experts * shape.experts_per_token // shape.num_experts if experts else 0
    adapters = counts.total_with_adapters - shape.num_params() - experts + routed  # LoRA adapters, as active
    active = shape.active_params() + adapters
    decoder = active - shape.embedding_params() * (1 if shape.tied_embeddings else 2) - shape.hidden_size
    lookup = 0 if shape.tied_embeddings else shape.embedding_params()  # a tied embedding is the LM head's matmul
    matmul = active - lookup
    trainable = counts.trainable - experts + routed - (lookup if spec.lora_r == 0 else 0)
    if spec.lora_r == 0 and shape.is_moe:  # every trainable weight, experts at k/E
        trainable = matmul
    return float(trainable), float(matmul - trainable), float(decoder)


def flops_per_token(shape: ModelShape, spec: RunSpec) -> TokenFlops:
    """Forward, backward and recomputed FLOPs of one token at ``spec.seq_length`` (``metrics.flops``' convention:
    ``2N`` forward; ``4N`` backward for trainable weights, ``2N`` for frozen ones (input gradient only); attention
    ``4LHQT`` forward, ``8LHQT`` backward). Activation checkpointing recomputes the decoder layers' forward."""
    trainable, frozen, decoder = matmul_params(shape, spec)
    attention = attention_flops(shape, spec)
    forward = 2 * (trainable + frozen) + attention
    backward = 4 * trainable + 2 * frozen + 2 * attention
    recompute = 2 * decoder + attention if spec.activation_checkpointing else 0.0
    return TokenFlops(forward, backward, recompute)


def attention_flops(shape: ModelShape, spec: RunSpec) -> float:
    """Forward FLOPs of one token's attention matmuls, ``4 L H Q T`` (not halved for the causal mask, as PaLM)."""
    return 4.0 * shape.num_layers * shape.q_width * spec.seq_length


def calibrated_efficiency(predicted_seconds: float, measured_seconds: float, fixed_seconds: float = 0.0) -> float:
    """The efficiency that makes a step the model predicts at efficiency 1 last what was measured: the compute part
    (``predicted - fixed``, where ``fixed`` does not scale with the kernels: the optimizer step) over the measured
    compute part."""
    return (predicted_seconds - fixed_seconds) / (measured_seconds - fixed_seconds)


# ---------------------------------------------------------------------------------------------------------------
# GEMMs


@dataclass(frozen=True)
class Gemm:
    """``count`` forward products ``[m, k] @ [k, n]``; ``trainable``: its weight gets a gradient (a third GEMM)."""

    m: float
    n: int
    k: int
    count: float
    trainable: bool


def gemm_seconds(m: float, n: float, k: float, kernels: Kernels) -> float:
    """One GEMM: ``2mnk / (peak x gemm_peak) + gemm_overhead`` (0 for an empty one)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return 2 * m * n * k / (kernels.peak_flops * kernels.gemm_peak) + kernels.gemm_overhead


def layer_gemms(shape: ModelShape, spec: RunSpec, tokens: int) -> list[Gemm]:
    """The forward GEMMs of one micro-batch of ``tokens`` positions: every decoder layer's linears (``L`` of each),
    their LoRA factors, a mixture of experts' router and per-expert products (``tokens x k / E`` rows each, ``E``
    experts), and the LM head."""
    trainable_base = spec.lora_r == 0
    layers = shape.num_layers
    gemms = [Gemm(tokens, o, i, layers, trainable_base) for i, o in shape.linear_shapes().values()]
    gemms += _lora_gemms(shape, spec, tokens)
    if shape.is_moe:
        routed = tokens * shape.experts_per_token / shape.num_experts
        h, inter, experts = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts
        gemms.append(Gemm(tokens, experts, h, layers, trainable_base))
        gemms.append(Gemm(routed, 2 * inter, h, layers * experts, trainable_base))
        gemms.append(Gemm(routed, h, inter, layers * experts, trainable_base))
        for name in targeted_weights(spec.lora_target_parameters) if spec.lora_r else ():
            fan_in, fan_out = (h, 2 * inter) if name == "gate_up_proj" else (inter, h)
            gemms += [Gemm(routed, spec.lora_r, fan_in, layers * experts, True)]
            gemms += [Gemm(routed, fan_out, spec.lora_r, layers * experts, True)]
    gemms.append(Gemm(tokens, shape.vocab_size, shape.hidden_size, 1, trainable_base))
    return gemms


def _lora_gemms(shape: ModelShape, spec: RunSpec, tokens: int) -> list[Gemm]:
    """LoRA's two factors per adapted linear: ``x A^T`` (``r`` outputs) and ``(x A^T) B^T``."""
    if spec.lora_r == 0 or spec.lora_targets == "none":
        return []
    r, layers, found = spec.lora_r, shape.num_layers, []
    for name, (fan_in, fan_out) in shape.linear_shapes().items():
        if name in lora_target_names(spec.lora_targets):
            found += [Gemm(tokens, r, fan_in, layers, True), Gemm(tokens, fan_out, r, layers, True)]
    return found


def gemm_pass_seconds(gemms: list[Gemm], kernels: Kernels) -> tuple[float, float]:
    """``(forward, backward)`` seconds of ``gemms``: forward ``[m, k] @ [k, n]``; backward the input gradient
    ``[m, n] @ [n, k]`` and, for a trainable weight, its gradient ``[k, m] @ [m, n]``."""
    forward = backward = 0.0
    for g in gemms:
        forward += g.count * gemm_seconds(g.m, g.n, g.k, kernels)
        backward += g.count * gemm_seconds(g.m, g.k, g.n, kernels)
        if g.trainable:
            backward += g.count * gemm_seconds(g.k, g.n, g.m, kernels)
    return forward, backward


# ---------------------------------------------------------------------------------------------------------------
# Memory-bound work


def elementwise_bytes(shape: ModelShape, spec: RunSpec) -> tuple[float, float]:
    """``(decoder layer, LM head and loss)`` bytes of elementwise traffic per token in forward, eager, counted from
    Hugging Face's Llama layer under autocast: two RMSNorms with their fp32 upcast and the cast for the next linear
    (``34h`` each), two residual adds (``10h``), RoPE on q and k (seven passes, ``7 a_b (q + kv)``), the attention
    output's transpose (``2 a_b q``), SwiGLU's SiLU and product (``5 a_b I``); a mixture of experts' routed tokens
    gathered and scattered (``2 k a_b h``) and its router's softmax and top-k (``12E``) instead of the SwiGLU's
    ``I``. The loss reads and writes the logits in fp32 (``3 x (a_b + 8) V``)."""
    h, q, kv, a_b = shape.hidden_size, shape.q_width, shape.kv_width, spec.training.activation_bytes
    if shape.is_moe:
        mlp = shape.experts_per_token * (5 * a_b * shape.moe_intermediate_size + 2 * a_b * h)
        mlp += 12 * shape.num_experts
    else:
        mlp = 5 * a_b * shape.intermediate_size
    layer = 88 * h + 7 * a_b * (q + kv) + 2 * a_b * q + mlp
    return float(layer), float(3 * (a_b + 8) * shape.vocab_size)


def memory_bound_seconds(shape: ModelShape, spec: RunSpec, tokens: int, kernels: Kernels) -> tuple[float, float]:
    """``(forward, backward)`` seconds of the elementwise work of ``tokens`` positions: the forward bytes of
    :func:`elementwise_bytes` for every layer, twice that in backward (each op reads its saved input and the
    incoming gradient and writes its input's gradient), at the kernel path's share (:data:`KERNEL_PASSES`)."""
    layer, head = elementwise_bytes(shape, spec)
    share = KERNEL_PASSES[spec.kernels]
    forward = tokens * (shape.num_layers * layer + head) * share / kernels.memory_bandwidth
    return forward, 2 * forward


def expert_loop_seconds(shape: ModelShape, spec: RunSpec, tokens: int, kernels: Kernels) -> float:
    """What gym's per-expert loop adds to one micro-batch's forward and backward of a mixture of experts: the host
    launches :data:`EXPERT_KERNELS` kernels per routed expert and layer in forward (three times as many with
    backward); where that takes longer than the device needs for the experts' GEMMs, the device waits."""
    if not shape.is_moe or kernels.launch <= 0:
        return 0.0
    experts = min(shape.num_experts, tokens * shape.experts_per_token)
    host = 3 * EXPERT_KERNELS * experts * shape.num_layers * kernels.launch
    routed = tokens * shape.experts_per_token / shape.num_experts
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    per_expert = gemm_seconds(routed, 2 * inter, h, kernels) + gemm_seconds(routed, h, inter, kernels)
    device = 3 * per_expert * experts * shape.num_layers
    return max(0.0, host - device)


@dataclass(frozen=True)
class ComputeTime:
    """Seconds of one micro-batch's compute on one rank, by pass and by kind (all at the kernels' efficiency).

    ``forward``, ``backward`` and ``recompute`` are the policy's training pass over the stage's sequences (the
    kinds, ``gemm`` to ``experts``, split them); ``reference`` is a reference's forward over every row of the
    micro-batch (a preference stage's, unless precomputed) and ``detached`` the policy's forward without gradient
    over its detached rows (KTO's KL rows): the step's forwards without gradient, :attr:`no_grad`.
    """

    forward: float
    backward: float
    recompute: float
    gemm: float
    attention: float
    memory: float
    experts: float
    reference: float = 0.0
    detached: float = 0.0

    @property
    def no_grad(self) -> float:
        return self.reference + self.detached


def forward_seconds(shape: ModelShape, spec: RunSpec, tokens: int, kernels: Kernels) -> float:
    """One forward of ``tokens`` positions at efficiency 1, no backward: its GEMMs, attention, elementwise work
    and a mixture of experts' loop (its forward third)."""
    gemm, _ = gemm_pass_seconds(layer_gemms(shape, spec, tokens), kernels)
    attention = tokens * attention_flops(shape, spec) / (kernels.peak_flops * kernels.attention_peak)
    memory, _ = memory_bound_seconds(shape, spec, tokens, kernels)
    return gemm + attention + memory + expert_loop_seconds(shape, spec, tokens, kernels) / 3


def no_grad_seconds(shape: ModelShape, spec: RunSpec, kernels: Kernels) -> tuple[float, float]:
    """``(reference, detached)`` seconds of one micro-batch's forwards without gradient, at efficiency 1: a
    reference's over all ``StageKind.rows`` of each example (the base model's GEMMs: a copy has no adapters, and
    peft's ``disable_adapter`` skips theirs) where the run runs one (``RunSpec.no_grad_passes``: not when
    precomputed), and the policy's over its ``detached`` rows."""
    kind, b = spec.training.kind, spec.micro_batch_size
    reference = 0.0
    if spec.reference_hold in ("adapters_off", "copy"):
        base = replace(spec, lora_r=0, lora_target_parameters=())
        reference = forward_seconds(shape, base, local_tokens(spec, b, kind.rows), kernels)
    detached = forward_seconds(shape, spec, local_tokens(spec, b, kind.detached), kernels) if kind.detached else 0.0
    return reference, detached


def micro_batch_compute(shape: ModelShape, spec: RunSpec, kernels: Kernels) -> ComputeTime:
    """The compute of one micro-batch on one rank (this module's docstring lists the terms)."""
    tokens = local_tokens(spec, spec.micro_batch_size)
    gemm_fwd, gemm_bwd = gemm_pass_seconds(layer_gemms(shape, spec, tokens), kernels)
    attention = tokens * attention_flops(shape, spec) / (kernels.peak_flops * kernels.attention_peak)
    mem_fwd, mem_bwd = memory_bound_seconds(shape, spec, tokens, kernels)
    experts = expert_loop_seconds(shape, spec, tokens, kernels)
    forward = gemm_fwd + attention + mem_fwd + experts / 3
    backward = gemm_bwd + 2 * attention + mem_bwd + 2 * experts / 3
    # Activation checkpointing runs the decoder layers' forward again (the LM head and loss are not recomputed).
    head = gemm_seconds(tokens, shape.vocab_size, shape.hidden_size, kernels)
    recompute = (
        forward
        - head
        - tokens * elementwise_bytes(shape, spec)[1] * KERNEL_PASSES[spec.kernels] / (kernels.memory_bandwidth)
    )
    scale = 1.0 / kernels.efficiency
    reference, detached = no_grad_seconds(shape, spec, kernels)
    return ComputeTime(
        forward * scale,
        backward * scale,
        (recompute if spec.activation_checkpointing else 0.0) * scale,
        (gemm_fwd + gemm_bwd) * scale,
        3 * attention * scale,
        (mem_fwd + mem_bwd) * scale,
        experts * scale,
        reference * scale,
        detached * scale,
    )


__all__ = [
    "KERNEL_PASSES",
    "ComputeTime",
    "Gemm",
    "Kernels",
    "TokenFlops",
    "attention_flops",
    "calibrated_efficiency",
    "elementwise_bytes",
    "expert_loop_seconds",
    "flops_per_token",
    "forward_seconds",
    "gemm_pass_seconds",
    "gemm_seconds",
    "layer_gemms",
    "matmul_params",
    "memory_bound_seconds",
    "micro_batch_compute",
    "no_grad_seconds",
]
