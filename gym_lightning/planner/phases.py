"""The peak per rank of each phase of a run: load, training step, checkpoint save, export (``gym plan``'s "Peak per
phase" table; checked against measured peaks in docs/benchmarks.md by ``benchmarks/scale.py``).

Each phase's formula is its strategy family's (``planner.families``): load (gym_fsdp builds on the meta device and
reads its rows of one tensor at a time; DDP and ZeRO-1/2 load the whole checkpoint on every rank; ZeRO-3 builds
under ``zero.Init``), step (the model states, activations, the LM head/loss buffer and the strategy's buffers),
save (the states written from where they are) and export (one tensor gathered at a time). QLoRA changes the load
(the base is quantised as it is read) and the export (each NF4 layer dequantised and merged with its adapters).

On GPUs the phases' tensors are on the device and the host holds the process plus what loading maps in; on CPU
ranks (``accelerator == "cpu"``) every byte is host memory and the device figure is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.families.base import PhasePeak, supported
from gym_lightning.planner.spec import RunSpec
from gym_lightning.planner.strategies import STRATEGY_BY_KEY, Strategy

PHASES: tuple[str, ...] = ("load", "step", "save", "export")


@dataclass(frozen=True)
class PhasePeaks:
    """The peak of each phase for one strategy (bytes per rank)."""

    load: PhasePeak
    step: PhasePeak
    save: PhasePeak
    export: PhasePeak

    def by_phase(self) -> dict[str, PhasePeak]:
        return {phase: getattr(self, phase) for phase in PHASES}


def phase_peaks(shape: ModelShape, strategy: Strategy, spec: RunSpec) -> PhasePeaks:
    """The peak of each phase for ``strategy`` (bytes per rank)."""
    model = cost_model(strategy, shape, spec)
    return PhasePeaks(model.load_peak(), model.step_peak(), model.save_peak(), model.export_peak())


def qlora_peak(
    shape: ModelShape, strategy: str, world_size: int, phase: str, setup: RunSpec | None = None
) -> PhasePeak:
    """The planner's peak per rank (host RSS and device bytes) of one phase of a QLoRA run, for comparing with a
    measured one (``MemoryCallback`` / ``benchmarks/scale.py``'s per-phase peaks).

    Args:
        shape: The model (``planner.resolve_shape(folder)`` for a checkpoint folder).
        strategy: A planner strategy key (``fsdp_full`` for gym_fsdp, ``zero3``, ``ddp``, ``zero1``, ``zero2``, ...).
        world_size: Data-parallel ranks N (one node of N).
        phase: ``load``, ``step``, ``save`` or ``export``.
        setup: The run's other settings; its rank count and quantisation are replaced. Default: LoRA r=16 on all
            linear layers, bf16-mixed, the other defaults.
    """
    base = setup if setup is not None else RunSpec(lora_r=16)
    if base.lora_r <= 0:
        raise GymUserError("qlora_peak needs LoRA adapters (setup.lora_r > 0): QLoRA trains adapters on a 4-bit base.")
    if strategy not in STRATEGY_BY_KEY or phase not in PHASES:
        known = f"strategies {', '.join(STRATEGY_BY_KEY)}; phases {', '.join(PHASES)}"
        raise GymUserError(f"Unknown strategy {strategy!r} or phase {phase!r} ({known}).")
    run = replace(base, gpus_per_node=world_size, nodes=1, quantization="nf4")
    if not supported(STRATEGY_BY_KEY[strategy], run):
        raise GymUserError(f"The planner does not model QLoRA with offloading ({strategy!r}).")
    return phase_peaks(shape, STRATEGY_BY_KEY[strategy], run).by_phase()[phase]


__all__ = ["PHASES", "PhasePeak", "PhasePeaks", "phase_peaks", "qlora_peak"]
