"""The machines a plan runs on: a catalog GPU, its family's kernel efficiencies, its node's link and the fabric
between nodes (``gym_lightning/assets/hardware.yaml`` through ``metrics.hardware``) become the step-time model's
:class:`~gym_lightning.planner.hardware.Hardware`, with the run's explicit figures over them.

The kernel efficiency (how close a project's kernels come to the roofline of ``planner.compute``) is one figure per
(project, GPU). gym_lightning's own is calibrated once, on the plain PyTorch loop's H200 row
(:data:`~gym_lightning.planner.timing.PLAIN_LOOP`, :func:`calibrated_compute_efficiency`), and used for every GPU;
``compute_efficiency`` overrides it (docs/planner.md, "Validation", sets it per project from one row each).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from gym_lightning.errors import GymUserError
from gym_lightning.metrics import hardware as catalog
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.comm import Network
from gym_lightning.planner.compute import Kernels, calibrated_efficiency
from gym_lightning.planner.hardware import Hardware, HostFigures
from gym_lightning.planner.spec import DEFAULT_GPU, RunSpec

# The fabric assumed when a plan spans nodes and names none: the usual one of H100 / H200 clusters (8 x 400 Gb/s
# InfiniBand NDR per node, one NIC per GPU). The report says it was assumed.
DEFAULT_FABRIC = "ib-ndr400"
GB = 1e9
T = TypeVar("T")


@dataclass(frozen=True)
class Figures:
    """Explicit figures that override the catalog's (``None``: the catalog's).

    Args:
        peak_tflops: Dense TFLOP/s of one GPU in the compute dtype.
        compute_efficiency: How close the kernels come to the roofline (0 < x <= 1).
        memory_bandwidth_gbs: GPU memory GB/s (datasheet; the family's efficiency applies).
        intra_node_bandwidth_gbs: All-reduce bus bandwidth within a node, GB/s (nccl-tests ``busbw``).
        inter_node_bandwidth_gbs: Bus bandwidth of a collective across nodes, GB/s.
        host_bandwidth_gbs: Pinned host <-> GPU copy GB/s (offload).
    """

    peak_tflops: float | None = None
    compute_efficiency: float | None = None
    memory_bandwidth_gbs: float | None = None
    intra_node_bandwidth_gbs: float | None = None
    inter_node_bandwidth_gbs: float | None = None
    host_bandwidth_gbs: float | None = None

    @classmethod
    def of(cls, spec: RunSpec) -> Figures:
        """The overrides ``spec.hardware`` holds."""
        return cls(**{name: getattr(spec.hardware, name) for name in cls.__dataclass_fields__})

    def problems(self) -> list[str]:
        """Every figure that is not a positive number (an efficiency above 1 too)."""
        found = []
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                found.append(f"{name} must be a positive number, got {value!r}")
        if isinstance(self.compute_efficiency, (int, float)) and self.compute_efficiency > 1:
            found.append(
                f"compute_efficiency is a fraction of the roofline, at most 1, got {self.compute_efficiency!r}"
            )
        return found


@dataclass(frozen=True)
class Machine:
    """A plan's hardware: the figures the step-time model reads, the GPU's memory, and what was assumed."""

    hardware: Hardware
    gpu_memory: int
    gpu: str
    notes: tuple[str, ...] = field(default=())


def compute_dtype(precision: str) -> str:
    """The dtype the matmuls run in: bf16 under ``bf16-mixed``, fp32 otherwise."""
    return "bf16" if precision.startswith("bf16") else "fp32"


@functools.cache
def calibrated_compute_efficiency() -> float:
    """gym_lightning's kernel efficiency: what makes the model's plain-loop step on one H200 last what it measured
    (:data:`~gym_lightning.planner.timing.PLAIN_LOOP`)."""
    from gym_lightning.planner.timing import PLAIN, PLAIN_LOOP, step_time

    shape = resolve_shape(str(PLAIN_LOOP["model"]))
    spec = RunSpec(
        gpus_per_node=1, micro_batch_size=int(PLAIN_LOOP["micro_batch"]), seq_length=int(PLAIN_LOOP["seq_length"])
    )
    hardware = _hardware("bf16-mixed", 1, str(PLAIN_LOOP["gpu"]), None, Figures(compute_efficiency=1.0))[0]
    step = step_time(shape, PLAIN, spec, hardware)
    measured = spec.micro_batch_size * spec.seq_length / float(PLAIN_LOOP["tokens_per_s"])
    return calibrated_efficiency(step.total, measured, step.optimizer)


def _lookup(find: Callable[[], T], problems: list[str]) -> T | None:
    """``find()``, or ``None`` with its error added to ``problems`` (every unknown name in one message)."""
    try:
        return find()
    except GymUserError as err:
        problems.append(str(err).rstrip("."))
        return None


def _links(
    intra: catalog.Link | None, interconnect: str | None, nodes: int
) -> tuple[catalog.Link | None, catalog.Link | None, list[str]]:
    """``(intra-node link, fabric or None, notes)``: ``interconnect`` names a fabric, a link, or ``link,fabric``;
    ``intra`` is the GPU's usual link (``None`` when the GPU is unknown)."""
    notes: list[str] = []
    inter = None
    for name in [] if interconnect is None else [part.strip() for part in interconnect.split(",") if part.strip()]:
        found = catalog.fabric(name)
        if found.key in catalog.LINKS:
            intra = found
        else:
            inter = found
    if nodes > 1 and inter is None:
        inter = catalog.fabric(DEFAULT_FABRIC)
        notes.append(f"no --interconnect between the {nodes} nodes: {inter.name} assumed")
    return intra, inter, notes


def machine(
    precision: str,
    nodes: int,
    gpu: str | None = None,
    interconnect: str | None = None,
    figures: Figures | None = None,
) -> Machine:
    """The :class:`Machine` of ``gpu`` (a catalog name; :data:`DEFAULT_GPU` when ``None``) in nodes linked by
    ``interconnect`` (a fabric such as ``ib-ndr400``, an intra-node link such as ``pcie4``, or ``pcie4,ethernet-100``),
    with ``figures`` over the catalog's.

    Args:
        precision: The run's precision: its compute dtype picks the peak.
        nodes: Nodes of the job (a fabric is assumed beyond one when none is named).
        gpu: A catalog GPU key or alias.
        interconnect: See above.
        figures: Explicit figures that override the catalog's.
    """
    hardware, chip, notes = _hardware(precision, nodes, gpu or DEFAULT_GPU, interconnect, figures or Figures())
    return Machine(hardware, chip.memory, chip.key, tuple(notes))


def machine_of(spec: RunSpec) -> Machine:
    """The :class:`Machine` ``spec.hardware`` names (GPU, interconnect, explicit figures)."""
    return machine(spec.precision, spec.nodes, spec.gpu, spec.interconnect, Figures.of(spec))


def _hardware(
    precision: str, nodes: int, gpu: str, interconnect: str | None, figures: Figures
) -> tuple[Hardware, catalog.GPU, list[str]]:
    """The catalog's figures of ``gpu`` and its links, ``figures`` over them (one error lists every problem)."""
    problems = figures.problems()
    chip = _lookup(lambda: catalog.gpu(gpu), problems)
    links = _lookup(lambda: _links(catalog.link(chip.link) if chip else None, interconnect, nodes), problems)
    if problems or chip is None or links is None or links[0] is None:
        raise GymUserError("; ".join(problems) + ".")
    intra, inter, notes = links
    dtype = compute_dtype(precision)
    peak = chip.dense_peak.get(dtype, 0.0) if figures.peak_tflops is None else figures.peak_tflops * 1e12
    if peak <= 0:
        raise GymUserError(f"The catalog has no dense {dtype} peak for {chip.name}: pass --peak_tflops.")
    family = catalog.KERNELS[chip.kernels]
    memory = _gbs(figures.memory_bandwidth_gbs) or chip.memory_bandwidth
    kernels = Kernels(
        peak_flops=peak,
        memory_bandwidth=memory * family.memory_efficiency,
        efficiency=figures.compute_efficiency or calibrated_compute_efficiency(),
        gemm_peak=family.gemm_peak,
        gemm_overhead=family.gemm_overhead,
        attention_peak=family.attention_peak,
        launch=catalog.HOST.kernel_launch,
    )
    network = _network(intra, inter if nodes > 1 else None, figures)
    host = HostFigures(
        host_bandwidth=_gbs(figures.host_bandwidth_gbs) or catalog.host_link(chip.host_link).bandwidth,
        host_memory_bandwidth=catalog.HOST.memory_bandwidth,
        nvme_bandwidth=catalog.HOST.nvme_bandwidth,
        zero3_fetch=catalog.HOST.zero3_fetch,
    )
    name = f"{chip.key}, {intra.key}" + (f", {inter.key}" if inter is not None and nodes > 1 else "")
    return Hardware(name, kernels, network, host), chip, notes


def _network(intra: catalog.Link, inter: catalog.Link | None, figures: Figures) -> Network:
    """The links' figures (the fabric's only when the job spans nodes), with the cluster's losses."""
    return Network(
        intra_bandwidth=_gbs(figures.intra_node_bandwidth_gbs) or intra.bus_bandwidth,
        inter_bandwidth=_gbs(figures.inter_node_bandwidth_gbs) or (inter.bus_bandwidth if inter else 0.0),
        intra_latency=intra.latency,
        inter_latency=inter.latency if inter is not None else intra.latency,
        intra_hop=intra.hop_latency,
        inter_hop=inter.hop_latency if inter is not None else intra.hop_latency,
        contention=catalog.CLUSTER.contention,
        dispersion=catalog.CLUSTER.dispersion,
    )


def _gbs(value: float | None) -> float:
    return 0.0 if value is None else value * GB


def cpu_hardware(
    matmul_flops: float,
    memory_bandwidth: float,
    bus_bandwidth: float,
    latency: float,
    compute_efficiency: float,
    gather_bus_bandwidth: float = 0.0,
    scatter_bus_bandwidth: float = 0.0,
) -> Hardware:
    """The step-time figures of CPU ranks, measured (``metrics.calibrate.measure_host`` on every rank at once):
    gloo's collectives compute on the cores that train, so nothing overlaps (``overlap=False``), and the "device"
    memory is the host's. The matmul rate is the model width's, so GEMMs run at it without a size term.

    Args:
        matmul_flops: One rank's matmul FLOP/s in the compute dtype.
        memory_bandwidth: One rank's memory bandwidth, bytes/s, measured while the others measure theirs.
        bus_bandwidth: gloo's all-reduce bus bandwidth between the ranks, bytes/s (0 alone).
        latency: Seconds of a small all-reduce.
        compute_efficiency: The fraction of the roofline a training loop reaches on CPU ranks.
        gather_bus_bandwidth: gloo's all-gather bus bandwidth, bytes/s (0: as the all-reduce's).
        scatter_bus_bandwidth: gloo's reduce-scatter bus bandwidth, bytes/s (0: as the all-reduce's).
    """
    shares = [
        share / bus_bandwidth if share and bus_bandwidth else 1.0
        for share in (gather_bus_bandwidth, scatter_bus_bandwidth)
    ]
    bus = bus_bandwidth or memory_bandwidth
    kernels = Kernels(peak_flops=matmul_flops, memory_bandwidth=memory_bandwidth, efficiency=compute_efficiency)
    network = Network(bus, bus, latency, latency, gather_share=shares[0], scatter_share=shares[1], overlap=False)
    host = HostFigures(memory_bandwidth, memory_bandwidth, memory_bandwidth, catalog.HOST.zero3_fetch)
    return Hardware("CPU ranks (measured)", kernels, network, host)


__all__ = ["DEFAULT_FABRIC", "DEFAULT_GPU", "Figures", "Machine", "cpu_hardware", "machine", "machine_of"]
