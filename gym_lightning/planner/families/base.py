"""The interface every strategy family's cost model keeps, and what the families share (pure, no torch).

A :class:`CostModel` answers, for one strategy row, one model and one run: the model states per rank
(:meth:`~CostModel.states`), the strategy's buffers in the step, the peak of each phase (load, step, save, export),
the host memory per node, the collectives of one optimizer step (:meth:`~CostModel.traffic`), the optimizer's and
the host's work, and its per-module hooks. The families (``replicated``, ``fsdp``, ``zero``) override what differs;
the activations, logits and the step's shared terms are strategy-independent (``planner.activations``).

A preference stage with a reference (``planner.stages``) is charged as the run holds it (``RunSpec.reference_hold``):
a frozen copy as the family holds the policy (:meth:`~CostModel.reference_bytes`: whole where the policy is whole,
sharded where it is sharded, on the host where the parameters are offloaded), nothing for the policy with its
adapters off or precomputed log-probabilities; its forward's collectives are :meth:`~CostModel.no_grad_traffic`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.activations import activation_bytes, logits_bytes
from gym_lightning.planner.comm import Group
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.params import (
    NF4_CHUNK_BYTES,
    OPTIMIZER_STATE_BYTES,
    ParamCounts,
    dequant_bytes,
    frozen_bytes,
    param_counts,
    quantized_base,
    tensor_groups,
)
from gym_lightning.planner.spec import RunSpec
from gym_lightning.planner.strategies import Strategy

# Bytes per element of a frozen reference copy by ``reference_dtype`` ("auto": the family's frozen-weight dtype).
REFERENCE_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4}
# Bytes read and written per trainable element by one optimizer step on the device (fp32 state): AdamW reads the
# parameter, gradient, momentum and variance and writes three of them back (16 + 12); SGD with momentum 12 + 8;
# Adafactor's factored moment is O(rows + cols), so parameter and gradient in, parameter out.
OPTIMIZER_TRAFFIC: dict[str, int] = {"adamw": 28, "sgd": 20, "adafactor": 12}


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


@dataclass(frozen=True)
class PhasePeak:
    """Peak bytes of one rank in one phase: host RAM (the process's resident memory) and accelerator memory."""

    host: float
    device: float


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


def place(spec: RunSpec, tensors: float, host_only: float = 0.0) -> PhasePeak:
    """A phase's peak from the tensor bytes on the training device and what only the host holds (a file being
    read, the process itself). On CPU ranks the device's tensors are host memory too."""
    host = spec.host_process_overhead + host_only
    if spec.accelerator == "cpu":
        return PhasePeak(host + tensors, 0.0)
    return PhasePeak(host, tensors)


def tensor_rows_bytes(shape: ModelShape, spec: RunSpec, shards: int) -> float:
    """Checkpoint bytes in flight while one process loads: the rows of one checkpoint tensor it holds (``1/shards``
    of the largest, for a rank that reads only its shard), in the checkpoint dtype. The one loader (``models.fill``)
    reads each tensor's rows through a file opened for that tensor."""
    return spec.checkpoint_dtype_bytes * shape.largest_tensor() / shards


def quant_read_bytes(shape: ModelShape, spec: RunSpec, shards: int) -> float:
    """Loading a QLoRA base quantises as it reads: one checkpoint tensor's rows, a bounded chunk at a time."""
    return tensor_rows_bytes(shape, spec, shards) + NF4_CHUNK_BYTES


def supported(strategy: Strategy, spec: RunSpec) -> bool:
    """Whether the planner has formulas for ``strategy`` under ``spec``: not for a QLoRA base with anything
    offloaded (where its 4-bit tensors and their gathers live has not been traced), every other combination."""
    return not (spec.quantization != "none" and strategy.offloads)


class CostModel:
    """One strategy family's costs for ``strategy`` training ``shape`` as ``spec`` describes.

    Args:
        strategy: The row (its family picks the subclass: ``planner.families.cost_model``).
        shape: The model.
        spec: The run.
    """

    def __init__(self, strategy: Strategy, shape: ModelShape, spec: RunSpec) -> None:
        self.strategy, self.shape, self.spec = strategy, shape, spec
        self.counts: ParamCounts = param_counts(shape, spec)
        self.half = spec.precision == "bf16-mixed"

    # ------------------------------------------------------------------------------------------------ memory
    @property
    def shards(self) -> int:
        """Ranks the sharded states are split over (``spec.degrees``)."""
        return self.spec.degrees(self.strategy.hybrid).shard_degree

    def dtype_bytes(self) -> tuple[int, int, int, int]:
        """``(trainable param, frozen param, master, fp32 gradient copy)`` bytes per element."""
        raise NotImplementedError

    def states(self) -> ModelStates:
        raise NotImplementedError

    def buffers(self) -> float:
        """The strategy's temporary buffers in the step (gathered units, buckets, autocast's weight copies)."""
        raise NotImplementedError

    def resident_buffers(self) -> float:
        """Buffers that stay allocated between steps beside the model states."""
        return 0.0

    def load_peak(self) -> PhasePeak:
        raise NotImplementedError

    def qlora_load_peak(self) -> PhasePeak:
        raise NotImplementedError

    def host_load_bytes(self) -> float:
        """Host RAM of one node while the checkpoint loads (every process's share)."""
        raise NotImplementedError

    def held_after_step(self) -> float:
        """Model-state bytes still held once a step is over (what save and export start from)."""
        return self.states().total

    def export_buffers(self) -> float:
        """Buffers still allocated while the export runs."""
        return self.resident_buffers()

    def modelled(self) -> bool:
        """Whether the family has formulas for this run (:func:`supported`)."""
        return supported(self.strategy, self.spec)

    def reference_dtype_bytes(self) -> int:
        """Bytes per element of a frozen reference copy: ``reference_dtype``, or (``auto``) the family's frozen
        weights' (16-bit under ``bf16-mixed``)."""
        return REFERENCE_DTYPE_BYTES.get(self.spec.reference_dtype) or self.dtype_bytes()[1]

    def reference_whole_bytes(self) -> float:
        """A frozen reference copy whole: every base parameter (no adapters; a QLoRA run's ``ref_model`` is built in
        16 bits by ``objectives.preference.build_reference``) in :meth:`reference_dtype_bytes`. 0 unless the run
        holds a copy (``RunSpec.reference_hold``: not with the adapters off or precomputed log-probabilities)."""
        if self.spec.reference_hold != "copy":
            return 0.0
        return float(self.reference_dtype_bytes() * self.shape.num_params())

    def reference_shards(self) -> int:
        """Ranks a frozen reference copy is split over: as the policy's parameters (1: whole on every rank)."""
        return 1

    def reference_offloaded(self) -> bool:
        """Whether the copy's shard is offloaded (host or NVMe) as the policy's parameter shards are."""
        return self.reference_shards() > 1 and self.strategy.offload_parameters != "none"

    def reference_bytes(self) -> float:
        """The frozen reference copy on the training device per rank (0 without one, or offloaded)."""
        return 0.0 if self.reference_offloaded() else self.reference_whole_bytes() / self.reference_shards()

    def reference_host_bytes(self, device: str = "cpu") -> float:
        """The copy's shard one rank keeps offloaded to ``device`` (``cpu``: host memory, or ``nvme``)."""
        if not self.reference_offloaded() or self.strategy.offload_parameters != device:
            return 0.0
        return self.reference_whole_bytes() / self.reference_shards()

    def step_buffers(self) -> float:
        """The step's buffers: the strategy's and one NF4 layer's dequantised weight."""
        return self.buffers() + dequant_bytes(self.shape, self.spec)

    def step_peak(self) -> PhasePeak:
        """Every model state, the activations, the LM head/loss buffer and the step's buffers (fused AdamW, the
        module's default, updates in place: the optimizer step adds nothing)."""
        states, b = self.states(), self.spec.micro_batch_size
        tensors = states.total + activation_bytes(self.shape, self.spec, b) + logits_bytes(self.shape, self.spec, b)
        host = states.host + self.reference_host_bytes()
        return place(self.spec, tensors + self.step_buffers() + self.reference_bytes(), host)

    def save_peak(self) -> PhasePeak:
        """The states are written from where they are (DCP, DeepSpeed, ``PartialFileCheckpointIO``); a reference
        copy is held but never saved."""
        held = self.held_after_step() + self.resident_buffers() + self.reference_bytes()
        return place(self.spec, held, self.states().host + self.reference_host_bytes())

    def export_peak(self) -> PhasePeak:
        """The exporter gathers one tensor at a time in fp32 and writes its copy in the export dtype."""
        largest = self.shape.largest_tensor()
        one_tensor = max(largest * (4 + self.spec.checkpoint_dtype_bytes), self._merged_nf4_bytes())
        held = self.held_after_step() + self.export_buffers() + self.reference_bytes()
        return place(self.spec, held + one_tensor, self.states().host + self.reference_host_bytes())

    def _merged_nf4_bytes(self) -> float:
        """A merged QLoRA export of the largest NF4 layer: its gathered 4-bit tensors, the weight dequantised in the
        export dtype, then the fp32 delta, base and sum (12 B per weight)."""
        quant = quantized_base(self.shape, self.spec)
        return quant.largest_linear * (quant.bytes_per_weight + self.spec.checkpoint_dtype_bytes + 12)

    def host_per_node(self) -> float:
        """Host RAM per node: the larger of loading the checkpoint and the offloaded states, plus each process."""
        spec = self.spec
        offloaded = spec.gpus_per_node * (self.states().host + self.reference_host_bytes()) + self.swap_buffers()
        return max(self.host_load_bytes(), offloaded) + spec.gpus_per_node * spec.host_process_overhead

    def swap_buffers(self) -> float:
        """Pinned NVMe swap buffers of the node (ZeRO-Infinity's)."""
        return 0.0

    def offloaded_states(self, states: float, params: float) -> ModelStates:
        """Model states with the optimizer offloaded: the fp32 gradient partition, masters and states live on the
        host (or NVMe); with parameters offloaded too, the parameter partition follows."""
        t, n = self.counts.trainable, self.shards
        p, pf, _, _ = self.dtype_bytes()
        offloaded = states + 4 * t / n
        device_params = params
        if self.strategy.offload_parameters != "none":
            offloaded += (p * t + frozen_bytes(self.shape, self.spec, pf)) / n
            device_params = self.persistent_bytes()
        on_host = self.strategy.offload_optimizer == "cpu"
        return ModelStates(device_params, 0.0, 0.0, offloaded if on_host else 0.0, 0.0 if on_host else offloaded)

    def persistent_bytes(self) -> float:
        """Parameters that stay on the device when the partition is offloaded (ZeRO-3's persistent ones)."""
        return 0.0

    def optimizer_state_bytes(self) -> int:
        """Optimizer bytes per trainable element, fp32 masters included."""
        return OPTIMIZER_STATE_BYTES[self.spec.optimizer] + self.dtype_bytes()[2]

    # ------------------------------------------------------------------------------------------------ time
    def group(self, ranks: int, hw: Hardware) -> Group:
        """The collective group of ``ranks`` consecutive ranks (a node holds ``gpus_per_node`` of them)."""
        return Group(ranks, -(-ranks // self.spec.gpus_per_node), hw.network)

    def traffic(self, hw: Hardware) -> Traffic:
        raise NotImplementedError

    def gathered_bytes(self) -> int:
        """Bytes per element of a gathered parameter: the compute dtype under ``bf16-mixed``, else fp32."""
        return 2 if self.half else 4

    def optimizer_elements(self) -> float:
        """Trainable elements one rank steps on the device (none when the optimizer is offloaded)."""
        if self.strategy.offload_optimizer != "none":
            return 0.0
        return self.stepped_elements()

    def stepped_elements(self) -> float:
        """Trainable elements one rank's optimizer steps: its partition when sharded."""
        return self.counts.trainable / self.shards

    def step_traffic_bytes(self) -> int:
        """Bytes per trainable element of one optimizer step (:data:`OPTIMIZER_TRAFFIC`)."""
        return OPTIMIZER_TRAFFIC[self.spec.optimizer]

    def offload_seconds(self, hw: Hardware) -> float:
        """Host traffic of one optimizer step on one rank, not hidden (0 without offload)."""
        return 0.0

    def hook_seconds(self, hw: Hardware) -> float:
        """Host seconds of per-module hooks in one micro-batch that the device waits for (0 but ZeRO-3's)."""
        return 0.0

    def pass_hook_seconds(self, hw: Hardware) -> float:
        """Host seconds of the per-module hooks of one pass through the model (0 but ZeRO-3's)."""
        return 0.0

    def no_grad_traffic(self, hw: Hardware) -> Traffic:
        """The collectives of one micro-batch's forwards without gradient (``RunSpec.no_grad_passes``), as
        ``forward`` / ``forward_exposed`` (each pass's first gather shows): the reference's (the policy's own gathers
        with its adapters off; a copy's, :meth:`reference_gather`) and the policy's over its detached rows."""
        policy = self.traffic(hw)
        passes = [(policy.forward, policy.forward_exposed)] * (self.spec.training.kind.detached > 0)
        if self.spec.reference_hold == "adapters_off":
            passes.append((policy.forward, policy.forward_exposed))
        elif self.spec.reference_hold == "copy":
            passes.append(self.reference_gather(hw))
        return Traffic(forward=sum(p[0] for p in passes), forward_exposed=sum(p[1] for p in passes))

    def reference_gather(self, hw: Hardware) -> tuple[float, float]:
        """Seconds of one forward's gathers of a frozen reference copy, and the part that shows (none: whole)."""
        return 0.0, 0.0

    def reference_gathered_bytes(self) -> float:
        """A copy's bytes as gathered: its dtype, or the compute dtype where mixed precision casts it down first
        (FSDP2's ``param_dtype``, DeepSpeed's 16-bit model)."""
        return min(self.reference_dtype_bytes(), self.gathered_bytes()) * float(self.shape.num_params())

    def sharded_offload_seconds(self, hw: Hardware, grads: float, params: float) -> float:
        """Offload's traffic given the bytes per element the gradients go down and the parameters come up in:
        PCIe copies of the partition, the CPU optimizer over the node's DRAM (all its ranks step at once), NVMe
        swaps of the optimizer state and, with parameters offloaded, the partition up for every gather."""
        spec, strategy = self.spec, self.strategy
        elements, ranks, host = self.stepped_elements(), spec.gpus_per_node, hw.host
        seconds = (grads * elements * spec.accumulate_grad_batches + params * elements) / host.host_bandwidth
        seconds += elements * ranks * self.step_traffic_bytes() / host.host_memory_bandwidth
        if strategy.offload_optimizer == "nvme":
            state = (4 + 4 + OPTIMIZER_STATE_BYTES[spec.optimizer]) * elements
            seconds += 2 * state * ranks / host.nvme_bandwidth
        if strategy.offload_parameters != "none":
            partition = self.parameter_bytes() / self.shards
            gathers = (1 if strategy.keep_gathered else 2) * spec.accumulate_grad_batches
            seconds += gathers * partition / host.host_bandwidth
            if strategy.offload_parameters == "nvme":
                seconds += gathers * partition * ranks / host.nvme_bandwidth
        return seconds

    def parameter_bytes(self, exclude_persistent: bool = False) -> float:
        """Bytes of the whole model as gathered: trainable parameters in the gathered dtype, the frozen base as
        stored (an NF4 base in its 4-bit bytes); persistent tensors (ZeRO-3's) are never gathered."""
        per = self.gathered_bytes()
        total = per * self.counts.trainable + frozen_bytes(self.shape, self.spec, per)
        return total - (per * self.counts.persistent if exclude_persistent else 0.0)

    def reduced_bytes(self) -> int:
        """Bytes per element of a reduced gradient (torch: fp32 unless a compression hook halves them)."""
        return 2 if self.spec.gradient_compression in ("fp16", "bf16") else 4

    def gradient_bytes(self) -> float:
        """Bytes of every trainable gradient as reduced."""
        return self.reduced_bytes() * self.counts.trainable

    def layer_share(self) -> float:
        """One decoder layer's share of the model's elements."""
        return self.counts.layer / max(self.counts.total_with_adapters, 1)

    def bucket_calls(self) -> int:
        """Layer-sized buckets of one full reduction."""
        return math.ceil(1 / max(self.layer_share(), 1e-12))


def trainable_tensor_shapes(shape: ModelShape, spec: RunSpec) -> list[tuple[int, int, int]]:
    """``(rows, cols, count)`` of every trainable matrix (vectors as ``(numel, 1)``): what PowerSGD factors."""
    shapes = {f"layer.{name}": (o, i) for name, (i, o) in shape.linear_shapes().items()}
    shapes |= {"embed_tokens": (shape.vocab_size, shape.hidden_size), "lm_head": (shape.vocab_size, shape.hidden_size)}
    found = []
    for g in tensor_groups(shape, spec):
        if g.trainable:
            m, n = shapes.get(g.name, (g.numel, 1))
            found.append((m, n, g.count) if m * n == g.numel else (g.numel, 1, g.count))
    return found


__all__ = [
    "REFERENCE_DTYPE_BYTES",
    "CostModel",
    "ModelStates",
    "PhasePeak",
    "Traffic",
    "place",
    "quant_read_bytes",
    "supported",
    "tensor_rows_bytes",
]
