"""The hardware catalog: required entries, figures, lookups by name and alias, CUDA names, broken files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gym_lightning.errors import GymUserError
from gym_lightning.metrics import hardware
from gym_lightning.metrics.hardware import (
    CATALOG_PATH,
    FABRICS,
    GPUS,
    HOST,
    HOST_LINKS,
    LINKS,
    fabric,
    gpu,
    gpu_for_device_name,
    host_link,
    link,
    load_catalog,
    parse_memory,
)
from gym_lightning.metrics.peak_flops import DENSE_PEAK_FLOPS, dense_peak_flops

GiB = 2**30
REQUIRED_GPUS = (
    "h100-sxm",
    "h100-pcie",
    "h100-nvl",
    "h200-sxm",
    "h200-nvl",
    "a100-sxm-40gb",
    "a100-sxm-80gb",
    "a100-pcie-40gb",
    "a100-pcie-80gb",
    "l40s",
    "l40",
    "l4",
    "rtx-4090",
    "b200",
    "v100-sxm",
    "v100-pcie",
)


def test_required_entries_present() -> None:
    assert set(REQUIRED_GPUS) <= set(GPUS)
    assert {"nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5"} <= set(LINKS)
    assert {"ib-hdr200", "ib-ndr400", "roce-400", "ethernet-100", "ethernet-25"} <= set(FABRICS)
    assert {"pcie4", "pcie5"} <= set(HOST_LINKS)
    assert HOST.memory_bandwidth > 0 and HOST.nvme_bandwidth > 0
    assert 0 < HOST.cpu_compute_efficiency <= 1


def test_dense_peaks_in_flops() -> None:
    assert GPUS["h100-sxm"].dense_peak["bf16"] == pytest.approx(989.4e12)
    assert GPUS["h100-sxm"].dense_peak["fp8"] == pytest.approx(1978.9e12)
    assert GPUS["b200"].dense_peak["bf16"] == pytest.approx(2250e12)
    assert "bf16" not in GPUS["v100-sxm"].dense_peak  # Volta: no bf16 tensor cores


def test_memory_is_binary_bytes_and_bandwidth_decimal() -> None:
    assert GPUS["a100-sxm-40gb"].memory == 40 * GiB
    assert GPUS["a100-sxm-80gb"].memory == 80 * GiB
    assert GPUS["a100-pcie-40gb"].memory == 40 * GiB
    assert GPUS["b200"].memory == 180 * GiB
    assert GPUS["h200-sxm"].memory == 141 * GiB
    assert GPUS["h100-sxm"].memory_bandwidth == pytest.approx(3.35e12)
    assert GPUS["a100-sxm-80gb"].memory_bandwidth > GPUS["a100-sxm-40gb"].memory_bandwidth  # HBM2e vs HBM2


def test_every_gpu_link_and_host_link_exist() -> None:
    for chip in GPUS.values():
        assert chip.link in LINKS, chip.key
        assert chip.host_link in HOST_LINKS, chip.key
        assert chip.source and chip.cuda_names, chip.key


def test_links_and_fabrics_are_sourced_and_ordered() -> None:
    for item in (*LINKS.values(), *FABRICS.values()):
        assert item.source and item.bus_bandwidth > 0 and item.latency > 0, item.key
    assert LINKS["nvlink5"].bus_bandwidth > LINKS["nvlink4"].bus_bandwidth > LINKS["nvlink3"].bus_bandwidth
    assert LINKS["nvlink3"].bus_bandwidth > LINKS["pcie5"].bus_bandwidth > LINKS["pcie4"].bus_bandwidth
    order = ["ib-ndr400", "ib-hdr200", "ethernet-100", "ethernet-25"]
    assert [FABRICS[key].bus_bandwidth for key in order] == sorted(
        (FABRICS[key].bus_bandwidth for key in order), reverse=True
    )
    assert FABRICS["ib-ndr400"].bus_bandwidth > FABRICS["ib-hdr200"].bus_bandwidth  # and strictly so
    assert HOST_LINKS["pcie5"].bandwidth > HOST_LINKS["pcie4"].bandwidth


def test_fabric_busbw_is_bounded_by_its_nics() -> None:
    # busbw ~ NICs x per-NIC achieved bandwidth: never above the node's line rate.
    for item in FABRICS.values():
        line_rate = item.nics_per_node * item.nic_gbit * 1e9 / 8
        assert 0 < item.bus_bandwidth <= line_rate, item.key


@pytest.mark.parametrize(
    ("name", "key"),
    [("h100", "h100-sxm"), ("H100-SXM5", "h100-sxm"), ("a100", "a100-sxm-80gb"), ("A100-40GB", "a100-sxm-40gb"),
     ("B200", "b200"), ("4090", "rtx-4090"), ("h200", "h200-sxm"), ("l40s", "l40s")],
)  # fmt: skip
def test_gpu_by_key_or_alias(name: str, key: str) -> None:
    assert gpu(name).key == key


def test_interconnect_takes_fabric_or_single_node_link() -> None:
    assert fabric("ib-ndr400").key == "ib-ndr400"
    assert fabric("InfiniBand").key == "ib-ndr400"
    assert fabric("ethernet").key == "ethernet-100"
    assert fabric("nvlink4").key == "nvlink4"  # one node: the intra-node link
    assert link("pcie").key == "pcie4"
    assert host_link("PCIE5").bandwidth == pytest.approx(52e9)


@pytest.mark.parametrize(
    ("lookup", "name", "listed"),
    [(gpu, "tpu-v5", "h100-sxm"), (link, "nvlink9", "nvlink4"), (fabric, "myrinet", "ib-ndr400"),
     (host_link, "pcie9", "pcie5")],
)  # fmt: skip
def test_unknown_name_lists_the_choices(lookup: Callable[[str], object], name: str, listed: str) -> None:
    with pytest.raises(GymUserError, match=name) as raised:
        lookup(name)
    assert listed in str(raised.value)


def test_unknown_interconnect_lists_fabrics_and_links() -> None:
    with pytest.raises(GymUserError) as raised:
        fabric("myrinet")
    assert "ethernet-25" in str(raised.value) and "nvlink3" in str(raised.value)


@pytest.mark.parametrize(
    ("cuda_name", "key"),
    [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
     ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("NVIDIA B200", "b200"), ("NVIDIA GH200 480GB", None),
     ("NVIDIA GB200", None), ("AMD Instinct MI300X", None)],
)  # fmt: skip
def test_gpu_for_device_name(cuda_name: str, key: str | None) -> None:
    found = gpu_for_device_name(cuda_name)
    assert (found.key if found else None) == key


def test_peak_flops_is_the_catalog() -> None:
    assert set(DENSE_PEAK_FLOPS) == set(GPUS)
    for key, chip in GPUS.items():
        assert DENSE_PEAK_FLOPS[key] == chip.dense_peak
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == GPUS["h100-sxm"].dense_peak["bf16"]


def test_parse_memory() -> None:
    assert parse_memory("80GB") == 80 * GiB
    assert parse_memory("1.5 TiB") == int(1.5 * 2**40)
    with pytest.raises(GymUserError, match="80 gigs"):
        parse_memory("80 gigs")


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_broken_yaml_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(GymUserError, match="Cannot read the hardware catalog"):
        load_catalog(_write(tmp_path, "gpus: [unclosed"))


def test_every_problem_in_one_message(tmp_path: Path) -> None:
    data = yaml.safe_load(CATALOG_PATH.read_text())
    data["gpus"]["h100-sxm"]["link"] = "nvlink9"
    data["gpus"]["h100-sxm"]["memory_bandwidth_gbs"] = -1
    data["fabrics"]["ib-ndr400"]["bus_bandwidth_gbs"] = "fast"
    data["gpus"]["l4"]["aliases"] = ["h100"]
    with pytest.raises(GymUserError) as raised:
        load_catalog(_write(tmp_path, data))
    message = str(raised.value)
    assert "4 problem(s)" in message
    assert "gpus.h100-sxm.link is 'nvlink9'" in message
    assert "gpus.h100-sxm.memory_bandwidth_gbs is -1" in message
    assert "fabrics.ib-ndr400.bus_bandwidth_gbs is 'fast'" in message
    assert "'h100' means both" in message


@pytest.mark.parametrize("value", [0, 1.5, -0.2, "fast", None, True])
def test_cpu_compute_efficiency_must_be_a_fraction(tmp_path: Path, value: object) -> None:
    data = yaml.safe_load(CATALOG_PATH.read_text())
    data["host"]["cpu_compute_efficiency"] = value
    with pytest.raises(GymUserError, match=r"host\.cpu_compute_efficiency is .*expected a fraction > 0 and <= 1"):
        load_catalog(_write(tmp_path, data))


def test_packaged_catalog_loads_the_same_tables() -> None:
    again = load_catalog()
    assert again.gpus == hardware.GPUS and again.fabrics == hardware.FABRICS


def test_every_gpu_has_a_sourced_kernel_family_and_every_link_a_hop() -> None:
    for chip in hardware.GPUS.values():
        family = hardware.KERNELS[chip.kernels]
        assert 0 < family.gemm_peak <= 1 and 0 < family.attention_peak <= 1 and family.source
    for found in [*hardware.LINKS.values(), *hardware.FABRICS.values()]:
        assert found.hop_latency >= 0
    assert 0 < hardware.CLUSTER.contention < 1 and 0 < hardware.CLUSTER.dispersion < 1
    assert all(hardware.CLUSTER.sources) and hardware.HOST.zero3_fetch > 0 and hardware.HOST.kernel_launch > 0


def test_kernel_family_hop_and_cluster_problems_in_one_message(tmp_path: Path) -> None:
    data = yaml.safe_load(CATALOG_PATH.read_text())
    data["gpus"]["h100-sxm"]["kernels"] = "turing"
    data["kernels"]["hopper"]["gemm_peak"] = 1.5
    data["links"]["nvlink4"]["hop_latency_us"] = -2
    data["cluster"]["dispersion"] = "high"
    with pytest.raises(GymUserError) as raised:
        load_catalog(_write(tmp_path, data))
    message = str(raised.value)
    assert "gpus.h100-sxm.kernels is 'turing'" in message and "kernels.hopper.gemm_peak is 1.5" in message
    assert "links.nvlink4.hop_latency_us is -2" in message and "cluster.dispersion is 'high'" in message
