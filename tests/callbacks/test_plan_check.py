"""The plan check: the live run mapped onto the planner, and ThroughputCallback's predicted vs measured report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.tiny import TinyLM
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch.utils.data import DataLoader

from gym_lightning import CausalLMModule
from gym_lightning.callbacks import ThroughputCallback
from gym_lightning.callbacks.plan_check import (
    PHASES,
    TermTimer,
    Unavailable,
    planner_strategy_of,
    predicted_phases,
    prediction,
    run_hardware,
    run_setup,
    term_check,
)
from gym_lightning.callbacks.throughput_monitor import _summary_table
from gym_lightning.lora import LoRAArgs
from gym_lightning.metrics import hardware as catalog
from gym_lightning.planner.timing import StepTime
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeRO1Strategy, ZeROStrategy

H100_NAME = "NVIDIA H100 80GB HBM3"


# ---------------------------------------------------------------------------------------------- strategies
def test_each_gym_strategy_maps_to_its_planner_row() -> None:
    ddp = planner_strategy_of(GymDDPStrategy(gradient_compression="bf16"))
    assert (ddp.family, ddp.ddp) == ("replicated", True)
    fsdp = planner_strategy_of(GymFSDPStrategy(sharding="grad_op", cpu_offload=True))
    assert (fsdp.family, fsdp.keep_gathered, fsdp.offload_optimizer, fsdp.offload_parameters) == (
        "fsdp",
        True,
        "cpu",
        "cpu",
    )
    hybrid = planner_strategy_of(GymFSDPStrategy(sharding="hybrid"))
    assert (hybrid.hybrid, hybrid.offload_optimizer, hybrid.keep_gathered) == (True, "none", False)
    assert planner_strategy_of(GymFSDPStrategy(sharding="none")).family == "replicated"
    zero3 = planner_strategy_of(ZeROStrategy(stage=3, offload_optimizer="cpu", offload_parameters="cpu"))
    assert (zero3.family, zero3.stage, zero3.offload_optimizer, zero3.offload_parameters) == ("zero", 3, "cpu", "cpu")
    assert planner_strategy_of(ZeRO1Strategy()).stage == 1
    # A user's DeepSpeed JSON replaces the arguments: its stage and offload are what ran.
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    from_json = planner_strategy_of(ZeROStrategy(config=config))
    assert (from_json.stage, from_json.offload_optimizer, from_json.offload_parameters) == (2, "cpu", "none")


def test_a_deepspeed_config_s_knobs_reach_the_live_run_s_spec() -> None:
    from gym_lightning.callbacks.plan_check import _knobs

    zero = {"stage": 3, "reduce_bucket_size": 1e7, "stage3_param_persistence_threshold": 500, "sub_group_size": "auto"}
    knobs = _knobs(ZeROStrategy(config={"zero_optimization": zero}))
    assert (knobs["bucket_size"], knobs["zero3_param_persistence_threshold"]) == (10_000_000, 500)
    assert "sub_group_size" not in knobs and knobs["zero3_leaf_layers"] is True  # auto: gym's rule; gym's leaves
    assert _knobs(ZeROStrategy(stage=3, leaf_decoder_layers=False))["zero3_leaf_layers"] is False
    assert _knobs(GymDDPStrategy(gradient_compression="powersgd", powersgd_rank=4))["powersgd_rank"] == 4


def test_lightning_single_device_and_ddp_are_ddp_and_others_none() -> None:
    for strategy in (SingleDeviceStrategy(torch.device("cpu")), DDPStrategy()):
        found = planner_strategy_of(strategy)
        assert (found.family, found.trainer_strategy) == ("replicated", type(strategy).__name__)
    assert planner_strategy_of(ModelParallelStrategy()) is None


# ---------------------------------------------------------------------------------------------- setup
def _fake_trainer(strategy: Any, precision: str = "bf16-mixed", **overrides: Any) -> SimpleNamespace:
    values = {
        "num_devices": 4,
        "num_nodes": 2,
        "world_size": 8,
        "precision": precision,
        "accumulate_grad_batches": 3,
        "strategy": strategy,
        "optimizers": [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)],
    }
    return SimpleNamespace(**{**values, **overrides})


def _fake_strategy(device: str = "cpu", **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(root_device=torch.device(device), **extra)


def test_run_setup_reads_trainer_strategy_and_module() -> None:
    strategy = _fake_strategy(sequence_parallel_size=2, gradient_compression="powersgd", powersgd_rank=4)
    peft = {"default": SimpleNamespace(r=16, target_modules={"q_proj", "v_proj"})}
    module = SimpleNamespace(hparams={"gradient_checkpointing": True}, model=SimpleNamespace(peft_config=peft))
    setup = run_setup(_fake_trainer(strategy), module, samples_per_micro_batch=2.4, tokens_per_sample=100.0)
    assert (setup.gpus_per_node, setup.nodes, setup.precision, setup.accumulate_grad_batches) == (4, 2, "bf16-mixed", 3)
    # 2.4 samples of 100 tokens per micro-batch: 2 samples of 120 tokens keep the 240 tokens.
    assert (setup.micro_batch_size, setup.seq_length) == (2, 120)
    assert setup.activation_checkpointing and (setup.lora_r, setup.lora_targets) == (16, "attention-qv")
    assert (setup.sequence_parallel_size, setup.gradient_compression, setup.powersgd_rank) == (2, "powersgd", 4)
    assert (setup.optimizer, setup.accelerator, setup.quantization) == ("sgd", "cpu", "none")


def test_run_setup_lora_from_module_and_defaults() -> None:
    trainer = _fake_trainer(_fake_strategy("cuda"), precision="32-true", optimizers=[])
    wide = SimpleNamespace(lora=LoRAArgs(r=8, target_modules=["all-linear"]), quantization=object())
    setup = run_setup(trainer, wide, 1.0, 64.0)
    assert (setup.lora_r, setup.lora_targets, setup.quantization) == (8, "all-linear", "nf4")
    assert (setup.precision, setup.accelerator, setup.optimizer, setup.activation_checkpointing) == (
        "32-true",
        "gpu",
        "adamw",
        False,
    )
    assert run_setup(trainer, SimpleNamespace(lora=LoRAArgs(r=4)), 1.0, 64.0).lora_targets == "attention-qv"
    assert run_setup(trainer, SimpleNamespace(), 1.0, 64.0).lora_r == 0
    with pytest.raises(Unavailable, match="16-mixed"):
        run_setup(_fake_trainer(_fake_strategy(), precision="16-mixed"), SimpleNamespace(), 1.0, 64.0)


def test_run_setup_reads_expert_adapters_and_4bit_experts() -> None:
    trainer = _fake_trainer(_fake_strategy(), optimizers=[])
    # What peft holds after gym's apply_lora: the experts alone (target_modules empty), a shared expert by parameter
    peft = {"default": SimpleNamespace(r=4, target_modules=set(), target_parameters={
        "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj.weight"})}  # fmt: skip
    quantization = SimpleNamespace(skip_modules=["lm_head", "experts.down_proj"])
    module = SimpleNamespace(model=SimpleNamespace(peft_config=peft), quantization=quantization)
    setup = run_setup(trainer, module, 1.0, 64.0)
    assert (setup.lora_r, setup.lora_targets, setup.quantization) == (4, "none", "nf4")
    assert setup.lora_target_parameters == ("experts.down_proj", "experts.gate_up_proj")
    assert setup.skip_expert_weights == ("down_proj",)


# ---------------------------------------------------------------------------------------------- CUDA hardware
def _cuda_trainer() -> SimpleNamespace:
    strategy = SingleDeviceStrategy(torch.device("cuda", 0))
    return _fake_trainer(strategy, num_devices=1, num_nodes=1, world_size=1, accumulate_grad_batches=1)


def test_cuda_device_name_gives_the_catalog_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100_NAME)
    chip = catalog.gpu("h100-sxm")
    hardware, _ = run_hardware(_cuda_trainer(), "bf16-mixed", 2048)
    family = catalog.KERNELS[chip.kernels]
    assert hardware.peak_flops == chip.dense_peak["bf16"]
    assert hardware.memory_bandwidth == pytest.approx(chip.memory_bandwidth * family.memory_efficiency)
    assert run_hardware(_cuda_trainer(), "32-true", 2048)[0].peak_flops == chip.dense_peak["fp32"]
    counts = {"steps": 10, "samples": 40, "tokens": 40 * 512}
    plan = prediction(_cuda_trainer(), TinyLM(), counts, steps_per_second=5.0, tokens_per_second=10_240.0)
    assert plan["hardware"]["peak_flops"] == chip.dense_peak["bf16"]
    assert plan["setup"]["micro_batch_size"] == 4 and plan["setup"]["seq_length"] == 512
    assert plan["tokens_per_second"] == pytest.approx(4 * 512 / plan["step_seconds"])
    assert plan["ratio"] == pytest.approx(0.2 / plan["step_seconds"])


def test_unknown_gpu_or_model_or_strategy_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Imaginary X9")
    counts = {"steps": 2, "samples": 8, "tokens": 800}
    plan = prediction(_cuda_trainer(), TinyLM(), counts, 1.0, 800.0)
    assert "NVIDIA Imaginary X9" in plan["unavailable"] and "hardware.yaml" in plan["unavailable"]
    no_config = SimpleNamespace(model=torch.nn.Linear(2, 2))
    assert "model.config" in prediction(_cuda_trainer(), no_config, counts, 1.0, 800.0)["unavailable"]
    other = _fake_trainer(ModelParallelStrategy())
    assert "ModelParallelStrategy" in prediction(other, TinyLM(), counts, 1.0, 800.0)["unavailable"]
    assert "too short" in prediction(_cuda_trainer(), TinyLM(), None, None, None)["unavailable"]
    text = _summary_table({**_SUMMARY, "plan": {"unavailable": "why not"}})
    assert "| metric | measured | plan |" in text and "no prediction: why not" in text


_SUMMARY = {
    "measured_steps": 3,
    "warmup_steps": 1,
    "world_size": 1,
    "device_name": "cpu",
    "matmul_dtype": "fp32",
    "total": {"tokens_per_sec": 100.0, "optimizer_steps_per_sec": 2.0},
}


def test_phases_put_each_term_where_the_timer_measures_it() -> None:
    step = StepTime(compute=3.0, recompute=0.3, communication=1.0, exposed_communication=0.3, sequence_parallel=0.0,
                    optimizer=0.2, offload=0.1, hooks=0.3, contention=0.06, dispersion=0.04)  # fmt: skip
    phases = predicted_phases(step)
    passes = 3.0 + 0.3 + 0.3 + 0.3 + 0.06 + 0.04
    assert phases == pytest.approx({"data": 0.0, "forward": passes / 3, "backward": 2 * passes / 3, "optimizer": 0.3})
    assert sum(phases.values()) == pytest.approx(step.total)

    class Timer:  # what a TermTimer measured: a data loader that took a second a step
        def phase_seconds(self) -> dict[str, float]:
            return {"data": 1.0, "forward": passes / 3, "backward": 2 * passes / 3, "optimizer": 0.3}

    found = term_check(Timer(), step)  # type: ignore[arg-type]
    assert found is not None and found["largest_gap"] == "data"
    assert found["shares"]["data"] == {"measured": pytest.approx(1.0 / (step.total + 1.0)), "predicted": 0.0}
    assert term_check(None, step) is None


def test_predict_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="predict"):
        ThroughputCallback(predict="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- a real run
def _rows(vocab: int, n: int = 24, width: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (n, width), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def test_cpu_fit_reports_prediction_beside_measurement(tmp_path: Path) -> None:
    module = CausalLMModule("tiny-llama", pretrained=False)
    rows = _rows(vocab=64)
    loader = DataLoader(rows, batch_size=4, collate_fn=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[ThroughputCallback(warmup_steps=1, log_every_n_steps=1), TermTimer(warmup_steps=1)],
        default_root_dir=tmp_path,
        logger=pl.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, loader)
    summary = json.loads((Path(trainer.log_dir) / "throughput.json").read_text())
    plan = summary["plan"]
    assert plan["step_seconds"] > 0 and plan["hardware"]["name"] == "CPU ranks (measured)"
    assert (plan["setup"]["micro_batch_size"], plan["setup"]["seq_length"]) == (4, 16)
    assert plan["tokens_per_step"] == 4 * 16
    assert plan["tokens_per_second"] == pytest.approx(plan["tokens_per_step"] / plan["step_seconds"])
    assert plan["measured_step_seconds"] == pytest.approx(1 / summary["total"]["optimizer_steps_per_sec"])
    assert plan["ratio"] == pytest.approx(plan["measured_step_seconds"] / plan["step_seconds"])
    assert plan["terms"]["total"] == pytest.approx(plan["step_seconds"])
    # TermTimer's phases: every optimizer step's data, forward, backward and optimizer, beside the model's shares
    phases = plan["phases"]
    assert set(phases["seconds"]) == set(PHASES) and phases["seconds"]["backward"] > 0
    assert sum(v["measured"] for v in phases["shares"].values()) == pytest.approx(1.0)
    assert sum(v["predicted"] for v in phases["shares"].values()) == pytest.approx(1.0)
    assert phases["largest_gap"] in PHASES
    text = _summary_table(summary)
    assert "| step time (s) |" in text and "plan check: measured / predicted step time" in text
