"""The plan's speed table: hardware from the catalog, the calibration, ranking, time and cost, gym plan's flags."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gym_lightning.commands.plan import main as plan_main
from gym_lightning.errors import GymUserError
from gym_lightning.metrics import hardware as catalog
from gym_lightning.planner import plan
from gym_lightning.planner.budget import TIE_TOLERANCE, Budget, cost_figures, ranking
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, Setup, param_counts
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.machines import Figures, calibrated_compute_efficiency, machine
from gym_lightning.planner.timing import PLAIN_LOOP, speed


def test_calibration_reproduces_the_plain_loop_row() -> None:
    efficiency = calibrated_compute_efficiency()
    h200 = machine("bf16-mixed", 1, "h200").hardware
    assert h200.compute_efficiency == efficiency
    setup = Setup(gpus_per_node=1, micro_batch_size=4, seq_length=2048)
    result = speed(resolve_shape("qwen3-1.7b"), STRATEGY_BY_KEY["ddp"], setup, h200)
    assert result.tokens_per_second_per_gpu == pytest.approx(PLAIN_LOOP["tokens_per_s"], rel=1e-9)
    # by hand: the step's compute at efficiency 1 over the measured 8192 / 25,764 s less the AdamW step
    # (1.72B x 28 B at the H200's 4.8 TB/s x its achieved 0.85)
    ideal = speed(resolve_shape("qwen3-1.7b"), STRATEGY_BY_KEY["ddp"], setup, replace_efficiency(h200, 1.0)).step
    trainable = param_counts(resolve_shape("qwen3-1.7b"), setup).trainable
    optimizer = trainable * 28 / (4.8e12 * 0.85)
    assert ideal.optimizer == pytest.approx(optimizer)
    assert efficiency == pytest.approx((ideal.total - optimizer) / (8192 / 25_764 - optimizer))
    assert 0.6 < efficiency < 0.8  # eager PyTorch's kernels against the roofline of planner.compute


def replace_efficiency(hw: Hardware, efficiency: float) -> Hardware:
    return replace(hw, kernels=replace(hw.kernels, efficiency=efficiency))


def test_machine_from_the_catalog_and_overrides() -> None:
    found = machine("bf16-mixed", 4, "a100-40gb", "roce-200")
    chip, link, fabric = catalog.gpu("a100-40gb"), catalog.link("nvlink3"), catalog.fabric("roce-200")
    assert found.gpu_memory == chip.memory == 40 * 2**30
    hw = found.hardware
    family = catalog.KERNELS[chip.kernels]
    assert (hw.peak_flops, hw.memory_bandwidth) == (chip.dense_peak["bf16"], chip.memory_bandwidth * 0.82)
    assert (hw.kernels.gemm_peak, hw.kernels.gemm_overhead) == (family.gemm_peak, family.gemm_overhead)
    assert (hw.network.intra_bandwidth, hw.network.inter_bandwidth) == (link.bus_bandwidth, fabric.bus_bandwidth)
    assert (hw.network.intra_hop, hw.network.inter_hop) == (link.hop_latency, fabric.hop_latency)
    assert not found.notes
    fp32 = machine("32-true", 1, "a100-40gb").hardware
    assert fp32.peak_flops == chip.dense_peak["fp32"]
    given = machine("bf16-mixed", 2, "h100", None, Figures(peak_tflops=500, inter_node_bandwidth_gbs=25)).hardware
    assert given.peak_flops == 500e12 and given.network.inter_bandwidth == 25e9
    assert machine("bf16-mixed", 2, "h100").notes  # the fabric between nodes was assumed, and the report says so
    pcie3 = machine("bf16-mixed", 1, "rtx-4090", "pcie3").hardware
    assert pcie3.network.intra_bandwidth == catalog.link("pcie3").bus_bandwidth


def test_every_bad_hardware_name_and_figure_in_one_message() -> None:
    with pytest.raises(GymUserError) as error:
        plan("qwen3-0.6b", gpu="h900", interconnect="carrier-pigeon", figures=Figures(compute_efficiency=2.0))
    message = str(error.value)
    assert "'h900'" in message and "'carrier-pigeon'" in message and "at most 1" in message
    assert "h100-sxm" in message  # the known names are listed


def test_gpu_memory_defaults_to_the_gpus_and_still_overrides() -> None:
    assert plan("qwen3-0.6b", gpu="h200").setup.hardware.gpu_bytes == catalog.gpu("h200").memory
    assert plan("qwen3-0.6b", gpu="h200", gpu_memory="24GB").setup.hardware.gpu_bytes == 24 * 2**30
    assert plan("qwen3-0.6b").setup.hardware.gpu_bytes == 80 * 2**30  # H100 SXM, as before the catalog


def test_ranking_breaks_near_ties_by_the_list_order() -> None:
    report = plan("llama-3-8b", gpus_per_node=8, seq_length=4096)
    speeds = report.speeds()
    rate = {e.strategy.key: s.tokens_per_second_per_gpu for e, s in zip(report.estimates, speeds, strict=True) if s}
    order = report.ranking()
    assert order[0] == report.recommendation.strategy.key  # type: ignore[union-attr]
    # the fastest left is never more than the tolerance ahead of the one picked
    for place, key in enumerate(order):
        fastest_left = max(rate[k] for k in order[place:])
        assert rate[key] >= fastest_left * (1 - TIE_TOLERANCE)
    assert "ddp" not in order  # does not fit (16 Ψ of model states)
    indices = ranking(report.estimates, speeds)
    assert [report.estimates[i].strategy.key for i in indices] == order


def test_hours_gpu_hours_and_cost() -> None:
    report = plan("qwen3-1.7b", gpus_per_node=8, nodes=2, micro_batch_size=4, tokens=1e9, price_per_gpu_hour=2.0)
    best = report.recommendation
    result = dict(zip((e.strategy.key for e in report.estimates), report.speeds(), strict=True))[best.strategy.key]
    hours = 1e9 / (result.tokens_per_second_per_gpu * 16) / 3600
    figures = cost_figures(result, 16, Budget(1e9, 2.0))
    assert figures == pytest.approx({"hours": hours, "gpu_hours": 16 * hours, "cost": 32 * hours})
    entry = next(s for s in report.to_dict()["strategies"] if s["key"] == best.strategy.key)
    assert entry["speed"]["hours"] == pytest.approx(hours) and entry["speed"]["rank"] == 1
    assert "cost $" in report.table() and f"{32 * hours:,.0f}" in report.table()
    with pytest.raises(GymUserError, match="price_per_gpu_hour must be a positive number"):
        plan("qwen3-1.7b", price_per_gpu_hour=-1)


def test_accumulation_and_compression_change_the_step() -> None:
    shape = resolve_shape("qwen3-1.7b")
    hw = machine("bf16-mixed", 1, "rtx-4090").hardware  # PCIe: the all-reduce shows
    setup = Setup(gpus_per_node=8, micro_batch_size=1, seq_length=2048)
    base = speed(shape, STRATEGY_BY_KEY["ddp"], setup, hw)
    half = speed(shape, STRATEGY_BY_KEY["ddp"], replace(setup, gradient_compression="bf16"), hw)
    accumulated = speed(shape, STRATEGY_BY_KEY["ddp"], replace(setup, accumulate_grad_batches=4), hw)
    assert half.step.exposed_communication < base.step.exposed_communication
    assert accumulated.tokens_per_second_per_gpu > base.tokens_per_second_per_gpu  # one all-reduce per 4 micro-batches
    with pytest.raises(GymUserError, match="gradient_compression must be one of"):
        plan("qwen3-1.7b", gradient_compression="zip")


def test_cpu_ranks_without_figures_have_no_speed_and_keep_the_list_order() -> None:
    report = plan("tiny-llama", accelerator="cpu", gpus_per_node=2)
    assert report.machine is None and all(s is None for s in report.speeds())
    assert report.recommendation is not None and report.recommendation.strategy.key == "ddp"
    assert report.speed_table() == []


def test_gym_plan_command_prints_the_speed_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    plan_main(["--model", "qwen3-8b", "--gpu", "h200", "--nodes", "2", "--interconnect", "ethernet-100", "--rows",
               "100000", "--epochs", "2", "--seq_length", "1024", "--price_per_gpu_hour", "3"])  # fmt: skip
    table = capsys.readouterr().out
    assert "Speed on 16 x h200-sxm, nvlink4, ethernet-100" in table and "204,800,000 tokens" in table
    plan_main(["--model", "qwen3-8b", "--gpu", "b200", "--json", "--tokens", "1e9", "--compute_efficiency", "0.4"])
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["gpu"] == "b200" and data["hardware"]["compute_efficiency"] == 0.4
    assert data["ranking"][0] == data["recommendation"]
    assert all(s["speed"] is None or s["speed"]["step_seconds"] > 0 for s in data["strategies"])
    with pytest.raises(GymUserError, match="--tokens and --rows"):
        plan_main(["--model", "qwen3-8b", "--tokens", "1e9", "--rows", "10"])


def test_every_row_names_the_trainer_strategy_that_runs_it() -> None:
    from gym_lightning.planner.estimate import STRATEGIES
    from gym_lightning.vocabulary import STRATEGY_CLASSES, STRATEGY_NAMES

    for row in STRATEGIES:
        selects = row.trainer_config()
        assert selects is not None, row.key
        assert selects in STRATEGY_NAMES or selects["class_path"] in STRATEGY_CLASSES.values(), row.key
    assert STRATEGY_BY_KEY["fsdp_grad_op"].trainer_config() == {
        "class_path": "gym_lightning.strategies.GymFSDPStrategy",
        "init_args": {"sharding": "grad_op"},
    }
    assert STRATEGY_BY_KEY["zero3"].trainer_config() == "zero3"


def test_run_settings_read_accumulation_and_compression() -> None:
    from gym_lightning.planner.run_config import run_settings

    strategy = {"class_path": "gym_lightning.strategies.GymDDPStrategy", "init_args": {"gradient_compression": "bf16"}}
    run = run_settings({"trainer": {"accumulate_grad_batches": 4, "strategy": strategy}})
    assert run.settings["accumulate_grad_batches"] == 4 and run.settings["gradient_compression"] == "bf16"
    assert "strategy" not in run_settings({"trainer": {"strategy": "gym_auto"}}).settings  # the plan chooses
