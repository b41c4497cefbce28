"""One description of a run for every planner entry: a :class:`RunSpec` of nested frozen sections (pure data).

``gym plan`` flags, ``gym plan --config`` (``planner.run_config``), the live-run plan check
(``callbacks.plan_check``) and ``strategy: gym_auto`` all build one. Its sections: ``module`` (the model and how
the module runs it), ``training`` (the training stage and batch; :data:`STAGES`), ``adapters`` (LoRA and quantisation),
``parallel`` (GPUs, nodes, sequence parallelism and the run's own strategy: :meth:`RunSpec.degrees`), ``knobs``
(the strategy's own settings: buckets, ZeRO-3 persistence, gradient compression; a DeepSpeed JSON's values land
here) and ``hardware``. Each default is written here, once.

Every leaf also has a flat name, unique across the spec (tests check it): ``RunSpec(lora_r=16)``,
``dataclasses.replace(spec, lora_r=16)`` and ``spec.lora_r`` take it; ``gym plan``'s flags are those names
(``planner.spec_flags``; a field may name its flag differently, ``checkpoint_file_size``, and both are taken).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from gym_lightning.errors import GymUserError
from gym_lightning.metrics import hardware as catalog
from gym_lightning.planner.stages import STAGES, ReferenceHold, StageKind, StageName

Precision = Literal["bf16-mixed", "32-true"]
Optimizer = Literal["adamw", "sgd", "adafactor"]
Attention = Literal["sdpa", "eager"]
Accelerator = Literal["gpu", "cpu"]
LossChunking = Literal["auto", "on", "off"]
Quantization = Literal["none", "nf4"]
GradientCompression = Literal["none", "fp16", "bf16", "powersgd"]
# Linear layers LoRA adapts (models.shapes.lora_target_names); "none": only the experts of lora_target_parameters.
LoraTargets = Literal["all-linear", "attention-qv", "none"]
# How the module's kernels run (CausalLMModule's compile / fused_ops): its own efficiency in planner.compute.
Kernels = Literal["eager", "compiled", "liger"]
# A frozen reference copy's dtype ("auto": as the strategy family holds frozen weights, 16-bit under bf16-mixed).
ReferenceDtype = Literal["auto", "bf16", "fp32"]

GiB = 1024**3
DEFAULT_GPU = "h100-sxm"
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20}
_UNITS |= {"G": GiB, "GB": GiB, "GIB": GiB, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` -> bytes. Sizes are binary: ``GB`` and ``GiB`` both mean 2**30 bytes, because the cards sold as
    "80GB" / "24GB" hold 80 / 24 GiB (81920 / 24576 MiB; the driver reports slightly less)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match.group(2).upper() not in _UNITS:
        raise GymUserError(f"Cannot read memory size {text!r}; expected a number with a unit, e.g. '80GB', '512GiB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _names(value: Any) -> tuple[str, ...]:
    """A list of names (``a b`` or ``a,b`` on the command line) as a tuple; anything else is left for the checks."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(part.strip() for v in value for part in v.split(",") if part.strip())
    return value


def leaf(help: str, *, parse: Callable[[Any], Any] | None = None, flag: str | None = "") -> dict[str, Any]:
    """A leaf's metadata: its flag's help, how a flag's or YAML's text becomes its value, and the flag that sets it
    (``""``: the field's own name; ``None``: no flag, set from a YAML or the live run only)."""
    return {"help": help, "parse": parse, "flag": flag}


@dataclass(frozen=True)
class ModuleSpec:
    """The model and how ``CausalLMModule`` runs it."""

    model: str | None = field(
        default=None, metadata=leaf("a bundled name, a gym_lightning preset, or a config.json / model folder")
    )
    config_overrides: Mapping[str, Any] | None = field(
        default=None, hash=False, metadata={"help": "config.json keys changed first", "parse": None, "flag": None}
    )
    attention: Attention = field(
        default="sdpa", metadata=leaf("sdpa (flash / memory-efficient) or eager (stores the scores)")
    )
    activation_checkpointing: bool = field(default=False, metadata=leaf("recompute each decoder layer in backward"))
    loss_chunking: LossChunking = field(
        default="auto", metadata=leaf("LM head and loss in chunks; auto: from a 65,536-token vocabulary")
    )
    loss_chunk_tokens: int = field(default=1024, metadata=leaf("positions per LM-head / loss chunk"))
    mlp_tile_tokens: int = field(default=0, metadata=leaf("tokens per tiled-MLP step; 0 = not tiled"))
    kernels: Kernels = field(
        default="eager", metadata=leaf("eager, compiled (torch.compile per layer) or liger (fused kernels)")
    )
    checkpoint_dtype_bytes: int = field(
        default=2, metadata=leaf("bytes per element of the checkpoint files and the export", flag=None)
    )
    checkpoint_file_bytes: int = field(
        default=5 * GiB,
        metadata=leaf(
            "largest safetensors file of the checkpoint, e.g. 5GB", parse=parse_bytes, flag="checkpoint_file_size"
        ),
    )


@dataclass(frozen=True)
class TrainingSpec:
    """The training stage (:data:`STAGES`), its batch and its optimizer."""

    stage: StageName = field(
        default="sft",
        metadata=leaf("training stage: sft, pt (continued pretraining), or preference: dpo, kto, orpo, simpo"),
    )
    micro_batch_size: int = field(
        default=1, metadata=leaf("examples (sequences; preference pairs) per GPU per forward pass")
    )
    seq_length: int = field(default=2048, metadata=leaf("tokens per sequence"))
    accumulate_grad_batches: int = field(default=1, metadata=leaf("micro-batches per optimizer step"))
    precision: Precision = field(
        default="bf16-mixed", metadata=leaf("bf16-mixed (16-bit compute, fp32 master weights) or 32-true")
    )
    optimizer: Optimizer = field(
        default="adamw", metadata=leaf("adamw, sgd (with momentum) or adafactor (factored, no momentum)")
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata=leaf("dpo / kto: reference log-probs computed in one pass before training; none held in training"),
    )
    ref_model: str | None = field(
        default=None,
        metadata=leaf("dpo / kto: a reference model of its own (TRL's ref_model): a frozen copy even beside LoRA"),
    )
    reference_dtype: ReferenceDtype = field(
        default="auto", metadata=leaf("dpo / kto: a frozen reference copy's dtype; auto: as frozen weights are held")
    )

    @property
    def kind(self) -> StageKind:
        return STAGES[self.stage]

    @property
    def activation_bytes(self) -> int:
        """Bytes of a 16-bit (bf16-mixed) or fp32 activation."""
        return 2 if self.precision == "bf16-mixed" else 4


@dataclass(frozen=True)
class AdapterSpec:
    """LoRA adapters and the frozen base's quantisation."""

    lora_r: int = field(default=0, metadata=leaf("LoRA rank; 0 = full finetune"))
    lora_targets: LoraTargets = field(
        default="all-linear", metadata=leaf("linear layers with adapters; none: only the experts")
    )
    lora_target_parameters: tuple[str, ...] = field(
        default=(),
        metadata=leaf(
            "expert weights with adapters: all-experts, or peft names (experts.gate_up_proj ...)", parse=_names
        ),
    )
    quantization: Quantization = field(default="none", metadata=leaf("nf4: QLoRA's 4-bit base (needs --lora_r)"))
    quantization_skip_modules: tuple[str, ...] = field(
        default=("lm_head",),
        metadata=leaf("modules a QLoRA base keeps in 16 bits (experts, experts.down_proj ...)", parse=_names),
    )

    @property
    def skip_expert_weights(self) -> tuple[str, ...]:
        """The fused expert weights a QLoRA base keeps in 16 bits (``planner.experts.skipped_expert_weights``)."""
        from gym_lightning.planner.experts import skipped_expert_weights

        names = self.quantization_skip_modules
        return skipped_expert_weights(names) if isinstance(names, tuple) else ()


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees of a run, as ``strategies.parallel_dims.ParallelDims`` holds them (same fields, same
    arithmetic; tests/planner/test_spec.py checks the two agree over a grid).

    Args:
        world_size: All ranks. sequence: Ranks sharing each sequence. shard: Ranks each parameter is split over
            (``None``: world / replicate). replicate: Copies of each shard (``None``: no replicate dimension).
    """

    world_size: int
    sequence: int = 1
    shard: int | None = None
    replicate: int | None = None

    @property
    def replicate_degree(self) -> int:
        return 1 if self.replicate is None else self.replicate

    @property
    def shard_degree(self) -> int:
        return self.world_size // self.replicate_degree if self.shard is None else self.shard

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.sequence


@dataclass(frozen=True)
class ParallelSpec:
    """How many GPUs, how sequences are split over them, and the run's own strategy."""

    gpus_per_node: int = field(default=8, metadata=leaf("GPUs (ranks) per node"))
    nodes: int = field(default=1, metadata=leaf("nodes; every GPU is a data-parallel rank"))
    sequence_parallel_size: int = field(
        default=1, metadata=leaf("GPUs that share one sequence (Ulysses); divides GPUs and heads")
    )
    strategy: Any = field(
        default=None, metadata=leaf("the run's own strategy (a registered name or a planner key), on a line of its own")
    )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def data_parallel_size(self) -> int:
        """Groups that train different sequences: ``N / sp``; ZeRO / FSDP still shard over all N ranks."""
        return self.degrees().data_parallel

    def degrees(self, hybrid: bool = False) -> Degrees:
        """The degrees of a strategy that shards over all ranks, or (``hybrid``) within a node, replicated across."""
        sp, world = self.sequence_parallel_size, self.world_size
        return Degrees(world, sp, self.gpus_per_node, self.nodes) if hybrid else Degrees(world, sp)


@dataclass(frozen=True)
class KnobSpec:
    """The strategy's own settings (a DeepSpeed JSON's ``zero_optimization`` values and gym's strategy arguments);
    ``None``: what gym's strategies derive (``strategies.zero.rule``: one decoder layer)."""

    bucket_size: int | None = field(
        default=None, metadata=leaf("ZeRO reduce / all-gather bucket, elements; default one decoder layer")
    )
    zero3_param_persistence_threshold: int | None = field(
        default=None, metadata=leaf("ZeRO-3: tensors this small stay whole per rank")
    )
    zero3_model_persistence_threshold: int | None = field(
        default=None, metadata=leaf("ZeRO-3: budget of persisted elements per rank")
    )
    sub_group_size: int | None = field(
        default=None, metadata=leaf("ZeRO-3 optimizer sub-group, elements; default one decoder layer")
    )
    zero3_leaf_layers: bool = field(
        default=True, metadata=leaf("ZeRO-3 gathers each decoder layer whole (gym's rule; hooks per layer)")
    )
    gradient_compression: GradientCompression = field(
        default="none", metadata=leaf("gym_ddp / gym_fsdp: how gradients travel")
    )
    powersgd_rank: int = field(default=1, metadata=leaf("gym_ddp's PowerSGD rank"))


@dataclass(frozen=True)
class HardwareSpec:
    """The machines: GPU, links, memory, and explicit figures over the catalog's (``planner.machines``)."""

    accelerator: Accelerator = field(default="gpu", metadata=leaf("gpu, or cpu (CPU ranks: every byte is host memory)"))
    gpu: str = field(default=DEFAULT_GPU, metadata=leaf(f"a GPU of the hardware catalog ({', '.join(catalog.GPUS)})"))
    interconnect: str | None = field(default=None, metadata=leaf("fabric between nodes, a node's link, or link,fabric"))
    gpu_memory: int | None = field(
        default=None, metadata=leaf("memory per GPU, e.g. 24GB; default: the --gpu's", parse=parse_bytes)
    )
    host_memory: int = field(default=1024 * GiB, metadata=leaf("CPU RAM per node, e.g. 512GB", parse=parse_bytes))
    cuda_reserved: int = field(default=GiB, metadata=leaf("CUDA context, NCCL and cuBLAS workspaces", flag=None))
    fragmentation: float = field(
        default=0.05, metadata=leaf("share of the rest lost to the caching allocator", flag=None)
    )
    host_process_overhead: int = field(
        default=3 * GiB, metadata=leaf("host RSS of one training process before any model", flag=None)
    )
    peak_tflops: float | None = field(
        default=None, metadata=leaf("override: dense TFLOP/s of one GPU in the compute dtype")
    )
    compute_efficiency: float | None = field(
        default=None, metadata=leaf("override: the kernels' efficiency over the roofline (0-1]")
    )
    memory_bandwidth_gbs: float | None = field(
        default=None, metadata=leaf("override: GPU memory GB/s", flag="memory_bandwidth")
    )
    intra_node_bandwidth_gbs: float | None = field(
        default=None, metadata=leaf("override: busbw in a node, GB/s", flag="intra_node_bandwidth")
    )
    inter_node_bandwidth_gbs: float | None = field(
        default=None, metadata=leaf("override: busbw across nodes, GB/s", flag="inter_node_bandwidth")
    )
    host_bandwidth_gbs: float | None = field(
        default=None, metadata=leaf("override: pinned host <-> GPU GB/s", flag="host_bandwidth")
    )

    @property
    def gpu_bytes(self) -> int:
        """The GPU's memory: ``gpu_memory``, else the catalog GPU's (80 GiB when the name is unknown)."""
        if self.gpu_memory is not None:
            return self.gpu_memory
        found = catalog.GPUS.get(str(self.gpu).lower()) or next(
            (g for g in catalog.GPUS.values() if str(self.gpu).lower() in g.aliases), None
        )
        return found.memory if found is not None else 80 * GiB

    @property
    def usable_gpu_memory(self) -> int:
        return int((self.gpu_bytes - self.cuda_reserved) * (1 - self.fragmentation))


SECTIONS: dict[str, type] = {
    "module": ModuleSpec,
    "training": TrainingSpec,
    "adapters": AdapterSpec,
    "parallel": ParallelSpec,
    "knobs": KnobSpec,
    "hardware": HardwareSpec,
}


def _leaves() -> dict[str, tuple[str, Any]]:
    """Flat name (and flag name) -> ``(section, field)`` of every leaf."""
    found: dict[str, tuple[str, Any]] = {}
    for section, kind in SECTIONS.items():
        for f in fields(kind):
            found[f.name] = (section, f)
            if f.metadata.get("flag"):
                found[f.metadata["flag"]] = (section, f)
    return found


LEAVES = _leaves()


@dataclass(frozen=True, init=False)
class RunSpec:
    """A run, as every planner entry describes it (see the module docstring; each section's class lists its leaves).

    Args:
        module, training, adapters, parallel, knobs, hardware: Whole sections (their defaults when left out).
        **flat: Any leaf by its flat name, over the sections given (``RunSpec(lora_r=16, gpus_per_node=2)``).
    """

    module: ModuleSpec
    training: TrainingSpec
    adapters: AdapterSpec
    parallel: ParallelSpec
    knobs: KnobSpec
    hardware: HardwareSpec

    def __init__(self, **given: Any) -> None:
        flat = {k: v for k, v in given.items() if k not in SECTIONS}
        if unknown := sorted(k for k in flat if k not in LEAVES):
            raise TypeError(f"RunSpec got unknown settings {unknown}; known: {', '.join(sorted(LEAVES))}")
        for name, kind in SECTIONS.items():
            section = given.get(name) or kind()
            changes = {LEAVES[k][1].name: v for k, v in flat.items() if LEAVES[k][0] == name}
            object.__setattr__(self, name, replace(section, **changes) if changes else section)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in SECTIONS:
            raise AttributeError(name)
        for section in SECTIONS:
            value = object.__getattribute__(self, section)
            if hasattr(type(value), name) or name in {f.name for f in fields(value)}:
                return getattr(value, name)
        raise AttributeError(f"RunSpec has no setting {name!r}")

    def flat(self) -> dict[str, Any]:
        """Every leaf by its flat name (``PlanReport.to_dict()``'s ``setup``)."""
        return {f.name: getattr(getattr(self, s), f.name) for s, kind in SECTIONS.items() for f in fields(kind)}

    @property
    def local_seq_length(self) -> int:
        """Tokens of one sequence on one rank: the runtime pads ``s`` to a multiple of sp, each rank holds 1/sp."""
        return -(-self.training.seq_length // self.parallel.sequence_parallel_size)

    def degrees(self, hybrid: bool = False) -> Degrees:
        return self.parallel.degrees(hybrid)

    @property
    def reference_hold(self) -> ReferenceHold:
        """How the run holds its reference in training, ``objectives.preference.reference_for``'s rule: ``none``
        (a stage without one), ``precomputed`` (``precompute_ref_log_probs``: none held, none run), ``adapters_off``
        (LoRA / QLoRA without a ``ref_model``: the policy's base, no second copy), else ``copy`` (a frozen copy,
        held as the strategy family holds the policy: ``CostModel.reference_bytes``)."""
        if not self.training.kind.reference:
            return "none"
        if self.training.precompute_ref_log_probs:
            return "precomputed"
        if self.adapters.lora_r > 0 and self.training.ref_model is None:
            return "adapters_off"
        return "copy"

    @property
    def no_grad_passes(self) -> int:
        """Forward passes without gradient in each micro-batch: the reference's (unless precomputed) and the
        policy's over its detached rows (KTO's KL rows), each beside the policy's forward and backward."""
        reference = self.reference_hold in ("adapters_off", "copy")
        return int(reference) + int(self.training.kind.detached > 0)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Token positions one rank computes per micro-batch: ``b x sequences x ceil(s / sp)``."""
        return local_tokens(self, self.training.micro_batch_size)


def local_tokens(spec: RunSpec, micro_batch: int, sequences: int | None = None) -> int:
    """Token positions one rank trains on per forward: ``b x sequences x ceil(s / sp)`` (the stage's sequences per
    example, :class:`StageKind`; ``sequences`` given: that many, e.g. a reference's rows). Under sequence
    parallelism each rank holds ``s/sp`` consecutive tokens of a sequence (the runtime pads ``s`` to a multiple of
    sp); every per-token activation, the logits and the chunked loss count these, not ``s``."""
    rows = spec.training.kind.sequences if sequences is None else sequences
    return micro_batch * rows * spec.local_seq_length


__all__ = [
    "LEAVES",
    "SECTIONS",
    "STAGES",
    "AdapterSpec",
    "Degrees",
    "HardwareSpec",
    "KnobSpec",
    "ModuleSpec",
    "ParallelSpec",
    "ReferenceDtype",
    "ReferenceHold",
    "RunSpec",
    "StageKind",
    "TrainingSpec",
    "local_tokens",
    "parse_bytes",
]
