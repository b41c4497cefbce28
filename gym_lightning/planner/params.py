"""Parameter counts and bytes of the model under a run's finetuning mode, whatever the strategy (pure, no torch).

Notation (docs/planner.md, "Model"): Ψ parameters (Ψt trainable, Ψf frozen), ``h`` hidden size, ``L`` layers, ``V``
vocabulary. LoRA adds ``r (in + out)`` per adapted linear (``models.shapes.tensor_groups``) and ``r E (in + out)``
per adapted fused expert weight (``planner.experts``).

QLoRA (``quantization="nf4"``): the frozen base's decoder linears are stored in NF4 (``quant.nf4``: 0.5 B of codes
+ 1/64 B of 8-bit block scales + 4·(1 + ceil(in/64/256))/in B of per-row statistics per weight, ≈ 4.13 bits); every
other frozen tensor stays in the model dtype (:func:`frozen_bytes`). Each NF4 layer dequantises its whole weight to
bf16 in forward and again in backward, one layer at a time (:func:`dequant_bytes`); a mixture of experts' fused
expert weights are ``E`` times one NF4Linear's tensors, dequantised one routed expert at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gym_lightning.models.shapes import ModelShape, TensorGroup
from gym_lightning.planner.experts import expert_adapter_groups, nf4_expert_dims
from gym_lightning.planner.spec import RunSpec
from gym_lightning.vocabulary import ZERO3_PERSIST_WIDTHS

# Bytes of optimizer state per trainable parameter, fp32: AdamW momentum + variance; SGD momentum; Adafactor's
# factored second moment is O(rows + cols) per matrix (< 0.1 % of the parameters at these sizes), counted as 0.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "sgd": 4, "adafactor": 0}
# NF4 as gym_lightning.quant stores it (not imported: no torch here): QuantizationArgs' defaults (64 weights per
# block scale, double quantisation on, bf16 compute) and quant.nf4's SCALE_BLOCK (256 block scales per int8 block
# of the second level). tests/planner/test_qlora.py checks these against the quant package.
NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256
NF4_COMPUTE_BYTES = 2
# quant.nf4 (de)quantises 2**20 elements at a time: its int64 code indices (8 B), two fp32 temporaries (4 + 4 B) and
# the unpacked nibbles (1 B) of one chunk, about 17 MiB, whatever the layer's size.
NF4_CHUNK_BYTES = 17 * 2**20


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts that decide the model-state bytes."""

    trainable: int
    frozen: int
    persistent: int  # ZeRO-3: tensors below the persistence threshold stay whole on every rank (NF4 ones excluded)
    largest_unit: int  # largest module gathered at once (an embedding or one decoder layer, with adapters)
    largest_trainable_unit: int  # its trainable part: the gradient unsharded before reduce-scatter
    total_with_adapters: int
    layer: int = 0  # one decoder layer with its adapters


def tensor_groups(shape: ModelShape, spec: RunSpec) -> list[TensorGroup]:
    """Every parameter tensor under ``spec``'s finetuning mode: the shape's own groups (base, and LoRA on the
    ``lora_targets`` linears; ``"none"`` drops those) plus the expert adapters of ``lora_target_parameters``
    (``planner.experts.expert_adapter_groups``)."""
    targets = "all-linear" if spec.lora_targets == "none" else spec.lora_targets
    groups = shape.tensor_groups(spec.lora_r, targets)
    if spec.lora_targets == "none":
        groups = [g for g in groups if not g.name.startswith("lora.")]
    return groups + expert_adapter_groups(shape, spec.lora_r, spec.lora_target_parameters)


def param_counts(shape: ModelShape, spec: RunSpec) -> ParamCounts:
    groups = tensor_groups(shape, spec)
    trainable = sum(g.numel * g.count for g in groups if g.trainable)
    total = sum(g.numel * g.count for g in groups)
    threshold = persistence_threshold(shape, spec)
    nf4 = {f"layer.{name}" for name in nf4_linears(shape, spec)}
    nf4 |= {f"layer.experts.{name}" for name in nf4_experts(shape, spec)}
    persistent = sum(g.numel * g.count for g in groups if g.numel <= threshold and g.name not in nf4)
    in_layer = [g for g in groups if g.name.startswith(("layer.", "lora."))]
    layer = sum(g.numel * g.count for g in in_layer) // shape.num_layers
    budget = spec.zero3_model_persistence_threshold
    if budget is None and spec.zero3_param_persistence_threshold is None:
        budget = layer  # the rule's budget, one decoder layer (strategies.zero.rule)
    if budget is not None:
        # DeepSpeed stops persisting once the total would pass the budget (mark_persistent_parameters walks the
        # parameters in order and skips the ones that do not fit; the sum of the small ones capped at the budget is
        # that walk's result when they are all smaller than what is left, as norms and biases are).
        persistent = min(persistent, budget)
    layer_trainable = sum(g.numel * g.count for g in in_layer if g.trainable) // shape.num_layers
    embedding = shape.embedding_params()
    largest_trainable = max(layer_trainable, embedding if spec.lora_r == 0 else 0)
    largest = max(layer, embedding)
    return ParamCounts(trainable, total - trainable, persistent, largest, largest_trainable, total, layer)


def persistence_threshold(shape: ModelShape, spec: RunSpec) -> int:
    """ZeRO-3's ``stage3_param_persistence_threshold``: the knob, or ZeROStrategy's rule (10 x hidden)."""
    if spec.zero3_param_persistence_threshold is not None:
        return spec.zero3_param_persistence_threshold
    return ZERO3_PERSIST_WIDTHS * shape.hidden_size


def nf4_linears(shape: ModelShape, spec: RunSpec) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of the linear layers of one decoder layer that QLoRA stores in NF4: those whose input width
    divides into blocks (``models.quantized.quantizable``). The LM head and embeddings are not decoder linears, and a
    mixture of experts' router and fused expert tensors are not ``nn.Linear``: all of them stay 16-bit."""
    if spec.quantization == "none":
        return {}
    return {name: dims for name, dims in shape.linear_shapes().items() if dims[0] % NF4_BLOCK == 0}


def nf4_experts(shape: ModelShape, spec: RunSpec) -> dict[str, tuple[int, int]]:
    """``(in, out)`` per expert of the fused expert weights QLoRA stores in NF4 (``quant.experts``): those whose
    input width divides into blocks, except ``spec.skip_expert_weights`` (skip_modules naming ``experts``)."""
    return nf4_expert_dims(shape, spec.quantization != "none", spec.skip_expert_weights, NF4_BLOCK)


def nf4_tensors(fan_in: int, fan_out: int) -> dict[str, tuple[int, int]]:
    """``{parameter: (elements, bytes per element)}`` of one NF4Linear (``quant.nf4.quantized_shapes``, double
    quantisation): uint8 codes ``[out, in/2]``, uint8 block-scale codes ``[out, in/64]``, and the int32 bits of each
    row's scale mean and per-256-scale int8 steps ``[out, 1 + ceil(in/64/256)]``."""
    k = fan_in // NF4_BLOCK
    return {
        "weight": (fan_out * fan_in // 2, 1),
        "weight_scales": (fan_out * k, 1),
        "weight_scale_stats": (fan_out * (1 + math.ceil(k / NF4_SCALE_BLOCK)), 4),
    }


@dataclass(frozen=True)
class QuantizedBase:
    """The NF4 part of a QLoRA base (all zeros without quantisation)."""

    weights: int  # base weights stored in NF4, whole model
    bytes: int  # their codes, scales and statistics
    layer_weights: int  # of one decoder layer
    layer_bytes: int
    persistent_bytes: int  # NF4 tensors under ZeRO-3's persistence threshold (the per-row statistics), whole model
    largest_linear: int  # weights of the largest NF4 layer or of ONE expert: what one dequantisation materialises
    expert_weights: int = 0  # of ``weights``, the fused expert weights (QLoRA experts), whole model

    @property
    def bytes_per_weight(self) -> float:
        return self.bytes / self.weights if self.weights else 0.0


def quantized_base(shape: ModelShape, spec: RunSpec) -> QuantizedBase:
    """The NF4 part of the base: the decoder linears (:func:`nf4_linears`) and, for a mixture of experts, the fused
    expert weights (:func:`nf4_experts`), each an ``[E, out, ...]`` stack of ``E`` NF4 weights of ``[out, in]``
    (row-local: E times one NF4Linear's tensors). One dequantisation materialises one linear or one expert."""
    layers, experts = shape.num_layers, shape.num_experts
    dims = [(1, d) for d in nf4_linears(shape, spec).values()]
    dims += [(experts, d) for d in nf4_experts(shape, spec).values()]
    # Per NF4 tensor of a layer: (elements, bytes per element); an expert stack holds E copies in one tensor.
    tensors = [(count * n, b) for count, (i, o) in dims for n, b in nf4_tensors(i, o).values()]
    layer_weights = sum(count * i * o for count, (i, o) in dims)
    expert_weights = sum(experts * i * o for i, o in nf4_experts(shape, spec).values())
    layer_bytes = sum(n * b for n, b in tensors)
    small = sum(n * b for n, b in tensors if n <= persistence_threshold(shape, spec))
    largest = max((i * o for _, (i, o) in dims), default=0)
    return QuantizedBase(
        layers * layer_weights,
        layers * layer_bytes,
        layer_weights,
        layer_bytes,
        layers * small,
        largest,
        layers * expert_weights,
    )


def frozen_bytes(shape: ModelShape, spec: RunSpec, per_element: int) -> float:
    """Bytes of the frozen weights: ``per_element`` each, except the NF4 ones at their quantised size."""
    quant = quantized_base(shape, spec)
    return per_element * (param_counts(shape, spec).frozen - quant.weights) + quant.bytes


def unit_bytes(shape: ModelShape, spec: RunSpec, per_element: int) -> float:
    """Bytes of the largest unit gathered at once (``ParamCounts.largest_unit``), ``per_element`` each except the
    NF4 weights: FSDP2's mixed precision and DeepSpeed cast floating tensors only, so a quantised layer is gathered
    in 4 bits. Under QLoRA the embedding (16-bit) is then the largest unit of a Llama."""
    return max(layer_bytes(shape, spec, per_element), per_element * shape.embedding_params())


def layer_bytes(shape: ModelShape, spec: RunSpec, per_element: int) -> float:
    """Bytes of one decoder layer with its adapters as a strategy gathers it: ``per_element`` each, the NF4
    weights at their quantised size."""
    counts, quant = param_counts(shape, spec), quantized_base(shape, spec)
    return per_element * (counts.layer - quant.layer_weights) + quant.layer_bytes


def dequant_bytes(shape: ModelShape, spec: RunSpec) -> float:
    """The transient of an NF4 layer's matmul (forward, and again in backward; one layer at a time): its whole
    weight dequantised to bf16, the fp32 block scales ``[out, in/64]`` decoded for it (the decoded scales and the
    two temporaries of decoding them, 3 x 4 B per 64 weights) and one chunk's temporaries."""
    largest = quantized_base(shape, spec).largest_linear
    if largest == 0:
        return 0.0
    return NF4_COMPUTE_BYTES * largest + 12 * largest / NF4_BLOCK + NF4_CHUNK_BYTES
