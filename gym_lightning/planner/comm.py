"""Collectives, overlap and the slowest of N ranks: pure functions of bytes, ranks and link figures (no torch).

A collective of ``S`` bytes over ``n`` ranks lasts ``latency(n) + f x S / busbw`` (:func:`collective_seconds`), with
nccl-tests' bus-bandwidth factor ``f`` (``2(n-1)/n`` all-reduce, ``(n-1)/n`` all-gather, reduce-scatter and
all-to-all; ``doc/PERFORMANCE.md``) and a latency that grows with the ring: one small-message latency plus a hop
latency per ring step (:func:`ring_latency`; all-reduce crosses nodes in a tree, :func:`tree_latency`). The
bus bandwidth it implies, ``f S / time``, falls as the per-rank message ``S/n`` shrinks, as nccl-tests' curves do
(NCCL's maintainers: "the latency of ring increases linearly with the communicator size", nccl#1712).

Overlap (:func:`overlapped_seconds`): collectives on their own stream hide behind the compute of the same phase,
except the part with nothing to hide behind; while they run they take SMs from compute (``contention`` x their
hidden seconds, :func:`contention_seconds`). GPUs of one SKU run at different speeds (power management and
manufacturing: Sinha et al., SC'22, arXiv 2208.11035), and a synchronous step runs at the slowest of N ranks
(:func:`slowest_of`: the expected maximum of N normal draws, Blom's approximation, of a rank's relative speed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from gym_lightning.errors import GymUserError


@dataclass(frozen=True)
class Network:
    """The figures of the links a collective runs on (``planner.machines`` fills them from the hardware catalog).

    Args:
        intra_bandwidth: All-reduce bus bandwidth among a node's GPUs for large messages, bytes/s (nccl-tests).
        inter_bandwidth: Bus bandwidth of a collective spanning nodes, bytes/s (0: one node only).
        intra_latency: Seconds of a small collective within a node.
        inter_latency: Seconds of a small collective across nodes.
        intra_hop: Seconds each ring step within a node adds.
        inter_hop: Seconds each ring step that crosses nodes adds.
        gather_share: All-gather bus bandwidth / all-reduce's (1 for NCCL; measured for gloo).
        scatter_share: Reduce-scatter bus bandwidth / all-reduce's.
        overlap: Whether collectives run beside compute (NCCL's stream); gloo computes on the training cores.
        contention: Compute seconds lost per second of collectives hidden behind it (their SMs' share).
        dispersion: Relative standard deviation of a rank's compute speed across the job's GPUs.
    """

    intra_bandwidth: float
    inter_bandwidth: float = 0.0
    intra_latency: float = 10e-6
    inter_latency: float = 20e-6
    intra_hop: float = 0.0
    inter_hop: float = 0.0
    gather_share: float = 1.0
    scatter_share: float = 1.0
    overlap: bool = True
    contention: float = 0.0
    dispersion: float = 0.0


@dataclass(frozen=True)
class Group:
    """The ranks one collective spans (``ranks`` over ``nodes`` nodes) and the network they sit on."""

    ranks: int
    nodes: int
    network: Network

    @property
    def bandwidth(self) -> float:
        """Bus bandwidth: the node's link within one; across nodes the fabric's, capped by the node's (a ring
        crosses both)."""
        net = self.network
        if self.nodes <= 1:
            return net.intra_bandwidth
        if net.inter_bandwidth <= 0:
            raise GymUserError(
                f"{self.nodes} nodes need an inter-node bus bandwidth: name an --interconnect (a fabric such as "
                "ib-ndr400) or pass --inter_node_bandwidth."
            )
        return min(net.intra_bandwidth, net.inter_bandwidth)

    def all_reduce(self, nbytes: float, calls: int = 1) -> float:
        latency = tree_latency(self.ranks, self.nodes, self.network)
        return collective_seconds(nbytes, 2 * bus_factor(self.ranks), self.bandwidth, latency, calls)

    def all_gather(self, nbytes: float, calls: int = 1) -> float:
        bandwidth = self.bandwidth * self.network.gather_share
        latency = ring_latency(self.ranks, self.nodes, self.network)
        return collective_seconds(nbytes, bus_factor(self.ranks), bandwidth, latency, calls)

    def reduce_scatter(self, nbytes: float, calls: int = 1) -> float:
        bandwidth = self.bandwidth * self.network.scatter_share
        latency = ring_latency(self.ranks, self.nodes, self.network)
        return collective_seconds(nbytes, bus_factor(self.ranks), bandwidth, latency, calls)

    def all_to_all(self, nbytes: float, calls: int = 1) -> float:
        """All-to-all of ``nbytes`` held by each rank: ``(n-1)/n`` of them leave it, one latency per call."""
        latency = self.network.intra_latency if self.nodes <= 1 else self.network.inter_latency
        return collective_seconds(nbytes, bus_factor(self.ranks), self.bandwidth, latency, calls)


def bus_factor(ranks: int) -> float:
    """nccl-tests' all-gather / reduce-scatter factor ``(n-1)/n`` (all-reduce's is twice it)."""
    return (ranks - 1) / ranks if ranks > 1 else 0.0


def collective_seconds(nbytes: float, factor: float, bandwidth: float, latency: float, calls: int = 1) -> float:
    """``calls`` collectives moving ``nbytes`` in all: ``factor x bytes / busbw + calls x latency`` (0 with nothing
    to move or one rank, ``factor`` 0)."""
    if factor <= 0 or nbytes <= 0:
        return 0.0
    return factor * nbytes / bandwidth + calls * latency


def ring_latency(ranks: int, nodes: int, network: Network) -> float:
    """Latency of a ring collective (all-gather, reduce-scatter) over ``ranks`` on ``nodes`` nodes: the small-message
    latency plus one hop per ring step, ``ranks - nodes`` of them inside nodes and ``nodes`` across (NCCL orders its
    rings node by node)."""
    if ranks <= 1:
        return 0.0
    if nodes <= 1:
        return network.intra_latency + (ranks - 1) * network.intra_hop
    return network.inter_latency + (ranks - nodes) * network.intra_hop + nodes * network.inter_hop


def tree_latency(ranks: int, nodes: int, network: Network) -> float:
    """Latency of an all-reduce: a ring within the node (reduce-scatter and all-gather, ``2(g - 1)`` steps) and a
    tree across nodes (``2 log2(nodes)`` steps up and down), as NCCL's tree and NVLS-tree algorithms do."""
    if ranks <= 1:
        return 0.0
    per_node = max(1, ranks // max(nodes, 1))
    intra = network.intra_latency + 2 * (per_node - 1) * network.intra_hop
    if nodes <= 1:
        return intra
    return intra - network.intra_latency + network.inter_latency + 2 * math.log2(nodes) * network.inter_hop


def overlapped_seconds(compute: float, communication: float, exposed: float, overlap: bool = True) -> float:
    """Seconds of a phase whose collectives run beside ``compute``: ``exposed`` seconds of them have nothing to hide
    behind (the first gather, the last bucket), the rest hides behind compute and shows only beyond it."""
    if not overlap:
        return compute + communication
    exposed = min(exposed, communication)
    return compute + exposed + max(0.0, communication - exposed - compute)


def contention_seconds(compute: float, communication: float, exposed: float, contention: float) -> float:
    """Compute seconds lost to the collectives hidden behind ``compute`` (their kernels hold SMs and memory
    bandwidth): ``contention x`` the hidden part, ``min(communication - exposed, compute)``."""
    hidden = max(0.0, min(communication - exposed, compute))
    return contention * hidden


def expected_maximum(ranks: int) -> float:
    """The expected maximum of ``ranks`` standard normal draws (Blom 1958: ``Φ⁻¹((n - 0.375) / (n + 0.25))``; 0 for
    one rank)."""
    if ranks <= 1:
        return 0.0
    return NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))


def slowest_of(seconds: float, ranks: int, dispersion: float) -> float:
    """What the slowest of ``ranks`` ranks adds to ``seconds`` of compute every rank does between two
    synchronisations, when a rank's speed varies by ``dispersion`` (relative standard deviation) across ranks."""
    return seconds * dispersion * expected_maximum(ranks)


__all__ = [
    "Group",
    "Network",
    "bus_factor",
    "collective_seconds",
    "contention_seconds",
    "expected_maximum",
    "overlapped_seconds",
    "ring_latency",
    "slowest_of",
    "tree_latency",
]
