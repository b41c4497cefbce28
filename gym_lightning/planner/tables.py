"""The plan as text and JSON: the memory table, the peak per phase, the header lines and the recommendation
(``PlanReport.table()`` / ``to_dict()`` call these; the speed table is ``planner.budget``'s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gym_lightning.planner.activations import mlp_tiles
from gym_lightning.planner.budget import aligned
from gym_lightning.planner.estimate import Estimate
from gym_lightning.planner.experts import targeted_weights
from gym_lightning.planner.long_sequence import SEQUENCE_GRID, sequence_step
from gym_lightning.planner.machines import Machine
from gym_lightning.planner.params import param_counts, quantized_base
from gym_lightning.planner.phases import PHASES, PhasePeaks
from gym_lightning.planner.spec import GiB, local_tokens

if TYPE_CHECKING:
    from gym_lightning.planner.report import PlanReport

COLUMNS = ("params", "grads", "optimizer_state", "activations", "logits", "buffers", "gpu_total")
COLUMNS += ("host_per_node", "nvme_per_node")
HEADER = ["strategy", "params", "grads", "optim", "activ", "logits", "buffers", "GPU total", "host/node"]
HEADER += ["NVMe/node", "fits", "max mbs"]


def gib(value: float, unit: bool = True) -> str:
    text = f"{value / GiB:.1f}"
    return f"{text} GiB" if unit else text


def fits_text(e: Estimate) -> str:
    if e.fits:
        return "yes"
    return "no (GPU+host)" if not (e.fits_gpu or e.fits_host) else ("no (GPU)" if not e.fits_gpu else "no (host)")


def memory_row(e: Estimate) -> list[str]:
    if not e.modelled:
        return [e.strategy.label, *(["—"] * len(COLUMNS)), "not modelled", "—"]
    cells = [gib(getattr(e, name), unit=False) for name in COLUMNS]
    return [e.strategy.label, *cells, fits_text(e), str(e.max_micro_batch)]


def estimate_dict(e: Estimate) -> dict[str, Any]:
    out: dict[str, Any] = {"key": e.strategy.key, "label": e.strategy.label, "strategy": e.strategy.trainer_strategy}
    out["bytes"] = {name: round(getattr(e, name)) for name in (*COLUMNS, "reference")}
    out["bytes"]["model_states"] = round(e.model_states)
    out.update(fits=e.fits, fits_gpu=e.fits_gpu, fits_host=e.fits_host, max_micro_batch=e.max_micro_batch)
    out["modelled"] = e.modelled
    return out


def machine_dict(found: Machine) -> dict[str, Any]:
    hw = found.hardware
    return {
        "gpu": found.gpu,
        "name": hw.name,
        "peak_flops": hw.peak_flops,
        "compute_efficiency": hw.compute_efficiency,
        "memory_bandwidth": hw.memory_bandwidth,
        "intra_node_bus_bandwidth": hw.network.intra_bandwidth,
        "inter_node_bus_bandwidth": hw.network.inter_bandwidth,
        "host_bandwidth": hw.host.host_bandwidth,
        "assumed": list(found.notes),
    }


def phases_dict(peaks: PhasePeaks) -> dict[str, dict[str, int]]:
    return {name: {"host": round(p.host), "device": round(p.device)} for name, p in peaks.by_phase().items()}


def mode_line(report: PlanReport) -> str:
    """``full finetune``, ``LoRA r=16 (all-linear + experts gate_up_proj, down_proj)`` or the QLoRA line with
    the base weights in NF4 (and how many of them are experts)."""
    s = report.setup
    if s.lora_r == 0:
        return "full finetune"
    experts = targeted_weights(s.lora_target_parameters)
    targets = [] if s.lora_targets == "none" else [s.lora_targets]
    targets += [f"experts {', '.join(experts)}"] if experts else []
    adapted = f"r={s.lora_r} ({' + '.join(targets)})"
    if s.quantization == "none":
        return f"LoRA {adapted}"
    quant = quantized_base(report.shape, s)
    of_them = f", {quant.expert_weights / 1e9:.2f}B of them experts" if quant.expert_weights else ""
    return (
        f"QLoRA {adapted}, {quant.weights / 1e9:.2f}B base weights in NF4 at {8 * quant.bytes_per_weight:.2f} "
        f"bits{of_them}"
    )


def header_lines(report: PlanReport) -> list[str]:
    """The table's first lines: the model and its mode, the hardware and the batch."""
    shape, s = report.shape, report.setup
    counts = param_counts(shape, s)
    active = ""
    if shape.is_moe:
        experts = f"{shape.experts_per_token} of {shape.num_experts} experts per token"
        active = f" ({shape.active_params() / 1e9:.2f}B active, {experts})"
    stage = s.training.kind.description
    return [
        f"{shape.name}: {counts.total_with_adapters / 1e9:.2f}B parameters{active}, "
        f"{counts.trainable / 1e9:.3g}B trainable ({mode_line(report)}), {s.optimizer}, {s.precision}; {stage}",
        f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s) of {gib(s.hardware.gpu_bytes)} "
        f"({gib(s.usable_gpu_memory)} usable), host {gib(s.host_memory)} per node; micro-batch "
        f"{s.micro_batch_size} x {s.seq_length} tokens, activation checkpointing "
        f"{'on' if s.activation_checkpointing else 'off'}. GiB per GPU unless marked per node.",
        *reference_lines(report),
        *long_sequence_lines(report),
        "",
    ]


# What the header says of each way a run holds its reference (RunSpec.reference_hold).
REFERENCE_LINES = {
    "adapters_off": "the policy's base with its LoRA adapters off (no second copy); its forward in every step",
    "copy": "a frozen {dtype} copy held as each strategy holds the policy (the ref column: whole under DDP and "
    "ZeRO-1/2, sharded under FSDP and ZeRO-3); its forward in every step",
    "precomputed": "precompute_ref_log_probs: one forward pass over the data before training (the ref pass "
    "column, once), none held or run in training",
}


def reference_lines(report: PlanReport) -> list[str]:
    """The header's line on a preference stage: its sequences per example and how the reference is held."""
    s = report.setup
    kind = s.training.kind
    if kind.sequences == 1 and not kind.detached and not kind.reference:
        return []
    rows = f"{kind.sequences} sequence(s) per example trained"
    rows += f", {kind.detached} more forward without gradient" if kind.detached else ""
    dtype = {"auto": "16-bit" if s.precision == "bf16-mixed" else "fp32"}.get(s.reference_dtype, s.reference_dtype)
    held = REFERENCE_LINES.get(s.reference_hold, "none (reference-free)").format(dtype=dtype)
    return [f"Preference: {rows}; reference: {held}."]


def long_sequence_lines(report: PlanReport) -> list[str]:
    """The header's lines on sequence parallelism, the tiled MLP and the "longest seq" column, when in use."""
    s, parts = report.setup, []
    if s.sequence_parallel_size > 1:
        parts.append(
            f"Sequence parallel {s.sequence_parallel_size}: each sequence split over {s.sequence_parallel_size} "
            f"GPUs ({s.local_seq_length:,} tokens each), {s.data_parallel_size} data-parallel group(s)."
        )
    tiles = mlp_tiles(report.shape, s, s.micro_batch_size)
    if tiles > 1:
        parts.append(f"MLP in {tiles} tiles of at most {s.mlp_tile_tokens:,} tokens.")
    elif s.mlp_tile_tokens > 0 and report.shape.is_moe:  # models.tiling leaves expert blocks alone
        parts.append("MLP tiling: not applied to a mixture of experts' experts.")
    elif s.mlp_tile_tokens > 0:
        parts.append(f"MLP tiling: the {local_tokens(s, s.micro_batch_size):,} tokens fit one tile, none.")
    lines = [" ".join(parts)] if parts else []
    if report.show_longest_sequence:
        lines.append(
            f"Longest seq: the longest sequence that fits the GPU at micro-batch 1, in steps of "
            f"{sequence_step(s):,} tokens (multiples of {SEQUENCE_GRID:,} and of sp)."
        )
    return lines


def memory_table(report: PlanReport) -> list[str]:
    """One row per strategy (and the "longest seq" column when asked)."""
    header, rows = list(HEADER), [memory_row(e) for e in report.estimates]
    if report.setup.reference_hold == "copy":  # the reference copy's bytes beside the policy's states
        header.insert(COLUMNS.index("gpu_total") + 1, "ref")
        for row, e in zip(rows, report.estimates, strict=True):
            row.insert(COLUMNS.index("gpu_total") + 1, gib(e.reference, unit=False) if e.modelled else "—")
    if report.show_longest_sequence:
        header.append("longest seq")
        for row, e, n in zip(rows, report.estimates, report.longest_sequences(), strict=True):
            row.append(f"{n:,}" if e.modelled else "—")
    return aligned([header, *rows])


def phase_table(estimates: Sequence[Estimate], peaks: Sequence[PhasePeaks], cpu: bool) -> list[str]:
    """Peak per rank in each phase, GiB: ``host / device`` on GPUs, host only on CPU ranks."""
    title = "host RAM per rank (CPU ranks)" if cpu else "host RAM / GPU memory per rank"
    rows = [["strategy", *PHASES]]
    for e, found in zip(estimates, peaks, strict=True):
        cells = [
            gib(p.host, unit=False) if cpu else f"{gib(p.host, unit=False)} / {gib(p.device, unit=False)}"
            for p in found.by_phase().values()
        ]
        rows.append([e.strategy.label, *(cells if e.modelled else ["—"] * len(cells))])
    return [f"Peak per phase, GiB, {title}:", *aligned(rows)]


__all__ = [
    "estimate_dict",
    "gib",
    "header_lines",
    "machine_dict",
    "memory_table",
    "phase_table",
    "phases_dict",
    "reference_lines",
]
