"""Peak memory per rank in each phase of a run: load, training step, checkpoint save, export (pure formulas).

The steady-state estimate (``estimate.py``) answers "does a training step fit"; at 1B+ parameters the peak of a
rank is as often reached while the model is loaded, a checkpoint is written or the model is exported. This module
predicts each phase's peak from what gym_lightning's code does in it (docs/planner.md, "Peak per phase"; checked
against measured peaks in docs/benchmarks.md by ``benchmarks/scale.py``):

* load — gym_fsdp builds on the meta device, shards, and each rank reads only its slices of the safetensors files
  (``strategies/materialize.py``): its fp32 shard plus the slices of the file being read. DDP and ZeRO-1/2 load
  the whole checkpoint on every rank (``from_pretrained``); ZeRO-3 builds under ``zero.Init`` and each rank reads
  its partitions' slices (``strategies/zero/stage3.py``). Trainable weights become fp32 under
  ``bf16-mixed`` whatever the checkpoint's dtype (``precision.fp32_master_weights``); DeepSpeed
  keeps the module in 16 bits and builds fp32 master partitions in ``deepspeed.initialize``. AdamW's states come
  with the first step under every strategy.
* step — the model states (``estimate.model_states``), activations, the LM head/loss buffer (one chunk of
  ``loss_chunk_tokens`` positions when the loss is chunked, not ``[tokens, vocab]``), the strategy's buffers and the
  optimizer's transient: 0 for fused AdamW, the module's default (no full-size foreach intermediates).
* save — :class:`~gym_lightning.checkpointing.io.PartialFileCheckpointIO` streams ``torch.save`` into the final
  folder and DCP / DeepSpeed write each rank's tensors from memory: the states are held, nothing is staged.
* export — the exporter gathers and writes one tensor at a time (fp32 gathered + its copy in the export dtype).

QLoRA (``Setup.quantization="nf4"``) changes the load (the base is quantised as it is read, :func:`qlora_load_peak`)
and the export (each NF4 layer dequantised and merged with its adapters); the step and save follow from the smaller
model states and the dequantisation transient (``estimate.dequant_bytes``). :func:`qlora_peak` is one QLoRA phase
peak for a model, strategy and rank count, for comparing with measured runs.

On GPUs the phases' tensors are on the device and the host holds the process plus what loading maps in; on CPU
ranks (``Setup.accelerator == "cpu"``) every byte is host memory and the device figure is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.estimate import (
    STRATEGY_BY_KEY,
    Setup,
    Strategy,
    activation_bytes,
    buffer_bytes,
    frozen_bytes,
    logits_bytes,
    model_states,
    modelled,
    param_counts,
    quant_read_bytes,
    quantized_base,
    resident_bucket_copy,
    tensor_rows_bytes,
    unit_bytes,
    zero_bucket_elements,
)

PHASES: tuple[str, ...] = ("load", "step", "save", "export")


@dataclass(frozen=True)
class PhasePeak:
    """Peak bytes of one rank in one phase: host RAM (the process's resident memory) and accelerator memory."""

    host: float
    device: float


@dataclass(frozen=True)
class PhasePeaks:
    """The peak of each phase for one strategy (bytes per rank)."""

    load: PhasePeak
    step: PhasePeak
    save: PhasePeak
    export: PhasePeak

    def by_phase(self) -> dict[str, PhasePeak]:
        return {phase: getattr(self, phase) for phase in PHASES}


def _place(setup: Setup, tensors: float, host_only: float = 0.0) -> PhasePeak:
    """A phase's peak from the tensor bytes on the training device and what only the host holds (a file being
    read, the process itself). On CPU ranks the device's tensors are host memory too."""
    host = setup.host_process_overhead + host_only
    if setup.accelerator == "cpu":
        return PhasePeak(host + tensors, 0.0)
    return PhasePeak(host, tensors)


def resident_buffers(shape: ModelShape, strategy: Strategy, setup: Setup) -> float:
    """Buffers that stay allocated between steps beside the model states: DeepSpeed's reduce bucket(s) (resident
    once backward has filled them); gym_ddp's reducer buckets are its gradients (``estimate.resident_bucket_copy``).
    FSDP2 frees its unsharded parameters and gradients after each unit."""
    counts = param_counts(shape, setup)
    if strategy.framework == "torch":
        return resident_bucket_copy(strategy, counts.trainable) if strategy.stage == 0 else 0.0
    p = 2 if setup.precision == "bf16-mixed" else 4
    return float(p * zero_bucket_elements(shape, setup) * (2 if strategy.stage == 2 else 1))


def load_peak(shape: ModelShape, strategy: Strategy, setup: Setup) -> PhasePeak:
    """Peak of building the model, loading the checkpoint and setting up the strategy and its optimizer."""
    if setup.quantization != "none":
        return qlora_load_peak(shape, strategy, setup)
    counts, n = param_counts(shape, setup), setup.world_size
    t, f = counts.trainable, counts.frozen
    half = setup.precision == "bf16-mixed"
    frozen = 2 if half else 4
    if strategy.framework == "torch" and strategy.stage == 3:
        # Meta build -> fully_shard -> to_empty -> slices read into the fp32 shards (fp32 masters under bf16-mixed).
        shard = (4 * t + frozen * f) / n
        # The rows in flight: measured at 250M on 2 ranks (benchmarks/scale.py), 980 / 976 MiB at the load peak
        # against 997 planned; the term it replaced (1/N of one whole file, from when DCP's reader kept a file
        # mapped) planned 1,203.
        read = tensor_rows_bytes(shape, setup, n)
        if strategy.offload_parameters != "none":  # cpu_offload: the shards live on the host
            return _place(setup, 0.0, shard + read)
        return _place(setup, shard, read)
    if strategy.framework == "torch":
        # from_pretrained on every rank in the checkpoint dtype, then the trainables cast to fp32: the loaded copy is
        # held until the last tensor is cast (measured at 250M: +6.0 bytes per parameter above the process with a
        # bf16 folder). gym_ddp's reducer buckets are its gradients (step phase).
        d = setup.checkpoint_dtype_bytes
        return _place(setup, 4 * t + frozen * f + d * (t + f))
    states = model_states(shape, strategy, setup)
    p = 2 if half else 4
    if strategy.stage < 3:
        # The whole 16-bit model on every rank; deepspeed.initialize copies it into one flat buffer (both exist while
        # the parameters are moved in) and builds the fp32 master partition as ``partition.clone().to(fp32)``
        # (stage_1_and_2.py, "weights_partition"), so a 16-bit copy of the partition is held beside it while it is
        # cast. AdamW's states come with the first step. Traced at 250M on 2 ranks (VmHWM sampled with the Python
        # stack): the load peak, 2,237 MiB, is reached on that line, 2 + 2 + 2/N + 4/N bytes per parameter above the
        # process; 2.0 + 4/N after it.
        load = p * t + frozen * f + p * t + p * t / n + 4 * t / n
        return _place(setup, load, states.host)
    # ZeRO-3: zero.Init partitions the 16-bit weights as the model is built and each rank reads its partitions'
    # slices; deepspeed.initialize adds the 16-bit gradient partition and the fp32 master partition (AdamW's states
    # come with the first step). Measured at 1B: 2 + 2 + 4 bytes per parameter / N after load, and about two
    # gathered units more at its peak, reached in deepspeed.initialize (the same with transformers' own loader,
    # which gathered one module at a time: 2,183 against 2,191 MiB for the 0.4B MoE of benchmarks/scale.py).
    on_device = states.params + p * t / n + 4 * t / n + 2 * p * counts.largest_unit
    return _place(setup, on_device, states.host)


def qlora_load_peak(shape: ModelShape, strategy: Strategy, setup: Setup) -> PhasePeak:
    """Load of a QLoRA base: no 16-bit copy of a quantised layer exists, each process holds its final 4-bit tensors
    (``frozen_bytes``) and the adapters (fp32 under torch, bf16 + fp32 masters under DeepSpeed) while it reads one
    checkpoint tensor and quantises it (``quant_read_bytes``; counted on the device, the larger side if the
    quantisation runs on the host). gym_fsdp and ZeRO-3 ranks read only their rows; DDP and ZeRO-1/2 fill the whole
    model on the host and then move it to the GPU (``models.fill.fill_on_cpu``), so on GPUs the host holds the
    4-bit model once per process too."""
    counts, n = param_counts(shape, setup), setup.world_size
    t = counts.trainable
    p = 2 if setup.precision == "bf16-mixed" else 4
    base = frozen_bytes(shape, setup, p)  # non-NF4 frozen tensors in the model dtype
    if strategy.stage == 3:
        read = quant_read_bytes(shape, setup, n)
        if strategy.framework == "torch":
            # No file pages stay mapped: the 4-bit loader reads a tensor's rows through safetensors' own slice,
            # not DCP's reader (measured at 1B: 7-12 MiB of mapped checkpoint at the load peak).
            return _place(setup, (4 * t + base) / n + read)
        # ZeRO-3: the partitions, gradient partition and masters, and the larger of one tensor's rows being read
        # and the two units deepspeed.initialize gathers (load_peak's ZeRO-3 figure otherwise).
        states = model_states(shape, strategy, setup)
        return _place(setup, states.params + p * t / n + 4 * t / n + max(read, 2 * unit_bytes(shape, setup, p)))
    read = quant_read_bytes(shape, setup, 1)
    # DeepSpeed's initialize flattens the 16-bit trainables and builds their fp32 master partition (load_peak's
    # ZeRO-1/2 figure); DDP casts the adapters to fp32. Either happens after the read.
    extra = 4 * t if strategy.framework == "torch" else p * t + p * t + p * t / n + 4 * t / n
    if setup.accelerator == "cpu":
        return _place(setup, base + max(read, extra))
    return _place(setup, base + extra, base + read)


def step_peak(shape: ModelShape, strategy: Strategy, setup: Setup) -> PhasePeak:
    """Peak of a training step: every model state, the activations, the LM head/loss buffer and the strategy's
    buffers. The optimizer step adds nothing: fused AdamW (the module's default, ``optim.adamw_kernel``) updates
    in place, where the for-loop kernel needed 2 x the largest parameter and foreach a full-size copy."""
    states = model_states(shape, strategy, setup)
    b = setup.micro_batch_size
    tensors = states.total + activation_bytes(shape, setup, b) + logits_bytes(shape, setup, b)
    return _place(setup, tensors + buffer_bytes(shape, strategy, setup), states.host)


def held_after_step(shape: ModelShape, strategy: Strategy, setup: Setup) -> float:
    """Model-state bytes still held once a step is over (what save and export start from). ZeRO-1/2 free their
    16-bit gradients and the fp32 gradient partition after the step (measured at 250M: 2 + 12/N bytes per
    parameter + the bucket); torch keeps ``.grad`` until the next step zeroes it, ZeRO-3 its gradient partition."""
    states = model_states(shape, strategy, setup)
    if strategy.framework == "deepspeed" and strategy.stage < 3:
        return states.params + states.optimizer_state
    return states.total


def save_peak(shape: ModelShape, strategy: Strategy, setup: Setup) -> PhasePeak:
    """Peak of writing a checkpoint: the states stay where they are and are written from there (DCP and DeepSpeed
    write each rank's tensors, ``PartialFileCheckpointIO`` streams ``torch.save`` into the final folder; nothing
    is serialised into memory or staged in a temp dir first). The step's gathered buffers are free by then."""
    held = held_after_step(shape, strategy, setup) + resident_buffers(shape, strategy, setup)
    return _place(setup, held, model_states(shape, strategy, setup).host)


def export_peak(shape: ModelShape, strategy: Strategy, setup: Setup) -> PhasePeak:
    """Peak of the Hugging Face export at the end of fit: the states are still held; the exporter gathers one
    tensor at a time in fp32 and writes its copy in the export dtype (``checkpoint_dtype_bytes``, the source's)."""
    largest = shape.largest_tensor()
    one_tensor = max(largest * (4 + setup.checkpoint_dtype_bytes), _merged_nf4_bytes(shape, setup))
    # Lightning tears the strategy down before on_fit_end: the DDP wrapper and its reducer buckets are gone.
    buffers = 0.0 if strategy.framework == "torch" else resident_buffers(shape, strategy, setup)
    held = held_after_step(shape, strategy, setup) + buffers
    return _place(setup, held + one_tensor, model_states(shape, strategy, setup).host)


def _merged_nf4_bytes(shape: ModelShape, setup: Setup) -> float:
    """A merged QLoRA export of the largest NF4 layer (``hf_folder._merged``): its gathered 4-bit tensors, the weight
    dequantised in the export dtype, then ``(base.float() + B @ A * scale).to(dtype)``: the fp32 delta, the fp32
    base and their fp32 sum exist at once (12 B per weight)."""
    quant = quantized_base(shape, setup)
    largest = quant.largest_linear
    return largest * (quant.bytes_per_weight + setup.checkpoint_dtype_bytes + 12)


def phase_peaks(shape: ModelShape, strategy: Strategy, setup: Setup) -> PhasePeaks:
    """The peak of each phase for ``strategy`` (bytes per rank)."""
    return PhasePeaks(
        load=load_peak(shape, strategy, setup),
        step=step_peak(shape, strategy, setup),
        save=save_peak(shape, strategy, setup),
        export=export_peak(shape, strategy, setup),
    )


def qlora_peak(shape: ModelShape, strategy: str, world_size: int, phase: str, setup: Setup | None = None) -> PhasePeak:
    """The planner's peak per rank (host RSS and device bytes) of one phase of a QLoRA run, for comparing with a
    measured one (``MemoryCallback`` / ``benchmarks/scale.py``'s per-phase peaks).

    Args:
        shape: The model (``planner.resolve_shape(folder)`` for a checkpoint folder).
        strategy: A planner strategy key (``fsdp_full`` for gym_fsdp, ``zero3``, ``ddp``, ``zero1``, ``zero2``, ...).
        world_size: Data-parallel ranks N (one node of N).
        phase: ``load``, ``step``, ``save`` or ``export``.
        setup: The run's other settings (sequence, micro-batch, precision, LoRA rank, measured process baseline,
            ``accelerator="cpu"`` for CPU ranks); its rank count and quantisation are replaced. Default: LoRA r=16
            on all linear layers, bf16-mixed, the other :class:`Setup` defaults.
    """
    base = setup if setup is not None else Setup(lora_r=16)
    if base.lora_r <= 0:
        raise GymUserError("qlora_peak needs LoRA adapters (setup.lora_r > 0): QLoRA trains adapters on a 4-bit base.")
    if strategy not in STRATEGY_BY_KEY or phase not in PHASES:
        known = f"strategies {', '.join(STRATEGY_BY_KEY)}; phases {', '.join(PHASES)}"
        raise GymUserError(f"Unknown strategy {strategy!r} or phase {phase!r} ({known}).")
    run = replace(base, gpus_per_node=world_size, nodes=1, quantization="nf4")
    if not modelled(STRATEGY_BY_KEY[strategy], run):
        raise GymUserError(f"The planner does not model QLoRA with offloading ({strategy!r}).")
    return phase_peaks(shape, STRATEGY_BY_KEY[strategy], run).by_phase()[phase]
