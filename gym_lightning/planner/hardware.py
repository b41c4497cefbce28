"""The figures of one machine type the step-time model reads: a device's kernels (``planner.compute.Kernels``), the
links between devices (``planner.comm.Network``) and the host (:class:`HostFigures`). ``planner.machines`` fills
them from the hardware catalog (``gym_lightning/assets/hardware.yaml``) or from measured CPU figures."""

from __future__ import annotations

from dataclasses import dataclass

from gym_lightning.planner.comm import Network
from gym_lightning.planner.compute import Kernels


@dataclass(frozen=True)
class HostFigures:
    """The host side of one node.

    Args:
        host_bandwidth: Pinned host <-> device copy bytes/s of one device (PCIe).
        host_memory_bandwidth: Host DRAM bytes/s of one node (the CPU optimizer), shared by its ranks.
        nvme_bandwidth: NVMe bytes/s of one node, shared by its ranks.
        zero3_fetch: Host seconds of one DeepSpeed ZeRO-3 parameter fetch (its module hook, the all-gather's launch
            and the wait for it), paid per hooked module per pass.
    """

    host_bandwidth: float = 25e9
    host_memory_bandwidth: float = 200e9
    nvme_bandwidth: float = 6e9
    zero3_fetch: float = 0.0


@dataclass(frozen=True)
class Hardware:
    """One machine type: its name for the report, and its kernels, network and host figures."""

    name: str
    kernels: Kernels
    network: Network
    host: HostFigures = HostFigures()

    @property
    def peak_flops(self) -> float:
        return self.kernels.peak_flops

    @property
    def compute_efficiency(self) -> float:
        return self.kernels.efficiency

    @property
    def memory_bandwidth(self) -> float:
        return self.kernels.memory_bandwidth


__all__ = ["Hardware", "HostFigures"]
