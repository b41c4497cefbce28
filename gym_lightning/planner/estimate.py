"""Per-GPU and per-node memory of a finetuning step, per strategy: pure formulas, no torch.

Notation (docs/planner.md has the derivations and sources): Ψ parameters (Ψt trainable, Ψf frozen), N data-parallel
ranks, ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``L`` layers, ``V`` vocabulary.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and 5): mixed-precision Adam holds
2Ψ (16-bit parameters) + 2Ψ (16-bit gradients) + KΨ (K = 12: fp32 master, momentum, variance); stage 1 divides
KΨ by N, stage 2 also the gradients, stage 3 also the parameters. Each framework's real layout is used where it
differs from the paper (measured with ``MemoryCallback``): DeepSpeed also converts the gradient partition to fp32
for the step (4Ψ/N, the "18" in its own estimator) and keeps an fp32 master copy even in fp32 training; torch's
DDP and FSDP2 under ``bf16-mixed`` keep fp32 parameters and gradients (16Ψ, no separate master); gym_ddp's
gradients are DDP's reducer buckets (``gradient_as_bucket_view``, zeroed in place), one copy, and one rank has no
buckets at all (``strategies/ddp.py``).

QLoRA (``Setup.quantization="nf4"``): the frozen base's decoder linear layers are stored in NF4 (``quant.nf4``:
0.5 B of codes + 1/64 B of 8-bit block scales + 4·(1 + ceil(in/64/256))/in B of per-row statistics per weight,
≈ 4.13 bits), every other frozen tensor stays in the model dtype; :func:`frozen_bytes` replaces ``fΨf`` by that.
Each NF4 layer dequantises its whole weight to bf16 in forward and again in backward, one layer at a time
(:func:`dequant_bytes`). A mixture of experts' fused expert weights are NF4 too (``[E, out, in]``: E times one
NF4Linear's tensors, :func:`nf4_experts`), dequantised one routed expert at a time; expert LoRA adapters
(``Setup.lora_target_parameters``) are ``r E (in + out)`` trainable parameters per adapted weight and layer
(``planner.experts``; docs/planner.md, "Mixture-of-experts LoRA and QLoRA").

Long sequences (``Setup.sequence_parallel_size`` = sp, ``Setup.mlp_tile_tokens`` = T; docs/planner.md, "Long
sequences"): DeepSpeed Ulysses / ALST sequence parallelism (Jacobs et al. 2023, arXiv 2309.14509; Bekman et al.
2025, arXiv 2506.13996) splits each sequence over sp consecutive ranks, so every per-token term counts the
``ceil(s/sp)`` tokens of one rank (:func:`local_tokens`); the model states stay sharded over all N ranks. Attention
adds the all-to-all buffers (:func:`attention_exchange_bytes`); a tiled MLP keeps its ``[tokens, I]`` intermediates
for at most T tokens at a time (:func:`mlp_tile_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape, TensorGroup
from gym_lightning.planner.experts import (
    expert_adapter_activation_bytes,
    expert_adapter_groups,
    nf4_expert_dims,
)
from gym_lightning.vocabulary import STRATEGY_CLASSES, STRATEGY_PRESET_BY_NAME, ZERO3_PERSIST_WIDTHS, StrategyClass

Precision = Literal["bf16-mixed", "32-true"]
Optimizer = Literal["adamw", "sgd", "adafactor"]
Attention = Literal["sdpa", "eager"]
Accelerator = Literal["gpu", "cpu"]
LossChunking = Literal["auto", "on", "off"]
Quantization = Literal["none", "nf4"]
GradientCompression = Literal["none", "fp16", "bf16", "powersgd"]
# Linear layers LoRA adapts (models.shapes.lora_target_names); "none": only the experts named by
# lora_target_parameters (a run whose lora.target_modules is unset but target_parameters is: lora.resolved_targets).
LoraTargets = Literal["all-linear", "attention-qv", "none"]

GiB = 1024**3
# The module's ``loss_chunking="auto"`` threshold (gym_lightning.loss.CHUNKED_LOSS_MIN_VOCAB; not imported: the
# planner stays free of torch). tests/planner/test_estimate.py checks that the two agree.
CHUNKED_LOSS_MIN_VOCAB = 65_536
# ZeROStrategy's bucket size when the module states no layer size (and DeepSpeed's own configs' usual value).
DEFAULT_ZERO_BUCKET = 200_000_000
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
class Strategy:
    """One way to train: how it shards and offloads, and how to select it in gym_lightning."""

    key: str
    label: str
    trainer_strategy: str
    framework: Literal["torch", "deepspeed"]
    stage: int  # ZeRO stage equivalent: 0 replicate, 1 optimizer, 2 + gradients, 3 + parameters
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    offload_parameters: Literal["none", "cpu", "nvme"] = "none"
    keep_gathered: bool = False  # FSDP grad_op: gathered parameters live from forward to backward
    ddp: bool = False  # gym_ddp: its gradients are DDP's buckets (FSDP "none" also has stage 0 and keeps its term)
    hybrid: bool = False  # FSDP hybrid: sharded within a node, replicated across nodes
    # What selects it (trainer.strategy): a registered name, else the family's class with these init args.
    name: str | None = None
    family: StrategyClass | None = None
    init_args: tuple[tuple[str, Any], ...] = ()

    def trainer_config(self) -> str | dict[str, Any] | None:
        """``trainer.strategy`` that selects it: the registered name, else ``{"class_path", "init_args"}``; ``None``
        for a row that no gym_lightning strategy stands for."""
        if self.name is not None:
            return self.name
        if self.family is None:
            return None
        return {"class_path": STRATEGY_CLASSES[self.family], "init_args": dict(self.init_args)}


def planner_strategy(
    key: str, label: str, strategy_class: StrategyClass, init_args: Mapping[str, Any], name: str | None = None
) -> Strategy:
    """How gym_lightning's ``strategy_class`` with ``init_args`` shards and offloads, as the planner models it.

    Args:
        key: The planner's key of the row.
        label: Its label in the table.
        strategy_class: ``"ddp"``, ``"fsdp"`` or ``"zero"`` (``vocabulary.STRATEGY_CLASSES``).
        init_args: The strategy's arguments: FSDP's ``sharding`` (``grad_op`` keeps gathered parameters from forward
            to backward; ``none`` replicates) and ``cpu_offload``; ZeRO's ``stage`` and ``offload_*``.
        name: The registered name that selects it, if any; else it is shown as the class with its arguments.
    """
    arguments = ", ".join(f"{k}={v!r}" for k, v in init_args.items())
    shown = name or f"{STRATEGY_CLASSES[strategy_class].rsplit('.', 1)[-1]}({arguments})"
    selects: dict[str, Any] = {"name": name, "family": strategy_class, "init_args": tuple(init_args.items())}
    if strategy_class == "ddp":
        return Strategy(key, label, shown, "torch", 0, ddp=True, **selects)
    if strategy_class == "fsdp":
        sharding, offload = init_args.get("sharding", "full"), "cpu" if init_args.get("cpu_offload") else "none"
        stage = 0 if sharding == "none" else 3
        return Strategy(
            key,
            label,
            shown,
            "torch",
            stage,
            offload,
            offload,
            keep_gathered=sharding == "grad_op",
            hybrid=sharding == "hybrid",
            **selects,
        )
    offloads = (init_args.get("offload_optimizer", "none"), init_args.get("offload_parameters", "none"))
    return Strategy(key, label, shown, "deepspeed", int(init_args["stage"]), *offloads, **selects)


def _planned(key: str, label: str, preset: str | tuple[StrategyClass, dict[str, Any]]) -> Strategy:
    """A row of the planner's list: a registered preset (by name) or a strategy class with its arguments."""
    if isinstance(preset, str):
        found = STRATEGY_PRESET_BY_NAME[preset]
        return planner_strategy(key, label, found.strategy_class, found.init_args, name=found.name)
    return planner_strategy(key, label, *preset)


# Ordered by expected speed, fastest first (docs/planner.md, "Recommendation", says why). Every registered name
# (gym_lightning.vocabulary.STRATEGY_PRESETS) is a row, with the shape the name stands for (tests check both).
STRATEGIES: tuple[Strategy, ...] = (
    _planned("ddp", "DDP", "gym_ddp"),
    _planned("zero1", "ZeRO-1", "zero1"),
    _planned("zero2", "ZeRO-2", "zero2"),
    _planned("fsdp_grad_op", "FSDP grad_op", ("fsdp", {"sharding": "grad_op"})),
    _planned("fsdp_full", "FSDP full", "gym_fsdp"),
    _planned("zero3", "ZeRO-3", "zero3"),
    _planned("zero2_offload", "ZeRO-2 + CPU optimizer", "zero2_offload"),
    _planned("zero3_offload_optimizer", "ZeRO-3 + CPU optimizer", ("zero", {"stage": 3, "offload_optimizer": "cpu"})),
    _planned("fsdp_offload", "FSDP full + CPU offload", ("fsdp", {"cpu_offload": True})),
    _planned("zero3_offload", "ZeRO-3 + CPU optimizer + params", "zero3_offload"),
    _planned("zero_infinity", "ZeRO-Infinity (NVMe)", "zero_infinity"),
)
STRATEGY_KEYS: tuple[str, ...] = tuple(s.key for s in STRATEGIES)
STRATEGY_BY_KEY: dict[str, Strategy] = {s.key: s for s in STRATEGIES}


@dataclass(frozen=True)
class Setup:
    """Hardware and training settings (see ``gym_lightning.planner.plan`` for each argument)."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory: int = 80 * 10**9
    host_memory: int = 1024 * GiB
    precision: Precision = "bf16-mixed"
    micro_batch_size: int = 1
    seq_length: int = 2048
    activation_checkpointing: bool = False
    lora_r: int = 0
    lora_targets: LoraTargets = "all-linear"
    optimizer: Optimizer = "adamw"
    attention: Attention = "sdpa"
    bucket_size: int | None = None  # ZeROStrategy's: None = one decoder layer's elements (derived_bucket_size)
    # ZeRO-3 persistence; None: ZeROStrategy's rule (strategies.zero.rule): tensors of at most 10 x hidden elements,
    # within a budget of one decoder layer's elements per rank (stage3_model_persistence_threshold)
    zero3_param_persistence_threshold: int | None = None
    sub_group_size: int | None = None  # ZeRO-3 optimizer sub-group; None = one decoder layer, as ZeROStrategy sets
    cuda_reserved: int = GiB  # CUDA context, NCCL and cuBLAS workspaces: never available to tensors
    fragmentation: float = 0.05  # share of the rest lost to the caching allocator's fragmentation
    host_process_overhead: int = 3 * GiB  # host RSS of one training process before any model (torch, CUDA, NCCL)
    accelerator: Accelerator = "gpu"  # "cpu": ranks train on the host, every byte is host memory (phases.py)
    checkpoint_dtype_bytes: int = 2  # bytes per element of the pretrained files (bf16 on the Hub) and of the export
    checkpoint_file_bytes: int = 5 * 10**9  # largest safetensors file of the checkpoint (the Hub's usual 5 GB shards)
    loss_chunking: LossChunking = "auto"  # CausalLMModule(loss_chunking=...): auto chunks from 65,536 tokens of vocab
    loss_chunk_tokens: int = 1024  # CausalLMModule(loss_chunk_tokens=...)
    quantization: Quantization = "none"  # "nf4": QLoRA, the frozen base's decoder linears in 4-bit NF4 (lora_r > 0)
    # lora.target_parameters: the fused expert weights adapted ("all-experts", peft names such as
    # experts.gate_up_proj; planner.experts); () = none
    lora_target_parameters: tuple[str, ...] = ()
    # Fused expert weights a QLoRA base keeps in 16 bits (quantization.skip_modules; planner.experts); the rest NF4
    skip_expert_weights: tuple[str, ...] = ()
    sequence_parallel_size: int = 1  # the strategies' sequence_parallel_size: ranks that share one sequence (Ulysses)
    mlp_tile_tokens: int = 0  # CausalLMModule(mlp_tile_tokens=...): tokens per tiled-MLP step; 0 = not tiled
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step (Trainer(accumulate_grad_batches=...))
    gradient_compression: GradientCompression = "none"  # gym_ddp / gym_fsdp's: how gradients travel (step time)
    powersgd_rank: int = 1  # gym_ddp's powersgd_rank

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def data_parallel_size(self) -> int:
        """Groups that train different sequences: ``N / sp`` (the global batch is micro-batch x accumulation x this).
        ZeRO / FSDP still shard the model states over all N ranks."""
        return self.world_size // self.sequence_parallel_size

    @property
    def local_seq_length(self) -> int:
        """Tokens of one sequence on one rank: the runtime pads ``s`` to a multiple of sp, each rank holds 1/sp."""
        return -(-self.seq_length // self.sequence_parallel_size)

    @property
    def usable_gpu_memory(self) -> int:
        return int((self.gpu_memory - self.cuda_reserved) * (1 - self.fragmentation))


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


def tensor_groups(shape: ModelShape, setup: Setup) -> list[TensorGroup]:
    """Every parameter tensor under ``setup``'s finetuning mode: the shape's own groups (base, and LoRA on the
    ``lora_targets`` linears; ``"none"`` drops those) plus the expert adapters of ``lora_target_parameters``
    (``planner.experts.expert_adapter_groups``)."""
    targets = "all-linear" if setup.lora_targets == "none" else setup.lora_targets
    groups = shape.tensor_groups(setup.lora_r, targets)
    if setup.lora_targets == "none":
        groups = [g for g in groups if not g.name.startswith("lora.")]
    return groups + expert_adapter_groups(shape, setup.lora_r, setup.lora_target_parameters)


def param_counts(shape: ModelShape, setup: Setup) -> ParamCounts:
    groups = tensor_groups(shape, setup)
    trainable = sum(g.numel * g.count for g in groups if g.trainable)
    total = sum(g.numel * g.count for g in groups)
    threshold = persistence_threshold(shape, setup)
    nf4 = {f"layer.{name}" for name in nf4_linears(shape, setup)}
    nf4 |= {f"layer.experts.{name}" for name in nf4_experts(shape, setup)}
    persistent = sum(g.numel * g.count for g in groups if g.numel <= threshold and g.name not in nf4)
    in_layer = [g for g in groups if g.name.startswith(("layer.", "lora."))]
    layer = sum(g.numel * g.count for g in in_layer) // shape.num_layers
    if setup.zero3_param_persistence_threshold is None:
        # The rule's budget: DeepSpeed stops persisting once the total would pass it (mark_persistent_parameters
        # walks the parameters in order and skips the ones that do not fit; the sum of the small ones capped at the
        # budget is that walk's result when they are all smaller than what is left, as norms and biases are).
        persistent = min(persistent, layer)
    layer_trainable = sum(g.numel * g.count for g in in_layer if g.trainable) // shape.num_layers
    embedding = shape.embedding_params()
    largest_trainable = max(layer_trainable, embedding if setup.lora_r == 0 else 0)
    largest = max(layer, embedding)
    return ParamCounts(trainable, total - trainable, persistent, largest, largest_trainable, total, layer)


def persistence_threshold(shape: ModelShape, setup: Setup) -> int:
    """ZeRO-3's ``stage3_param_persistence_threshold``: ``Setup``'s, or ZeROStrategy's rule (10 x hidden)."""
    if setup.zero3_param_persistence_threshold is not None:
        return setup.zero3_param_persistence_threshold
    return ZERO3_PERSIST_WIDTHS * shape.hidden_size


def nf4_linears(shape: ModelShape, setup: Setup) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of the linear layers of one decoder layer that QLoRA stores in NF4: those whose input width
    divides into blocks (``models.quantized.quantizable``). The LM head and embeddings are not decoder linears, and a
    mixture of experts' router and fused expert tensors are not ``nn.Linear``: all of them stay 16-bit."""
    if setup.quantization == "none":
        return {}
    return {name: dims for name, dims in shape.linear_shapes().items() if dims[0] % NF4_BLOCK == 0}


def nf4_experts(shape: ModelShape, setup: Setup) -> dict[str, tuple[int, int]]:
    """``(in, out)`` per expert of the fused expert weights QLoRA stores in NF4 (``quant.experts``): those whose
    input width divides into blocks, except ``Setup.skip_expert_weights`` (skip_modules naming ``experts``)."""
    return nf4_expert_dims(shape, setup.quantization != "none", setup.skip_expert_weights, NF4_BLOCK)


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


def quantized_base(shape: ModelShape, setup: Setup) -> QuantizedBase:
    """The NF4 part of the base: the decoder linears (:func:`nf4_linears`) and, for a mixture of experts, the fused
    expert weights (:func:`nf4_experts`), each an ``[E, out, ...]`` stack of ``E`` NF4 weights of ``[out, in]``
    (row-local: E times one NF4Linear's tensors). One dequantisation materialises one linear or one expert."""
    layers, experts = shape.num_layers, shape.num_experts
    dims = [(1, d) for d in nf4_linears(shape, setup).values()]
    dims += [(experts, d) for d in nf4_experts(shape, setup).values()]
    # Per NF4 tensor of a layer: (elements, bytes per element); an expert stack holds E copies in one tensor.
    tensors = [(count * n, b) for count, (i, o) in dims for n, b in nf4_tensors(i, o).values()]
    layer_weights = sum(count * i * o for count, (i, o) in dims)
    expert_weights = sum(experts * i * o for i, o in nf4_experts(shape, setup).values())
    layer_bytes = sum(n * b for n, b in tensors)
    small = sum(n * b for n, b in tensors if n <= persistence_threshold(shape, setup))
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


def frozen_bytes(shape: ModelShape, setup: Setup, per_element: int) -> float:
    """Bytes of the frozen weights: ``per_element`` each, except the NF4 ones at their quantised size."""
    quant = quantized_base(shape, setup)
    return per_element * (param_counts(shape, setup).frozen - quant.weights) + quant.bytes


def unit_bytes(shape: ModelShape, setup: Setup, per_element: int) -> float:
    """Bytes of the largest unit gathered at once (``ParamCounts.largest_unit``), ``per_element`` each except the
    NF4 weights: FSDP2's mixed precision and DeepSpeed cast floating tensors only, so a quantised layer is gathered
    in 4 bits. Under QLoRA the embedding (16-bit) is then the largest unit of a Llama."""
    return max(layer_bytes(shape, setup, per_element), per_element * shape.embedding_params())


def layer_bytes(shape: ModelShape, setup: Setup, per_element: int) -> float:
    """Bytes of one decoder layer with its adapters as a strategy gathers it: ``per_element`` each, the NF4
    weights at their quantised size."""
    counts, quant = param_counts(shape, setup), quantized_base(shape, setup)
    return per_element * (counts.layer - quant.layer_weights) + quant.layer_bytes


def fsdp_root_params(shape: ModelShape) -> int:
    """Parameters of gym_fsdp's largest vocabulary unit, gathered at once: one ``[vocab, hidden]`` matrix. A tied
    embedding and LM head (one weight) stay in the model's root unit, gathered from the start of forward to the end
    of backward; untied, each is a unit of its own (``strategies.fsdp.vocabulary_units``): the embedding gathered
    for its forward and again for its backward, the head kept from its forward to the end of backward
    (:func:`fsdp_kept_head_params`). ``ParamCounts.largest_unit`` counts the embedding alone too."""
    return shape.embedding_params()


def fsdp_kept_head_params(shape: ModelShape) -> int:
    """Parameters of the untied LM head gym_fsdp keeps gathered from the end of forward to the end of backward
    (``strategies.fsdp``: a chunked loss calls it once per chunk); 0 when tied (the root unit holds the one weight,
    :func:`fsdp_root_params`)."""
    return 0 if shape.tied_embeddings else shape.embedding_params()


def dequant_bytes(shape: ModelShape, setup: Setup) -> float:
    """The transient of an NF4 layer's matmul (forward, and again in backward; one layer at a time): its whole
    weight dequantised to bf16, the fp32 block scales ``[out, in/64]`` decoded for it (the decoded scales and the
    two temporaries of decoding them, 3 x 4 B per 64 weights) and one chunk's temporaries."""
    largest = quantized_base(shape, setup).largest_linear
    if largest == 0:
        return 0.0
    return NF4_COMPUTE_BYTES * largest + 12 * largest / NF4_BLOCK + NF4_CHUNK_BYTES


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU of parameters, gradients and optimizer state (fp32 master weights included), and what one
    rank keeps in host memory and on NVMe."""

    params: float
    grads: float
    optimizer_state: float
    host: float = 0.0
    nvme: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_state


def dtype_bytes(strategy: Strategy, setup: Setup) -> tuple[int, int, int, int]:
    """``(trainable param, frozen param, master, fp32 gradient copy)`` bytes per element.

    DeepSpeed stores the model in 16 bits under bf16 and keeps fp32 masters (even in fp32 training, where it still
    copies them); its ZeRO optimizers convert the 16-bit gradient partition to an fp32 copy for the step. torch AMP
    (DDP, FSDP2 with ``bf16-mixed``) keeps trainable parameters and gradients in fp32 and casts for compute.
    Frozen (LoRA base) weights are loaded in the compute dtype."""
    half = setup.precision == "bf16-mixed"
    frozen = 2 if half else 4
    if strategy.framework == "torch":
        return 4, frozen, 0, 0
    return (2, frozen, 4, 4) if half else (4, frozen, 4, 0)


def model_states(shape: ModelShape, strategy: Strategy, setup: Setup) -> ModelStates:
    """Per-GPU model-state bytes; the optimizer-state column includes fp32 master weights."""
    counts = param_counts(shape, setup)
    n, t = setup.gpus_per_node if strategy.hybrid else setup.world_size, counts.trainable
    p, pf, master, fp32_grad = dtype_bytes(strategy, setup)
    base = frozen_bytes(shape, setup, pf)  # pf x the frozen count, or less with an NF4 base
    opt = OPTIMIZER_STATE_BYTES[setup.optimizer] + master  # per trainable parameter, to be sharded from stage 1
    if strategy.stage == 3:
        persistent = 0.0
        if strategy.framework == "deepspeed":
            persistent = counts.persistent * p + quantized_base(shape, setup).persistent_bytes
        params = (p * t + base) / n + persistent
    else:
        params = p * t + base
    grads = p * t if strategy.stage <= 1 else p * t / n
    if strategy.stage >= 1:
        grads += fp32_grad * _fp32_grad_elements(t / n, strategy, shape, setup)
    states = opt * t / n if strategy.stage >= 1 else opt * t
    if strategy.offload_optimizer == "none":
        return ModelStates(params, grads, states)
    # Offloaded optimizer: the fp32 gradient partition, masters and states live on the host (or NVMe); the device
    # keeps the 16-bit parameters (stage 2) or their partition (stage 3) and streams gradients out per bucket.
    # Parameter offload moves the parameter partition too (DeepSpeed keeps its small persistent tensors on device).
    offloaded = states + 4 * t / n
    if strategy.offload_parameters != "none":
        offloaded += (p * t + base) / n
        params = counts.persistent * p if strategy.framework == "deepspeed" else 0.0
    host, nvme = (offloaded, 0.0) if strategy.offload_optimizer == "cpu" else (0.0, offloaded)
    return ModelStates(params, 0.0, 0.0, host, nvme)


def _fp32_grad_elements(partition: float, strategy: Strategy, shape: ModelShape, setup: Setup) -> float:
    """ZeRO-3 converts one optimizer sub-group at a time to fp32: ``sub_group_size`` elements, which ZeROStrategy sets
    to one decoder layer (``strategies.zero.sizing.layer_sized_sub_group``; DeepSpeed's own default is 1e9)."""
    if strategy.stage != 3:
        return partition
    return min(partition, shape.layer_params() if setup.sub_group_size is None else setup.sub_group_size)


def _is_int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def sequence_parallel_problems(shape: ModelShape | None, setup: Setup) -> list[str]:
    """Every reason ``setup`` cannot run sequence parallelism / a tiled MLP on ``shape`` (empty when it can; the
    head checks are skipped when ``shape`` is None). The runtime refuses the same settings
    (``strategies/sequence.world_problems`` and ``model_problems``): the ranks must form
    whole groups of sp, Ulysses hands each rank ``heads/sp`` query heads and ``kv/sp`` key/value heads (or one
    replicated kv head when kv divides sp; DeepSpeed's ``UlyssesSPAttentionHF`` has the same rule), and eager
    attention would materialise the ``s x s`` scores of the whole sequence. A length that sp does not divide is
    padded (``Setup.local_seq_length``), not refused."""
    sp, problems = setup.sequence_parallel_size, []
    if not _is_int(setup.mlp_tile_tokens, 0):
        problems.append(f"mlp_tile_tokens must be an integer >= 0 (0 = MLP not tiled), got {setup.mlp_tile_tokens!r}")
    if not _is_int(sp, 1):
        return [f"sequence_parallel_size must be an integer >= 1, got {sp!r}", *problems]
    if sp == 1:
        return problems
    world = setup.world_size if _is_int(setup.gpus_per_node, 1) and _is_int(setup.nodes, 1) else 0
    if world and world % sp:
        problems.append(
            f"sequence_parallel_size {sp} does not divide the {world} GPUs into whole groups: use a divisor of {world}"
        )
    if shape is not None:
        problems += _head_problems(shape, sp)
    if setup.attention == "eager":
        problems.append(
            "attention eager stores the s x s scores, which sequence parallelism refuses: use attention sdpa"
        )
    return problems


def _head_problems(shape: ModelShape, sp: int) -> list[str]:
    problems = []
    if shape.num_heads % sp:
        problems.append(
            f"{shape.name} has {shape.num_heads} attention heads, not divisible by sequence_parallel_size {sp}: use a "
            f"divisor of {shape.num_heads}"
        )
    kv = shape.num_kv_heads
    if kv % sp and sp % kv:
        problems.append(
            f"{shape.name} has {kv} key/value heads, neither a multiple nor a divisor of sequence_parallel_size "
            f"{sp}: use an sp that divides {kv} or that {kv} divides"
        )
    return problems


def check_setup(shape: ModelShape, setup: Setup) -> None:
    """Raise one :class:`GymUserError` (a ``ValueError``) listing every :func:`sequence_parallel_problems`."""
    problems = sequence_parallel_problems(shape, setup)
    if problems:
        raise GymUserError("Invalid planner settings: " + "; ".join(problems) + ".")


def local_tokens(setup: Setup, micro_batch: int) -> int:
    """Token positions one rank computes per forward: ``b x ceil(s / sp)``. Under sequence parallelism each rank
    holds ``s/sp`` consecutive tokens of a sequence (the runtime pads ``s`` to a multiple of sp); every per-token
    activation, the logits and the chunked loss count these, not ``s``."""
    return micro_batch * setup.local_seq_length


def sp_kv_width(shape: ModelShape, setup: Setup) -> int:
    """Key/value width per token as the attention sees it under sequence parallelism: ``max(kv heads, sp) x
    head_dim``. Ulysses gives each rank ``heads/sp`` heads of the whole sequence; with fewer kv heads than sp
    ranks (GQA) the kv heads are first replicated to sp heads, one per rank (as DeepSpeed's ``UlyssesSPAttentionHF``
    does: ``repeat_interleave(sp // kv)`` in ``runtime/sequence_parallel/ulysses_sp.py``). At sp = 1 this is the
    model's kv width."""
    return max(shape.num_kv_heads, setup.sequence_parallel_size) * shape.head_dim


def saved_kv_width(shape: ModelShape, setup: Setup) -> int:
    """Width per token of each of k and v as the attention saves them for backward. Both transformers' sdpa (sp = 1;
    the planner assumes no padding mask, which would make it repeat them) and gym_lightning's exchange
    (``strategies/sequence.causal_attention``) run grouped-query attention inside sdpa (``enable_gqa``), so k and
    v are saved at the kv width; under sequence parallelism that is the width after the exchange replicated fewer
    kv heads than ranks (:func:`sp_kv_width`)."""
    return sp_kv_width(shape, setup)


def mlp_tiles(shape: ModelShape, setup: Setup, micro_batch: int) -> int:
    """Tiles each dense MLP runs in for ``micro_batch`` (``CausalLMModule(mlp_tile_tokens=T)``, T > 0):
    ``ceil(b s/sp / T)``, as ``models.tiling.num_mlp_tiles`` counts them. 1 means untiled: without T, for a mixture
    of experts (``models.tiling.dense_mlps`` leaves its expert block alone), and when the rank's tokens fit one tile
    (the module then runs the plain MLP, which saves its intermediates as usual)."""
    if setup.mlp_tile_tokens <= 0 or shape.is_moe:
        return 1
    return -(-local_tokens(setup, micro_batch) // setup.mlp_tile_tokens)


def _mlp_bytes_per_token(shape: ModelShape, a_b: int) -> int:
    """What the MLP saves for backward per token: the SwiGLU's gate, SiLU output, up and product (``4 a_b I``), or a
    mixture of experts' routed inputs, outputs and SwiGLU terms and its router (see activation_bytes_per_layer)."""
    if not shape.is_moe:
        return 4 * a_b * shape.intermediate_size
    expert = 2 * a_b * shape.hidden_size + 4 * a_b * shape.moe_intermediate_size
    return shape.experts_per_token * expert + (a_b + 4) * shape.num_experts


def activation_bytes_per_layer(shape: ModelShape, setup: Setup, micro_batch: int) -> float:
    """Bytes one decoder layer saves for backward (Korthikanti et al. 2022, Sec. 4.1, redone for Llama-style layers).

    The paper's ``sbh(34 + 5as/h)`` is for a GPT layer (LayerNorm, GELU MLP of width 4h, dropout, attention scores
    materialised). A Hugging Face Llama/Qwen layer in 16-bit activations instead saves, per token:
    two RMSNorms, each ``4h`` (the fp32 upcast) + ``2h`` (normalised, for the weight's gradient) + ``2h`` (output,
    the next linear's input); the rotated q, k, v (``2(q + 2kv)``); the attention output and o_proj's input
    (``4q``); the SwiGLU's gate, SiLU output, up and product (``8I``); no dropout masks (dropout is 0). SDPA
    (flash / memory-efficient) keeps only an fp32 log-sum-exp per head (``4a``) instead of the ``5as`` scores term;
    eager attention stores the fp32 softmax and its 16-bit copy (``6as``). In fp32 every 16-bit term doubles.

    A mixture of experts (transformers 5's expert loop, ``Qwen3MoeExperts.forward``) saves, per token, the router's
    logits and fp32 softmax (``(a_b + 4)E``) and, for each of its ``k`` experts, the gathered input and the weighted
    output (``2 a_b h``) and the expert's SwiGLU terms (``4 a_b I``): the SwiGLU's ``4 a_b I`` becomes
    ``k(2 a_b h + 4 a_b I) + (a_b + 4)E``. Derived from the code, not yet checked against a measured MoE peak.

    Per rank under sequence parallelism: the same terms for the rank's ``s/sp`` tokens (:func:`local_tokens`). The
    attention's saved q, output and log-sum-exp are ``s x heads/sp``, the same element count as ``s/sp x heads``;
    k and v are saved at the kv width, or at ``sp`` heads where the exchange replicated fewer (:func:`saved_kv_width`).
    A tiled MLP saves no ``[tokens, I]`` intermediates (each tile is recomputed in backward; :func:`mlp_tile_bytes`
    is its transient).
    """
    h, q, kv = shape.hidden_size, shape.q_width, saved_kv_width(shape, setup)
    a_b = 2 if setup.precision == "bf16-mixed" else 4
    mlp = 0 if mlp_tiles(shape, setup, micro_batch) > 1 else _mlp_bytes_per_token(shape, a_b)
    mlp += expert_adapter_activation_bytes(shape, setup.lora_r, setup.lora_target_parameters, a_b)
    per_token = 2 * (4 * h + 2 * a_b * h) + a_b * (q + 2 * kv) + 2 * a_b * q + mlp + 4 * shape.num_heads
    if setup.attention == "eager":  # refused under sp > 1 (sequence_parallel_problems): s is the whole sequence
        per_token += (4 + a_b) * shape.num_heads * setup.seq_length
    return float(per_token * local_tokens(setup, micro_batch))


def attention_exchange_bytes(shape: ModelShape, setup: Setup, micro_batch: int) -> float:
    """The Ulysses all-to-all buffers of one layer's attention (0 without sequence parallelism): q, k, v go out
    as ``s/sp x heads`` and come back as ``s x heads/sp`` (the same elements), the output the other way; send and
    receive buffers of all four, ``2 a_b (2q + 2kv') x local tokens`` with ``kv'`` = :func:`sp_kv_width`. One layer
    exchanges at a time (in forward and in the backward recompute), so the term is counted once, not per layer.

    Read from ``strategies/sequence.ulysses_attention``: while the output is exchanged back, a rank holds beside
    what is saved the local rotated q, k, v (its arguments, ``q + 2kv'``), the whole-sequence k, v before their
    repeat (``2kv'``) and the output's send, receive and reordered copies (``3q``): ``4q + 4kv'`` elements a token,
    the same figure."""
    if setup.sequence_parallel_size == 1:
        return 0.0
    a_b = 2 if setup.precision == "bf16-mixed" else 4
    elements = 2 * shape.q_width + 2 * sp_kv_width(shape, setup)
    return float(2 * a_b * elements * local_tokens(setup, micro_batch))


def mlp_tile_bytes(shape: ModelShape, setup: Setup, micro_batch: int) -> float:
    """A tiled MLP's transient (0 untiled): one tile's SwiGLU intermediates, ``4 a_b I x ceil(t / tiles)`` (at most
    ``4 a_b I T``; ``tensor_split`` makes the tiles this even). Each tile runs under non-reentrant activation
    checkpointing, so these exist for one tile of one layer at a time, in forward and again when the tile is
    recomputed in backward (as ALST's ``TiledMLP`` in DeepSpeed's ``runtime/sequence_parallel/ulysses_sp.py``,
    whose tiles are about ``h`` tokens: ``ceil(s / h)`` shards)."""
    tiles = mlp_tiles(shape, setup, micro_batch)
    if tiles == 1:
        return 0.0
    a_b = 2 if setup.precision == "bf16-mixed" else 4
    return float(4 * a_b * shape.intermediate_size * -(-local_tokens(setup, micro_batch) // tiles))


def activation_bytes(shape: ModelShape, setup: Setup, micro_batch: int) -> float:
    """Activations of the whole stack. With activation checkpointing (full recomputation per decoder layer, the
    paper's ``2sbhL``) only each layer's input is kept, plus one layer's activations while it is recomputed. Plus
    the one-layer-at-a-time transients: the attention exchange under sequence parallelism and one MLP tile."""
    a_b = 2 if setup.precision == "bf16-mixed" else 4
    tokens = local_tokens(setup, micro_batch)
    one_layer = activation_bytes_per_layer(shape, setup, micro_batch)
    transient = attention_exchange_bytes(shape, setup, micro_batch) + mlp_tile_bytes(shape, setup, micro_batch)
    if setup.activation_checkpointing:
        return shape.num_layers * a_b * shape.hidden_size * tokens + one_layer + transient
    return shape.num_layers * one_layer + (4 + a_b) * shape.hidden_size * tokens + transient  # + the final RMSNorm


def loss_chunked(shape: ModelShape, setup: Setup) -> bool:
    """Whether the module computes the LM head and the loss in chunks (``CausalLMModule.loss_chunking``)."""
    if setup.loss_chunking == "auto":
        return shape.vocab_size >= CHUNKED_LOSS_MIN_VOCAB
    return setup.loss_chunking == "on"


def logits_bytes(shape: ModelShape, setup: Setup, micro_batch: int) -> float:
    """The LM head's output and the loss: logits in the compute dtype, their fp32 upcast (the loss computes in fp32)
    and the fp32 log-softmax cross-entropy keeps for backward, ``(a_b + 4 + 4)`` bytes per position and vocabulary
    entry. Unchunked that is the whole ``[s b, V]`` (often the single largest activation: V = 128k-152k for Llama 3
    / Qwen). Chunked (``gym_lightning.loss``), each chunk of ``loss_chunk_tokens`` positions runs under activation
    checkpointing, so only one chunk's logits exist at a time, in forward and again when recomputed in backward."""
    a_b = 2 if setup.precision == "bf16-mixed" else 4
    positions = local_tokens(setup, micro_batch)  # under sequence parallelism each rank's loss covers its s/sp tokens
    if loss_chunked(shape, setup):
        positions = min(positions, setup.loss_chunk_tokens)
    return float(positions * shape.vocab_size * (a_b + 8))


def zero_bucket_elements(shape: ModelShape, setup: Setup) -> int:
    """Elements of DeepSpeed's reduce bucket: ``Setup.bucket_size``, by default (None) one decoder layer, as
    ``ZeROStrategy`` derives it (``strategies.zero.sizing.derived_bucket_size``), capped at the model's size."""
    size = shape.layer_params() if setup.bucket_size is None else setup.bucket_size
    return min(size, param_counts(shape, setup).total_with_adapters)


def buffer_bytes(shape: ModelShape, strategy: Strategy, setup: Setup) -> float:
    """Temporary buffers: gathered parameters / unsharded gradients of the units in flight (ZeRO-3, FSDP), the
    communication buckets (DeepSpeed reduce bucket, DDP reducer buckets), torch autocast's 16-bit weight copies
    and, under QLoRA, one NF4 layer's dequantised weight (:func:`dequant_bytes`)."""
    return _strategy_buffers(shape, strategy, setup) + dequant_bytes(shape, setup)


def _strategy_buffers(shape: ModelShape, strategy: Strategy, setup: Setup) -> float:
    counts = param_counts(shape, setup)
    half = setup.precision == "bf16-mixed"
    compute = 2 if half else 4
    if strategy.framework == "torch" and strategy.stage == 0:
        # Autocast caches a 16-bit copy of each weight it casts until backward has used it (one layer's worth under
        # activation checkpointing). NF4 weights are never cast: their layer dequantises them itself and frees the
        # copy after the matmul. gym_ddp's reducer buckets are its gradients (model_states counts them; one rank has
        # none): issue 47 measured 6.6 GiB of buckets beside the gradients at 1.72B when they were a second copy.
        layers = shape.num_layers * shape.layer_params() - quantized_base(shape, setup).weights
        casts = 0 if setup.activation_checkpointing or not half else 2 * layers
        return resident_bucket_copy(strategy, counts.trainable) + casts
    if strategy.framework == "torch":
        # FSDP2: the unit in use and the one prefetched (or its all-gather output, which exists beside the unsharded
        # parameters until they are copied out), gathered in the compute dtype; one unit's unsharded fp32 gradient
        # before reduce-scatter. grad_op keeps every unit gathered from forward until its backward. The largest unit
        # may be a vocabulary unit (fsdp_root_params); an untied LM head stays gathered through backward beside the
        # layers and the embedding's second gathering (fsdp_kept_head_params).
        whole = compute * counts.trainable + frozen_bytes(shape, setup, compute)
        root, kept = fsdp_root_params(shape), compute * fsdp_kept_head_params(shape)
        layer = layer_bytes(shape, setup, compute)
        if strategy.keep_gathered:
            gathered = whole
        elif setup.accelerator == "cpu":
            # gloo receives into a temporary of the gathered size (ZeRO-3's note below), so the largest unit's
            # all-gather, not its copy-out, is the peak: its output and gloo's copy beside the previous forward's last
            # all-gather output, which FSDP2 frees only at the next forward unit's copy-out (FSDPParamGroup.
            # wait_for_unshard; at 0.4B MoE QLoRA the step peaks there, in the root's all_gather_single).
            gathered = kept + 2 * max(unit_bytes(shape, setup, compute), compute * root) + layer
        else:
            # NCCL gathers in place: the vocabulary unit kept gathered through backward (a tied pair in the root, or
            # the untied head) beside the layer in use and the one prefetched, or beside the embedding gathered for
            # its backward (at least the two largest units, the rule before the root was counted)
            resident = compute * root
            gathered = max(resident + 2 * layer, compute * root + kept, 2 * unit_bytes(shape, setup, compute))
        return gathered + 4 * max(counts.largest_trainable_unit, root if setup.lora_r == 0 else 0)
    p = 2 if half else 4
    bucket = p * zero_bucket_elements(shape, setup)
    if strategy.stage < 3:
        # Stage 2 overlaps reduction with backward (overlap_comm): two buckets, one filling while one is reduced.
        return float(bucket * (2 if strategy.stage == 2 else 1))
    # ZeRO-3: a gathered working set of about two units (current + prefetch) and one unit's full gradient; DeepSpeed's
    # own estimator counts 4 bytes x the largest module (16-bit parameter + gradient).
    gathered = 2 * unit_bytes(shape, setup, p)
    if setup.accelerator == "cpu":
        # gloo (CPU ranks) receives an all-gather into a temporary of the whole gathered size and then copies it into
        # DeepSpeed's flat buffer (measured: 100 MiB above output + input for a 100 MiB all_gather_into_tensor on 2
        # ranks); NCCL receives in place. The units in flight exist twice: at 0.4B MoE QLoRA the step peaks in the
        # embedding's and first layers' gather, 207 MiB above the step's start against 125 planned for 2 units.
        gathered *= 2
    return gathered + p * counts.largest_trainable_unit + bucket


def resident_bucket_copy(strategy: Strategy, trainable: int) -> float:
    """Bytes of the reducer buckets a replicating torch strategy holds beside its fp32 gradients: none for gym_ddp,
    whose gradients are the buckets; FSDP2 without sharding keeps the whole-copy term it was planned with.

    Args:
        strategy: A torch strategy with ``stage`` 0.
        trainable: Trainable parameters.
    """
    return 0.0 if strategy.ddp else 4.0 * trainable


def tensor_rows_bytes(shape: ModelShape, setup: Setup, shards: int) -> float:
    """Checkpoint bytes in flight while one process loads: the rows of one checkpoint tensor it holds (``1/shards``
    of the largest, for a rank that reads only its shard), in the checkpoint dtype. The one loader (``models.fill``)
    reads each tensor's rows through a file opened for that tensor, so no file pages stay mapped from one tensor to
    the next."""
    return setup.checkpoint_dtype_bytes * shape.largest_tensor() / shards


def quant_read_bytes(shape: ModelShape, setup: Setup, shards: int) -> float:
    """Loading a QLoRA base quantises as it reads: one checkpoint tensor's rows (:func:`tensor_rows_bytes`),
    quantised a bounded chunk at a time."""
    return tensor_rows_bytes(shape, setup, shards) + NF4_CHUNK_BYTES


def host_bytes_per_node(shape: ModelShape, strategy: Strategy, setup: Setup, states: ModelStates) -> float:
    """Host RAM per node: the larger of loading the checkpoint and the offloaded states, plus each process's base.

    Loading: strategies that replicate parameters (DDP, ZeRO-1/2) materialise the full checkpoint in every process;
    ZeRO-3 builds under ``zero.Init`` and loads it once per node (DeepSpeed's estimator makes the same distinction,
    ``zero_init``); gym_fsdp builds on the meta device and each rank reads only its rows of one tensor at a time
    (``models.fill``), so its load costs the node those rows per process (:func:`tensor_rows_bytes`).
    ZeRO-Infinity also keeps pinned swap buffers (DeepSpeed's default ``buffer_count`` 5 x ``buffer_size`` 1e8
    elements per rank). A QLoRA base is quantised as it is read: gym_fsdp and ZeRO-3 ranks read their rows of one
    file, every other process fills its whole 4-bit model on the host before moving it to its GPU
    (``models.fill.fill_on_cpu``)."""
    counts = param_counts(shape, setup)
    load_dtype = 2 if setup.precision == "bf16-mixed" else 4
    copies = setup.gpus_per_node if strategy.stage < 3 else 1
    load = copies * load_dtype * counts.total_with_adapters
    if strategy.framework == "torch" and strategy.stage == 3:
        load = setup.gpus_per_node * tensor_rows_bytes(shape, setup, setup.world_size)
    if setup.quantization != "none":
        filled = frozen_bytes(shape, setup, load_dtype) + quant_read_bytes(shape, setup, 1)
        load = setup.checkpoint_file_bytes if strategy.stage == 3 else copies * filled
    offloaded = setup.gpus_per_node * states.host
    if strategy.offload_optimizer == "nvme":
        offloaded += setup.gpus_per_node * 5 * 100_000_000 * (4 + load_dtype)
    return max(load, offloaded) + setup.gpus_per_node * setup.host_process_overhead


def modelled(strategy: Strategy, setup: Setup) -> bool:
    """Whether the planner has formulas for ``strategy`` under ``setup``: not for a QLoRA base with anything
    offloaded (where its 4-bit tensors and their gathers live has not been traced), every other combination."""
    offloads = strategy.offload_optimizer != "none" or strategy.offload_parameters != "none"
    return not (setup.quantization != "none" and offloads)


@dataclass(frozen=True)
class Estimate:
    """Memory of one strategy: bytes per GPU by category, host and NVMe bytes per node, and whether it fits."""

    strategy: Strategy
    params: float
    grads: float
    optimizer_state: float
    activations: float
    logits: float
    buffers: float
    host_per_node: float
    nvme_per_node: float
    fits_gpu: bool
    fits_host: bool
    max_micro_batch: int
    modelled: bool = True  # False: figures not computed for this combination (see :func:`modelled`), never "fits"

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_state

    @property
    def gpu_total(self) -> float:
        return self.model_states + self.activations + self.logits + self.buffers

    @property
    def fits(self) -> bool:
        return self.modelled and self.fits_gpu and self.fits_host


def largest_micro_batch(shape: ModelShape, setup: Setup, fixed: float) -> int:
    """The largest micro-batch whose activations and logits fit beside ``fixed`` bytes (0 if none). A bisection,
    not a division: with the chunked loss the logits stop growing at one chunk, so memory is not linear in it."""

    def fits(batch: int) -> bool:
        used = fixed + activation_bytes(shape, setup, batch) + logits_bytes(shape, setup, batch)
        return used <= setup.usable_gpu_memory

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def estimate(shape: ModelShape, strategy: Strategy, setup: Setup) -> Estimate:
    """Everything the planner reports for ``strategy``; a :class:`GymUserError` for impossible sequence-parallel
    settings (:func:`check_setup`)."""
    check_setup(shape, setup)
    states = model_states(shape, strategy, setup)
    buffers = buffer_bytes(shape, strategy, setup)
    fixed = states.total + buffers
    host = host_bytes_per_node(shape, strategy, setup, states)
    known = modelled(strategy, setup)
    largest = largest_micro_batch(shape, setup, fixed) if known else 0
    b = setup.micro_batch_size
    activations, logits = activation_bytes(shape, setup, b), logits_bytes(shape, setup, b)
    return Estimate(
        strategy=strategy,
        params=states.params,
        grads=states.grads,
        optimizer_state=states.optimizer_state,
        activations=activations,
        logits=logits,
        buffers=buffers,
        host_per_node=host,
        nvme_per_node=setup.gpus_per_node * states.nvme,
        fits_gpu=fixed + activations + logits <= setup.usable_gpu_memory,
        fits_host=host <= setup.host_memory,
        max_micro_batch=largest,
        modelled=known,
    )


def estimate_all(shape: ModelShape, setup: Setup) -> list[Estimate]:
    """One :class:`Estimate` per strategy, fastest first."""
    return [estimate(shape, strategy, setup) for strategy in STRATEGIES]


def recommend(estimates: list[Estimate]) -> Estimate | None:
    """The fastest strategy that fits on the GPUs and in host memory (``estimates`` ordered fastest first)."""
    return next((e for e in estimates if e.fits), None)
