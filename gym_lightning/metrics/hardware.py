"""The hardware catalog: GPUs, intra-node links, inter-node fabrics, host links and host defaults, read from data.

The figures live in ``gym_lightning/assets/hardware.yaml``, each with its source and, where it is derived rather than
measured, the assumption that derived it; this module only loads, validates and looks them up (pure: yaml and
dataclasses, no torch). :mod:`gym_lightning.metrics.peak_flops` builds its MFU table from :data:`GPUS`, and the
planner reads memory, bandwidths and link figures for ``--gpu NAME --interconnect NAME``.

Units here are SI base units: bytes, bytes/s, FLOP/s, seconds. Memory sizes are binary (``"80GB"`` = 80 * 2**30
bytes, as the planner's ``parse_bytes`` reads them); bandwidths are decimal (``*_gbs`` = 1e9 bytes/s), as
datasheets and nccl-tests print them. Link and fabric bandwidths are nccl-tests all_reduce "busbw": an all-reduce of
``S`` bytes over ``n`` ranks takes about ``2 * (n - 1) / n * S / bus_bandwidth + latency``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gym_lightning.errors import GymUserError, raise_if_problems

CATALOG_PATH = Path(__file__).resolve().parents[1] / "assets" / "hardware.yaml"

_GB = 1e9  # datasheet and nccl-tests GB/s are decimal
_TFLOPS = 1e12
_US = 1e-6
_BINARY_UNITS = {"MB": 2**20, "MIB": 2**20, "GB": 2**30, "GIB": 2**30, "TB": 2**40, "TIB": 2**40}
_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GPU:
    """One GPU model: memory, memory bandwidth, dense peaks, and the links it usually sits on."""

    key: str
    name: str
    aliases: tuple[str, ...]
    memory: int  # bytes (binary: "80GB" = 80 * 2**30)
    memory_bandwidth: float  # bytes/s, datasheet
    dense_peak: dict[str, float]  # dtype -> dense FLOP/s (never the 2:4-sparse figure)
    link: str  # key into LINKS: the usual intra-node link of this form factor
    host_link: str  # key into HOST_LINKS: GPU <-> host copies
    kernels: str  # key into KERNELS: the GPU family's kernel efficiencies
    cuda_names: tuple[str, ...]  # regexes on the lower-cased torch.cuda.get_device_name()
    source: str


@dataclass(frozen=True)
class Link:
    """An intra-node link or an inter-node fabric, as nccl-tests all_reduce figures."""

    key: str
    name: str
    bus_bandwidth: float  # bytes/s, all_reduce busbw for messages >= 1 GB
    latency: float  # seconds, small-message all_reduce
    hop_latency: float  # seconds each ring step over this link adds (planner.comm.ring_latency)
    source: str
    assumed: str | None  # None: a published measurement; else how the figure was derived
    nics_per_node: int = 0  # fabrics only
    nic_gbit: float = 0.0  # fabrics only: one NIC's line rate in Gb/s
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelFamily:
    """What one GPU family's kernels reach (``planner.compute.Kernels``): a GEMM takes ``2mnk / (peak x gemm_peak)
    + gemm_overhead``; flash attention reaches ``attention_peak`` of the peak; elementwise work moves its bytes at
    ``memory_efficiency`` x the datasheet bandwidth."""

    key: str
    gemm_peak: float
    gemm_overhead: float  # seconds
    attention_peak: float
    memory_efficiency: float
    source: str
    assumed: str | None


@dataclass(frozen=True)
class ClusterSpec:
    """What a job of many ranks loses beyond its links: ``contention`` (compute seconds lost per second of
    collectives hidden behind it) and ``dispersion`` (relative spread of a rank's compute time)."""

    contention: float
    dispersion: float
    sources: tuple[str, ...]
    assumed: tuple[str, ...]


@dataclass(frozen=True)
class HostLink:
    """GPU <-> host copy bandwidth of one GPU (pinned cudaMemcpy), for CPU offload."""

    key: str
    name: str
    bandwidth: float  # bytes/s
    source: str
    assumed: str | None


@dataclass(frozen=True)
class HostSpec:
    """Node-level defaults: CPU memory bandwidth (CPU Adam), NVMe bandwidth, and the CPU's matmul efficiency."""

    memory_bandwidth: float  # bytes/s
    nvme_bandwidth: float  # bytes/s
    cpu_compute_efficiency: float  # achieved model FLOP/s of a CPU training loop / the CPU's matmul FLOP/s, in (0, 1]
    kernel_launch: float  # host seconds per kernel launch from eager PyTorch
    zero3_fetch: float  # host seconds per DeepSpeed ZeRO-3 parameter fetch
    sources: tuple[str, ...]
    assumed: tuple[str, ...]


@dataclass(frozen=True)
class Catalog:
    """Every table of one catalog file."""

    gpus: dict[str, GPU]
    links: dict[str, Link]
    fabrics: dict[str, Link]
    host_links: dict[str, HostLink]
    host: HostSpec
    unlisted_cuda_names: tuple[str, ...]
    kernels: dict[str, KernelFamily]
    cluster: ClusterSpec


def parse_memory(text: str) -> int:
    """Bytes of a binary memory size (``"80GB"`` -> 80 * 2**30; GB and GiB both mean 2**30).

    Args:
        text: a number and a unit among MB, MiB, GB, GiB, TB, TiB.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(text))
    if match is None or match.group(2).upper() not in _BINARY_UNITS:
        raise GymUserError(f"Cannot read memory size {text!r}; expected a number with a unit, e.g. '80GB'.")
    return int(float(match.group(1)) * _BINARY_UNITS[match.group(2).upper()])


class _Reader:
    """Reads fields of one catalog entry, collecting every problem instead of stopping at the first."""

    def __init__(self, problems: list[str]) -> None:
        """Args:
        problems: the list each problem sentence is appended to.
        """
        self.problems = problems

    def positive(self, entry: Mapping[str, Any], field: str, where: str) -> float:
        """A number > 0 from ``entry[field]``; 0.0 (and a problem) when missing or not positive.

        Args:
            entry: the YAML mapping of one entry.
            field: the field's name.
            where: the entry's path in the file, for the message (``"gpus.h100-sxm"``).
        """
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            self.problems.append(f"{where}.{field} is {value!r}; expected a positive number.")
            return 0.0
        return float(value)

    def non_negative(self, entry: Mapping[str, Any], field: str, where: str) -> float:
        """A number >= 0 from ``entry[field]``; 0.0 (and a problem) when missing or negative.

        Args:
            entry: the YAML mapping of one entry.
            field: the field's name.
            where: the entry's path in the file, for the message.
        """
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            self.problems.append(f"{where}.{field} is {value!r}; expected a number >= 0.")
            return 0.0
        return float(value)

    def fraction(self, entry: Mapping[str, Any], field: str, where: str) -> float:
        """A number in (0, 1] from ``entry[field]``; 0.0 (and a problem) when missing or out of range.

        Args:
            entry: the YAML mapping of one entry.
            field: the field's name.
            where: the entry's path in the file, for the message (``"host"``).
        """
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            self.problems.append(f"{where}.{field} is {value!r}; expected a fraction > 0 and <= 1.")
            return 0.0
        return float(value)

    def text(self, entry: Mapping[str, Any], field: str, where: str, optional: bool = False) -> str | None:
        """A non-empty string from ``entry[field]``; ``None`` when optional and null.

        Args:
            entry: the YAML mapping of one entry.
            field: the field's name.
            where: the entry's path in the file, for the message.
            optional: whether null is allowed.
        """
        value = entry.get(field)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value.strip():
            self.problems.append(f"{where}.{field} is {value!r}; expected a non-empty string.")
            return ""
        return " ".join(value.split())

    def names(self, entry: Mapping[str, Any], field: str, where: str) -> tuple[str, ...]:
        """A list of strings from ``entry[field]`` (absent = empty), lower-cased.

        Args:
            entry: the YAML mapping of one entry.
            field: the field's name.
            where: the entry's path in the file, for the message.
        """
        value = entry.get(field, [])
        if not isinstance(value, list) or not all(isinstance(item, (str, int)) for item in value):
            self.problems.append(f"{where}.{field} is {value!r}; expected a list of strings.")
            return ()
        return tuple(str(item).lower() for item in value)


def _read_gpu(key: str, entry: Mapping[str, Any], read: _Reader) -> GPU:
    """One ``gpus:`` entry as a :class:`GPU`.

    Args:
        key: the entry's key.
        entry: its YAML mapping.
        read: the reader that collects problems.
    """
    where = f"gpus.{key}"
    try:
        memory = parse_memory(entry.get("memory", ""))
    except GymUserError as error:
        read.problems.append(f"{where}.memory: {error}")
        memory = 0
    peaks = entry.get("dense_tflops")
    if not isinstance(peaks, dict) or not peaks or set(peaks) - set(_DTYPES):
        read.problems.append(f"{where}.dense_tflops is {peaks!r}; expected a mapping of {', '.join(_DTYPES)}.")
        peaks = {}
    cuda_names = read.names(entry, "cuda_names", where)
    for pattern in cuda_names:
        try:
            re.compile(pattern)
        except re.error as error:
            read.problems.append(f"{where}.cuda_names: {pattern!r} is not a regex ({error}).")
    return GPU(
        key=key,
        name=read.text(entry, "name", where) or "",
        aliases=read.names(entry, "aliases", where),
        memory=memory,
        memory_bandwidth=read.positive(entry, "memory_bandwidth_gbs", where) * _GB,
        dense_peak={dtype: read.positive(peaks, dtype, f"{where}.dense_tflops") * _TFLOPS for dtype in peaks},
        link=read.text(entry, "link", where) or "",
        host_link=read.text(entry, "host_link", where) or "",
        kernels=read.text(entry, "kernels", where) or "",
        cuda_names=cuda_names,
        source=read.text(entry, "source", where) or "",
    )


def _read_link(section: str, key: str, entry: Mapping[str, Any], read: _Reader) -> Link:
    """One ``links:`` or ``fabrics:`` entry as a :class:`Link`.

    Args:
        section: ``"links"`` or ``"fabrics"``; fabrics must say their NICs.
        key: the entry's key.
        entry: its YAML mapping.
        read: the reader that collects problems.
    """
    where = f"{section}.{key}"
    fabric = section == "fabrics"
    return Link(
        key=key,
        name=read.text(entry, "name", where) or "",
        bus_bandwidth=read.positive(entry, "bus_bandwidth_gbs", where) * _GB,
        latency=read.positive(entry, "latency_us", where) * _US,
        hop_latency=read.non_negative(entry, "hop_latency_us", where) * _US,
        source=read.text(entry, "source", where) or "",
        assumed=read.text(entry, "assumed", where, optional=True),
        nics_per_node=int(read.positive(entry, "nics_per_node", where)) if fabric else 0,
        nic_gbit=read.positive(entry, "nic_gbit", where) if fabric else 0.0,
        aliases=read.names(entry, "aliases", where),
    )


def _read_host_link(key: str, entry: Mapping[str, Any], read: _Reader) -> HostLink:
    """One ``host_links:`` entry as a :class:`HostLink`.

    Args:
        key: the entry's key.
        entry: its YAML mapping.
        read: the reader that collects problems.
    """
    where = f"host_links.{key}"
    return HostLink(
        key=key,
        name=read.text(entry, "name", where) or "",
        bandwidth=read.positive(entry, "bandwidth_gbs", where) * _GB,
        source=read.text(entry, "source", where) or "",
        assumed=read.text(entry, "assumed", where, optional=True),
    )


def _read_kernels(key: str, entry: Mapping[str, Any], read: _Reader) -> KernelFamily:
    """One ``kernels:`` entry as a :class:`KernelFamily`.

    Args:
        key: the entry's key.
        entry: its YAML mapping.
        read: the reader that collects problems.
    """
    where = f"kernels.{key}"
    return KernelFamily(
        key=key,
        gemm_peak=read.fraction(entry, "gemm_peak", where),
        gemm_overhead=read.positive(entry, "gemm_overhead_us", where) * _US,
        attention_peak=read.fraction(entry, "attention_peak", where),
        memory_efficiency=read.fraction(entry, "memory_efficiency", where),
        source=read.text(entry, "source", where) or "",
        assumed=read.text(entry, "assumed", where, optional=True),
    )


def _read_cluster(entry: Mapping[str, Any], read: _Reader) -> ClusterSpec:
    """The ``cluster:`` section as a :class:`ClusterSpec`.

    Args:
        entry: its YAML mapping.
        read: the reader that collects problems.
    """
    figures = ("contention", "dispersion")
    return ClusterSpec(
        contention=read.fraction(entry, "contention", "cluster"),
        dispersion=read.fraction(entry, "dispersion", "cluster"),
        sources=tuple(read.text(entry, f"{figure}_source", "cluster") or "" for figure in figures),
        assumed=tuple(read.text(entry, f"{figure}_assumed", "cluster", optional=True) or "" for figure in figures),
    )


def _read_host(entry: Mapping[str, Any], read: _Reader) -> HostSpec:
    """The ``host:`` section as a :class:`HostSpec`.

    Args:
        entry: its YAML mapping.
        read: the reader that collects problems.
    """
    figures = ("memory_bandwidth", "nvme_bandwidth", "cpu_compute_efficiency", "kernel_launch", "zero3_fetch")
    sources = tuple(read.text(entry, f"{figure}_source", "host") or "" for figure in figures)
    assumed = tuple(read.text(entry, f"{figure}_assumed", "host", optional=True) or "" for figure in figures)
    return HostSpec(
        memory_bandwidth=read.positive(entry, "memory_bandwidth_gbs", "host") * _GB,
        nvme_bandwidth=read.positive(entry, "nvme_bandwidth_gbs", "host") * _GB,
        cpu_compute_efficiency=read.fraction(entry, "cpu_compute_efficiency", "host"),
        kernel_launch=read.positive(entry, "kernel_launch_us", "host") * _US,
        zero3_fetch=read.positive(entry, "zero3_fetch_us", "host") * _US,
        sources=sources,
        assumed=tuple(text for text in assumed if text),
    )


_Entry = TypeVar("_Entry")


def _section(
    data: Mapping[str, Any], name: str, build: Callable[[str, Mapping[str, Any]], _Entry], problems: list[str]
) -> dict[str, _Entry]:
    """Every entry of one top-level mapping section, built by ``build(key, entry)``.

    Args:
        data: the whole file.
        name: the section's name.
        build: turns one key and its mapping into a dataclass.
        problems: where a missing or malformed section is reported.
    """
    section = data.get(name)
    if not isinstance(section, dict) or not section:
        problems.append(f"Section {name!r} is missing or empty; expected a mapping of key -> entry.")
        return {}
    built: dict[str, _Entry] = {}
    for key, entry in section.items():
        if not isinstance(entry, dict):
            problems.append(f"{name}.{key} is {entry!r}; expected a mapping of fields.")
            continue
        built[str(key).lower()] = build(str(key).lower(), entry)
    return built


def _cross_problems(catalog: Catalog) -> list[str]:
    """References between sections that do not resolve, and names used twice within one table.

    Args:
        catalog: the tables as read.
    """
    problems = [
        f"gpus.{gpu.key}.{field} is {value!r}; expected one of: {', '.join(table)}."
        for gpu in catalog.gpus.values()
        for field, value, table in (
            ("link", gpu.link, catalog.links),
            ("host_link", gpu.host_link, catalog.host_links),
            ("kernels", gpu.kernels, catalog.kernels),
        )
        if value and value not in table
    ]
    overlap = sorted(set(catalog.links) & set(catalog.fabrics))
    if overlap:
        problems.append(f"links and fabrics share the key(s) {overlap}; --interconnect must name one entry.")
    tables: dict[str, Mapping[str, GPU | Link]] = {
        "gpus": catalog.gpus,
        "links and fabrics": {**catalog.links, **catalog.fabrics},
    }
    for label, table in tables.items():
        seen: dict[str, str] = {}
        for key, item in table.items():
            for name in (key, *item.aliases):
                if seen.setdefault(name, key) != key:
                    problems.append(f"{label}: the name {name!r} means both {seen[name]!r} and {key!r}.")
    return problems


def load_catalog(path: Path | str = CATALOG_PATH) -> Catalog:
    """Read and validate a catalog file; one ``GymUserError`` lists every problem found.

    Args:
        path: the YAML file (the packaged ``assets/hardware.yaml`` by default).
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise GymUserError(f"Cannot read the hardware catalog {path}: {error}") from error
    if not isinstance(data, dict):
        raise GymUserError(f"The hardware catalog {path} holds {type(data).__name__}; expected a mapping of sections.")
    problems: list[str] = []
    read = _Reader(problems)
    host, cluster = data.get("host"), data.get("cluster")
    unlisted = read.names(data, "unlisted_cuda_names", "unlisted_cuda_names")
    catalog = Catalog(
        gpus=_section(data, "gpus", lambda key, entry: _read_gpu(key, entry, read), problems),
        links=_section(data, "links", lambda key, entry: _read_link("links", key, entry, read), problems),
        fabrics=_section(data, "fabrics", lambda key, entry: _read_link("fabrics", key, entry, read), problems),
        host_links=_section(data, "host_links", lambda key, entry: _read_host_link(key, entry, read), problems),
        host=_read_host(host if isinstance(host, dict) else {}, read),
        unlisted_cuda_names=unlisted,
        kernels=_section(data, "kernels", lambda key, entry: _read_kernels(key, entry, read), problems),
        cluster=_read_cluster(cluster if isinstance(cluster, dict) else {}, read),
    )
    problems.extend(_cross_problems(catalog))
    raise_if_problems(f"Broken hardware catalog {path}", problems)
    return catalog


_CATALOG = load_catalog()
GPUS: dict[str, GPU] = _CATALOG.gpus
LINKS: dict[str, Link] = _CATALOG.links
FABRICS: dict[str, Link] = _CATALOG.fabrics
HOST_LINKS: dict[str, HostLink] = _CATALOG.host_links
HOST: HostSpec = _CATALOG.host
KERNELS: dict[str, KernelFamily] = _CATALOG.kernels
CLUSTER: ClusterSpec = _CATALOG.cluster


def _listing(table: Mapping[str, Any]) -> str:
    """``"key (alias, alias), key"`` for an error message.

    Args:
        table: key -> entry with an ``aliases`` attribute (or none).
    """
    parts = []
    for key, item in table.items():
        aliases = getattr(item, "aliases", ())
        parts.append(f"{key} ({', '.join(aliases)})" if aliases else key)
    return ", ".join(parts)


def _find(tables: Mapping[str, Mapping[str, Any]], name: str, what: str, flag: str) -> Any:
    """The entry whose key or alias is ``name`` (case-insensitive), first table first.

    Args:
        tables: label -> table, searched in order.
        name: what the user typed.
        what: the kind of thing, for the message (``"GPU"``).
        flag: the option that takes it, for the message (``"--gpu"``).
    """
    wanted = str(name).strip().lower()
    for table in tables.values():
        for key, item in table.items():
            if wanted == key or wanted in getattr(item, "aliases", ()):
                return item
    known = "; ".join(f"{label}: {_listing(table)}" for label, table in tables.items())
    raise GymUserError(
        f"Unknown {what} {name!r} for {flag}. Known names (aliases in brackets): {known}. Pass one of them, or give "
        f"the figures yourself with the explicit options."
    )


def gpu(name: str) -> GPU:
    """The catalog GPU whose key or alias is ``name`` (``"h100"``, ``"a100-40gb"``, ``"B200"``).

    Args:
        name: a key or alias, any case.
    """
    return _find({"GPUs": GPUS}, name, "GPU", "--gpu")


def link(name: str) -> Link:
    """The intra-node link whose key or alias is ``name`` (``"nvlink4"``, ``"pcie4"``).

    Args:
        name: a key or alias, any case.
    """
    return _find({"links": LINKS}, name, "intra-node link", "--interconnect")


def fabric(name: str) -> Link:
    """What ``--interconnect`` names: an inter-node fabric (``"ib-ndr400"``), or a link key for a single node.

    Args:
        name: a fabric or link key or alias, any case.
    """
    return _find({"fabrics": FABRICS, "single-node links": LINKS}, name, "interconnect", "--interconnect")


def host_link(name: str) -> HostLink:
    """The GPU <-> host link whose key is ``name`` (``"pcie4"``, ``"pcie5"``).

    Args:
        name: a key, any case.
    """
    return _find({"host links": HOST_LINKS}, name, "host link", "host_link")


def gpu_for_device_name(cuda_name: str) -> GPU | None:
    """The catalog GPU of a CUDA device name (``torch.cuda.get_device_name()``), or ``None`` if not listed.

    GPUs are tried in catalog order and the first pattern that matches wins; names in ``unlisted_cuda_names``
    (GH200, GB200: their own clocks and power) give ``None`` rather than a near-miss chip's figures.

    Args:
        cuda_name: e.g. ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-40GB"``.
    """
    lowered = cuda_name.lower()
    if any(re.search(pattern, lowered) for pattern in _CATALOG.unlisted_cuda_names):
        return None
    for item in GPUS.values():
        if any(re.search(pattern, lowered) for pattern in item.cuda_names):
            return item
    return None


__all__ = [
    "CATALOG_PATH",
    "CLUSTER",
    "FABRICS",
    "GPU",
    "GPUS",
    "HOST",
    "HOST_LINKS",
    "KERNELS",
    "LINKS",
    "Catalog",
    "ClusterSpec",
    "HostLink",
    "HostSpec",
    "KernelFamily",
    "Link",
    "fabric",
    "gpu",
    "gpu_for_device_name",
    "host_link",
    "link",
    "load_catalog",
    "parse_memory",
]
