"""``gym plan --config run.yaml``: the run's own settings planned (``planner.run_config``), the flags beside it
overriding them, what cannot be planned left out with a note or refused in one line."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_lightning.cli import main
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.errors import GymUserError
from gym_lightning.lora import LoRAArgs
from gym_lightning.module import CausalLMModule
from gym_lightning.planner.run_config import DATA_DEFAULTS, MODULE_DEFAULTS, run_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _plan_json(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[dict[str, Any], str]:
    main(["plan", *flags, "--json"])
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def _write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_plans(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # dpo.yaml starts from the folder configs/quickstart.yaml exports (there once that ran): its preset stands in.
    model = ["--model", "tiny-llama"] if config.stem == "dpo" else []
    main(["plan", "--config", str(config), *model])  # a SystemExit here is the failure
    table = capsys.readouterr().out
    assert "Recommendation:" in table
    strategy = yaml.safe_load(config.read_text())["trainer"].get("strategy")
    assert ("Your run" in table) == (strategy is not None)
    assert ("Your run (strategy: gym_auto): gym_auto: " in table) == (strategy == "gym_auto")


def test_the_planned_values_are_the_yaml_s(capsys: pytest.CaptureFixture[str]) -> None:
    report, _ = _plan_json(capsys, "--config", str(CONFIGS / "qlora.yaml"))
    setup = report["setup"]
    assert report["model"]["name"] == "qwen3-0.6b"  # Qwen/Qwen3-0.6B: the bundled shape of the hub name
    assert (setup["lora_r"], setup["lora_targets"], setup["quantization"]) == (16, "all-linear", "nf4")
    assert (setup["micro_batch_size"], setup["seq_length"], setup["precision"]) == (4, 512, "bf16-mixed")
    assert (setup["gpus_per_node"], setup["nodes"], setup["activation_checkpointing"]) == (2, 1, True)
    assert report["selected"] == "fsdp_full"
    report, _ = _plan_json(capsys, "--config", str(CONFIGS / "long_sequence.yaml"))
    setup = report["setup"]
    assert (setup["sequence_parallel_size"], setup["mlp_tile_tokens"], setup["loss_chunk_tokens"]) == (2, 512, 512)
    assert (setup["seq_length"], setup["loss_chunking"], report["selected"]) == (2048, "on", "zero3")
    report, _ = _plan_json(capsys, "--config", str(CONFIGS / "zero3_offload.yaml"))
    assert report["selected"] == "zero3_offload" and report["setup"]["precision"] == "32-true"
    report, _ = _plan_json(capsys, "--config", str(CONFIGS / "quickstart.yaml"))
    assert report["setup"]["accelerator"] == "cpu" and report["selected"] is None
    assert report["model"]["num_layers"] == 3  # model.config_overrides applied


def test_a_flag_overrides_the_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--lora_r", "4", "--strategy", "zero2", "--micro_batch_size", "2", "--precision", "32-true"]
    report, _ = _plan_json(capsys, "--config", str(CONFIGS / "qlora.yaml"), *flags, "--gpus_per_node", "8")
    setup = report["setup"]
    assert (setup["lora_r"], setup["micro_batch_size"], setup["precision"], setup["gpus_per_node"]) == (
        4,
        2,
        "32-true",
        8,
    )
    assert report["selected"] == "zero2" and setup["quantization"] == "nf4" and setup["seq_length"] == 512


def test_a_strategy_the_list_lacks_is_a_row_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    strategy = {"class_path": "gym_lightning.strategies.ZeRO2Strategy", "init_args": {"offload_optimizer": "nvme"}}
    path = _write(tmp_path, {"trainer": {"devices": 4, "strategy": strategy}, "model": {"model": "llama-3-8b"}})
    report, _ = _plan_json(capsys, "--config", path)
    assert report["selected"] == "run"
    assert report["strategies"][-1]["strategy"] == "ZeROStrategy(stage=2, offload_optimizer='nvme')"
    assert report["strategies"][-1]["bytes"]["nvme_per_node"] > 0


def test_a_zero_json_gives_the_stage_and_offload(tmp_path: Path) -> None:
    json_path = str(CONFIGS / "deepspeed" / "ds_zero3_offload.json")
    strategy = {"class_path": "ZeROStrategy", "init_args": {"config": json_path}}
    run = run_settings({"trainer": {"strategy": strategy}})
    assert (run.settings["strategy"].stage, run.settings["strategy"].offload_parameters) == (3, "cpu")


def test_what_cannot_be_planned_is_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    strategy = {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": {"stage": 3, "bucket_size": 10}}
    model = {"model": "llama-3-8b", "torch_dtype": "bfloat16", "optim": "rmsprop", "lr": 1e-4}
    path = _write(tmp_path, {"trainer": {"devices": "auto", "strategy": strategy}, "model": model})
    report, err = _plan_json(capsys, "--config", path)
    assert "model.torch_dtype" in err and "rmsprop planned as sgd" in err
    assert "trainer.devices auto" in err and "model.lr" not in err  # no memory: no note
    assert report["setup"]["optimizer"] == "sgd" and report["setup"]["gpus_per_node"] == 8
    assert "bucket_size" not in err and report["setup"]["bucket_size"] == 10  # the strategy's knob, planned


def test_bad_values_are_one_line_listing_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "trainer": {"precision": "64-true", "strategy": "nope"},
        "model": {"quantization": {"quant_type": "int8"}},
    }
    with pytest.raises(SystemExit) as info:
        main(["plan", "--config", _write(tmp_path, config)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert "trainer.precision 64-true" in err and "'nope'" in err and "int8" in err
    with pytest.raises(GymUserError, match="must be a YAML mapping"):
        run_settings(["not", "a", "mapping"])  # type: ignore[arg-type]


def test_without_model_or_config_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan"])
    assert info.value.code == 2 and "--model (or --config)" in capsys.readouterr().err


def test_the_defaults_are_the_run_s() -> None:
    """A setting the YAML leaves out is planned at the default the run gets."""
    module = inspect.signature(CausalLMModule).parameters
    assert {key: module[key].default for key in ("model", "optim")} == {
        key: MODULE_DEFAULTS[key] for key in ("model", "optim")
    }
    assert LoRAArgs().r == MODULE_DEFAULTS["lora_r"]
    data = inspect.signature(CausalLMDataModule).parameters
    assert {key: data[key].default for key in DATA_DEFAULTS} == DATA_DEFAULTS


def test_a_deepspeed_json_s_values_reach_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_config = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1000,
            "stage3_model_persistence_threshold": "auto",  # gym's rule's: left to it
            "sub_group_size": 100_000_000,
            "offload_optimizer": {"device": "cpu"},
            "leaf_module": {"classes": ["LlamaDecoderLayer"]},
        }
    }
    strategy = {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": {"config": json_config}}
    model = {"model": "llama-3-8b", "objective": "pt", "compile": True}
    path = _write(tmp_path, {"trainer": {"devices": 8, "strategy": strategy}, "model": model})
    run = run_settings(yaml.safe_load(Path(path).read_text()))
    assert (run.settings["bucket_size"], run.settings["zero3_param_persistence_threshold"]) == (50_000_000, 1000)
    assert run.settings["sub_group_size"] == 100_000_000 and "zero3_model_persistence_threshold" not in run.settings
    assert run.settings["zero3_leaf_layers"] is False  # the user's leaf_module replaces gym's decoder leaves
    assert (run.settings["stage"], run.settings["kernels"]) == ("pt", "compiled")
    assert run.settings["strategy"].offload_optimizer == "cpu" and not run.notes
    report, _ = _plan_json(capsys, "--config", path)
    assert report["setup"]["bucket_size"] == 50_000_000 and report["selected"] == "zero3_offload_optimizer"
    larger = {"zero_optimization": {**json_config["zero_optimization"], "reduce_bucket_size": 5e8}}
    bigger_strategy = {**strategy, "init_args": {"config": larger}}
    bigger = _write(tmp_path, {"trainer": {"devices": 8, "strategy": bigger_strategy}, "model": model})
    again, _ = _plan_json(capsys, "--config", bigger)

    def buffers(plan: dict[str, Any]) -> int:
        return next(s["bytes"]["buffers"] for s in plan["strategies"] if s["key"] == "zero3")

    assert buffers(again) - buffers(report) == 4 * (5e8 - 5e7)  # the bucket, in fp32 (the YAML trains 32-true)


def test_an_objective_the_planner_lacks_is_a_problem(tmp_path: Path) -> None:
    with pytest.raises(GymUserError, match=r"model\.objective 'ppo' is not planned: give one of sft, pt"):
        run_settings({"model": {"objective": "ppo"}})
