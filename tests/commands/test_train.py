"""``gym train``: HF Trainer flags -> the LightningCLI arguments of ``gym fit`` (one code path)."""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli_runs import gym_in_one_launch
from helpers.dist import REPO_ROOT, rank_env, run_python
from launch_lines import LLAMA_FACTORY_LORA_SFT

from gym_lightning import cli
from gym_lightning.commands.train import (
    _fast_path_values,
    flag_notes,
    flags_for_settings,
    main,
    parse_train_args,
    to_cli_args,
)
from gym_lightning.errors import GymUserError

DS_ZERO3 = REPO_ROOT / "configs" / "deepspeed" / "ds_zero3.json"
BASE = ["--model_name_or_path", "tiny-llama", "--dataset", "addition"]


def _cli_args(*flags: str) -> dict[str, str]:
    """The ``--key=value`` arguments ``gym train`` would hand to LightningCLI, as a dict."""
    args = to_cli_args(parse_train_args([*BASE, *flags]), env={})
    assert args[0] == "fit"
    return dict(arg[2:].split("=", 1) for arg in args[1:])


def test_hf_flags_map_onto_the_fit_configuration() -> None:
    args = _cli_args(
        *("--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "16"),
        *("--gradient_accumulation_steps", "2", "--learning_rate", "1e-4", "--weight_decay", "0.1"),
        *("--adam_beta2", "0.95", "--max_grad_norm", "0.5", "--warmup_ratio", "0.1", "--lr_scheduler_type", "cosine"),
        *("--num_train_epochs", "2", "--bf16", "--gradient_checkpointing", "--output_dir", "out/run"),
        *("--logging_steps", "5", "--eval_steps", "10", "--save_steps", "20", "--save_total_limit", "3"),
        *("--seed", "7", "--max_seq_length", "64", "--data_format", "alpaca", "--devices", "2", "--num_nodes", "1"),
        *("--accelerator", "cpu", "--resume_from_checkpoint", "last.ckpt", "--train_on_prompt", "--packing"),
    )
    expected = {
        "seed_everything": "7",
        "data.seed": "7",
        "data.batch_size": "4",
        "data.eval_batch_size": "16",
        "data.max_seq_length": "64",
        "data.format": "alpaca",
        "data.mask_prompt": "false",
        "data.packing": "true",
        "trainer.accumulate_grad_batches": "2",
        "trainer.gradient_clip_val": "0.5",
        "trainer.precision": "bf16-mixed",
        "trainer.max_epochs": "2",
        "trainer.log_every_n_steps": "5",
        # Lightning's val_check_interval counts micro-batches: 10 optimizer steps x 2 micro-batches.
        "trainer.val_check_interval": "20",
        "trainer.check_val_every_n_epoch": "null",
        "trainer.default_root_dir": "out/run",
        "trainer.devices": "2",
        "trainer.accelerator": "cpu",
        "model.lr": "0.0001",
        "model.weight_decay": "0.1",
        "model.betas": "[0.9, 0.95]",
        "model.hf_scheduler": "cosine",
        "model.optim": "adamw_torch_fused",  # HF 5's default
        "model.warmup_ratio": "0.1",
        "model.gradient_checkpointing": "true",
        "export.output_dir": "out/run/hf",
        "ckpt_path": "last.ckpt",
    }
    assert {key: args.get(key) for key in expected} == expected
    checkpoint, state = json.loads(args["trainer.callbacks"])
    assert state["class_path"] == "gym_lightning.callbacks.TrainerStateCallback"
    assert checkpoint["class_path"] == "gym_lightning.checkpointing.StepCheckpoint"
    assert checkpoint["init_args"] | {"dirpath": None} == {"dirpath": None, "every_n_steps": 20, "keep_last": 3}
    assert Path(checkpoint["init_args"]["dirpath"]) == Path("out/run/checkpoints")


def test_hf_defaults_and_other_choices() -> None:
    args = _cli_args("--max_steps", "7", "--lr_scheduler_type", "constant", "--warmup_steps", "5", "--fp16")
    assert args["trainer.max_steps"] == "7" and args["trainer.max_epochs"] == "-1"  # max_steps wins, as in HF
    assert args["model.hf_scheduler"] == "constant"  # transformers' constant schedule ignores the warm-up itself
    assert args["trainer.precision"] == "16-mixed"
    assert args["trainer.gradient_clip_val"] == "1.0" and args["model.lr"] == "5e-05"  # HF defaults
    assert args["trainer.limit_val_batches"] == "0"  # eval_strategy "no" by default, as HF
    assert "trainer.strategy" not in args
    lora = _cli_args(
        "--use_lora", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", "--save_strategy", "no"
    )
    assert json.loads(lora["model.lora"]) == {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    assert lora["trainer.enable_checkpointing"] == "false"
    assert [callback["class_path"] for callback in json.loads(lora["trainer.callbacks"])] == [
        "gym_lightning.callbacks.TrainerStateCallback"
    ]
    epoch = _cli_args("--do_eval", "--report_to", "csv", "--output_dir", "o")
    assert epoch["trainer.check_val_every_n_epoch"] == "1"
    assert json.loads(epoch["trainer.logger"])[0]["init_args"] == {"save_dir": "o", "name": "logs"}


def test_skip_memory_metrics_false_adds_the_memory_report() -> None:
    """HF's --skip_memory_metrics False (its memory metrics on) adds MemoryCallback: memory.json per rank."""
    names = [c["class_path"] for c in json.loads(_cli_args("--skip_memory_metrics", "False")["trainer.callbacks"])]
    assert "gym_lightning.callbacks.MemoryCallback" in names
    default = json.loads(_cli_args()["trainer.callbacks"])  # HF's default skips them
    assert "gym_lightning.callbacks.MemoryCallback" not in [c["class_path"] for c in default]


def _quantization(*flags: str) -> dict[str, object]:
    return json.loads(_cli_args("--use_lora", "--load_in_4bit", *flags)["model.quantization"])


def test_hf_4bit_flags_make_a_qlora_model() -> None:
    """The HF/TRL QLoRA command line (transformers' BitsAndBytesConfig names): a 4-bit base under LoRA adapters;
    every quant type, compute dtype and storage that transformers takes (storage is uint8 in effect)."""
    args = _cli_args(
        "--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type", "nf4", "--bnb_4bit_compute_dtype", "bfloat16",
        "--bnb_4bit_use_double_quant", "--bnb_4bit_quant_storage", "bfloat16",
    )  # fmt: skip
    assert json.loads(args["model.quantization"]) == {
        "quant_type": "nf4",
        "compute_dtype": "bfloat16",
        "double_quant": True,
        "quant_storage": "bfloat16",
    }
    assert json.loads(args["model.lora"]) == {}
    assert _quantization() == {"double_quant": False}
    assert "model.quantization" not in _cli_args("--use_lora")
    for storage in ("uint8", "int8", "float16", "bfloat16", "float32", "float64"):
        assert _quantization("--bnb_4bit_quant_storage", storage)["quant_storage"] == storage
    for given, dtype in [("float16", "float16"), ("half", "float16"), ("float", "float32"), ("float64", "float64")]:
        assert _quantization("--bnb_4bit_compute_dtype", given)["compute_dtype"] == dtype
    assert _quantization("--bnb_4bit_quant_type", "fp4")["quant_type"] == "fp4"
    # TRL computes in --dtype (its get_quantization_config); an explicit compute dtype wins.
    assert _quantization("--dtype", "float16")["compute_dtype"] == "float16"
    assert _quantization("--dtype", "float16", "--bnb_4bit_compute_dtype", "float32")["compute_dtype"] == "float32"
    # Explicit values, and TRL's name of the flag.
    for flags, double_quant in [
        (["--bnb_4bit_use_double_quant", "True"], True),
        (["--bnb_4bit_use_double_quant", "False"], False),
        (["--use_bnb_nested_quant"], True),
        (["--use_bnb_nested_quant", "False"], False),
    ]:
        assert _quantization(*flags)["double_quant"] is double_quant, flags


def test_deepspeed_flag_makes_a_zero_strategy_and_shared_settings_come_from_the_json(tmp_path: Path) -> None:
    args = _cli_args("--deepspeed", str(DS_ZERO3))
    strategy = json.loads(args["trainer.strategy"])
    assert strategy == {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": {"config": str(DS_ZERO3)}}
    assert args["trainer.accumulate_grad_batches"] == "1" and args["trainer.gradient_clip_val"] == "1.0"
    explicit = tmp_path / "ds.json"
    explicit.write_text(json.dumps({"gradient_accumulation_steps": 4, "gradient_clipping": 0.3}))
    args = _cli_args("--deepspeed", str(explicit))
    assert args["trainer.accumulate_grad_batches"] == "4" and args["trainer.gradient_clip_val"] == "0.3"
    # Flags given on the command line are the Trainer's side; the strategy then reports any disagreement.
    args = _cli_args("--deepspeed", str(explicit), "--gradient_accumulation_steps", "2", "--max_grad_norm", "0")
    assert args["trainer.accumulate_grad_batches"] == "2" and args["trainer.gradient_clip_val"] == "0.0"


def test_errors_from_the_run_name_the_gym_train_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = (
        "  - gradient_accumulation_steps=16 in the DeepSpeed config but trainer.accumulate_grad_batches gives 2: "
        'write "auto" (or 2) in the JSON, or change trainer.accumulate_grad_batches to 16.'
    )

    def failing_run(args: list[str]) -> None:
        raise GymUserError(f"The DeepSpeed config disagrees with the Trainer/module (1 problem(s)):\n{problem}")

    monkeypatch.setattr(cli, "run_lightning_cli", failing_run)
    with pytest.raises(GymUserError) as info:
        main([*BASE, "--deepspeed", str(DS_ZERO3)])
    lines = str(info.value).splitlines()
    assert lines[0] == "The DeepSpeed config disagrees with the Trainer/module (1 problem(s)):"
    # The first mention of each setting in a line gets its flag; the message is otherwise unchanged.
    assert lines[1] == problem.replace(
        "trainer.accumulate_grad_batches gives",
        "trainer.accumulate_grad_batches (gym train: --gradient_accumulation_steps) gives",
    )


def test_other_errors_from_the_run_pass_through_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    def crashing_run(args: list[str]) -> None:
        raise RuntimeError("model.lr")

    monkeypatch.setattr(cli, "run_lightning_cli", crashing_run)
    with pytest.raises(RuntimeError, match=r"^model\.lr$"):
        main([*BASE])


def test_flags_for_settings_knows_each_setting_once_per_line() -> None:
    text = (
        "world size (trainer.devices x trainer.num_nodes) x data.batch_size, model.warmup_steps/model.warmup_ratio\n"
        "optimizer.params.lr and model.lr; trainer.precision is 'bf16-mixed'; scheduler.params.total_num_steps"
    )
    first, second = flags_for_settings(text).splitlines()
    for setting, flag in [
        ("trainer.devices", "--devices"),
        ("trainer.num_nodes", "--num_nodes"),
        ("data.batch_size", "--per_device_train_batch_size"),
        ("model.warmup_steps", "--warmup_steps"),
        ("model.warmup_ratio", "--warmup_steps"),  # transformers 5: warmup_steps < 1 is the ratio
    ]:
        assert f"{setting} (gym train: {flag})" in first
    # Only whole setting names: optimizer.params.lr is a JSON key, not model.lr.
    assert second == (
        "optimizer.params.lr and model.lr (gym train: --learning_rate); "
        "trainer.precision (gym train: --bf16/--fp16) is 'bf16-mixed'; scheduler.params.total_num_steps"
    )


def test_help_lists_the_hf_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model_name_or_path",
        "--deepspeed",
        "--per_device_train_batch_size",
        "--per_device_eval_batch_size",
        "--gradient_accumulation_steps",
        "--learning_rate",
        "--num_train_epochs",
        "--max_steps",
        "--warmup_steps",
        "--warmup_ratio",
        "--lr_scheduler_type",
        "--weight_decay",
        "--max_grad_norm",
        "--bf16",
        "--fp16",
        "--gradient_checkpointing",
        "--output_dir",
        "--logging_steps",
        "--save_steps",
        "--eval_steps",
        "--seed",
        "--resume_from_checkpoint",
        "--train_file",
        "--validation_file",
        "--data_format",
        "--max_seq_length",
        "--use_lora",
        "--lora_r",
        "--lora_alpha",
        "--lora_dropout",
        "--lora_target_modules",
        "--devices",
        "--num_nodes",
        "--print_config",
        "--config",
        "--dataset_name",
        "--max_length",
        "--use_peft",
        "--lora_rank",
        "--bnb_4bit_quant_storage",
    ):
        assert flag in out, flag
    assert "The initial learning rate for" in out  # HF's own help text


@pytest.mark.parametrize(
    ("flag", "suggestion"),
    [("--lerning_rate", "--learning_rate"), ("--gradient_acumulation_steps", "--gradient_accumulation_steps")],
)
def test_unknown_flag_suggests_the_closest(capsys: pytest.CaptureFixture[str], flag: str, suggestion: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *BASE, flag, "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"gym_lightning: error: gym train: unrecognized argument {flag}; did you mean {suggestion}? "
        "(see gym train --help)\n"
    )


def test_bad_flag_combinations_fail_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--model_name_or_path", "tiny-llama", "--bf16", "--fp16", "--lora_r", "4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for text in ("--bf16 and --fp16", "no training data", "--lora_r need --use_lora"):
        assert text in err
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *BASE, "--load_in_4bit", "--bnb_4bit_use_double_quant"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "add --use_lora (QLoRA)" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *BASE, "--use_lora", "--bnb_4bit_compute_dtype", "float16"])
    assert info.value.code == 2 and "--bnb_4bit_compute_dtype need --load_in_4bit" in capsys.readouterr().err


def _losses(root: Path) -> list[float]:
    (metrics,) = root.glob("logs/version_*/metrics.csv")
    with metrics.open() as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


@pytest.mark.slow
def test_print_config_yaml_reproduces_the_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = [
        *BASE,
        *("--max_steps", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"),
        *("--learning_rate", "3e-3", "--warmup_steps", "1", "--max_seq_length", "32", "--logging_steps", "1"),
        *("--report_to", "csv", "--save_strategy", "no", "--accelerator", "cpu", "--devices", "1"),
        *("--output_dir", str(out)),
    ]
    env = rank_env()
    printed = run_python(["-m", "gym_lightning", "train", *flags, "--print_config"], timeout=300, env=env).stdout
    config = yaml.safe_load(printed)
    assert config["trainer"]["accumulate_grad_batches"] == 2 and config["model"]["lr"] == 3e-3
    config_path = tmp_path / "train.yaml"
    config_path.write_text(printed)

    run_python(["-m", "gym_lightning", "train", *flags], timeout=300, env=env)
    from_train = _losses(out)
    assert len(from_train) == 4 and all(loss > 0 for loss in from_train)
    assert (out / "hf" / "config.json").is_file()
    shutil.rmtree(out)

    run_python(["-m", "gym_lightning", "fit", "--config", str(config_path)], timeout=300, env=env)
    assert _losses(out) == from_train


# ------------------------------------------------------------------------------------------ shipped DeepSpeed JSONs
# Each shipped JSON through `gym train` on 2 CPU ranks (Lightning launches the second), 3 optimizer steps of the
# tiny Llama, every "auto" resolved from the flags. The logged loss is rank 0's local one, and the data order of 2
# ranks is not that of 1 process, so runs are compared with each other: the first loss (before any update) is the
# same for all six; configs without an optimizer block (the module's torch AdamW and schedule) agree with each
# other at every step, and so do the offload configs, whose HF-docs optimizer/scheduler blocks make DeepSpeed
# build DeepSpeedCPUAdam and WarmupDecayLR (its log warm-up starts at lr 0, so their second loss differs from
# the module-optimizer runs, which have no warm-up and HF's linear schedule: proof that the JSON's blocks were used;
# with a warm-up, HF's schedule starts at lr 0 too). Tolerance 1e-5 relative: fp32, ZeRO-3
# re-partitions parameters; a normalisation bug moves losses by >= 1e-2 (tests/strategies/test_multirank.py).
DS_DIR = REPO_ROOT / "configs" / "deepspeed"
MODULE_OPTIMIZER = ["ds_zero1", "ds_zero2", "ds_zero3"]
JSON_OPTIMIZER = ["ds_zero2_offload", "ds_zero3_offload", "ds_zero_infinity"]
SHIPPED = MODULE_OPTIMIZER + JSON_OPTIMIZER
# NVMe offload in a process of its own: after other ZeRO runs in the same ranks, DeepSpeed refused to load its
# async_io op there ("not being compatible due to hardware/software issue"), where a fresh process loads it.
SELF_LAUNCHED = "ds_zero_infinity"
RUN_FLAGS = [
    *BASE,
    *("--max_steps", "3", "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--warmup_steps", "0"),
    *("--max_seq_length", "32", "--logging_steps", "1", "--report_to", "csv", "--save_strategy", "no"),
    *("--accelerator", "cpu", "--devices", "2", "--per_device_train_batch_size", "4"),
]


def _shipped(name: str, tmp_path: Path) -> Path:
    if name != "ds_zero_infinity":
        return DS_DIR / f"{name}.json"
    config = json.loads((DS_DIR / f"{name}.json").read_text())
    for key in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][key]["nvme_path"] = str(tmp_path / "nvme")
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama saved as a local folder: every stage then starts from the same weights (a preset built inside
    ZeRO-3's zero.Init draws its random initialisation in another order than stages 1/2)."""
    from gym_lightning.models import build_causal_lm
    from gym_lightning.tokenizer import load_tokenizer

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_causal_lm("tiny-llama").save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def shipped_runs(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> Path:
    """``gym train --deepspeed <shipped JSON>`` of every shipped JSON on 2 CPU ranks; returns the folder holding
    ``<name>/run``. ``SELF_LAUNCHED`` starts its own 2 ranks, as a user's ``gym train --devices 2`` does (Lightning's
    launcher re-runs the command for rank 1); the others run one after the other in one torchrun launch (one import
    and process-group start instead of five: ``helpers.cli_runs.gym_in_one_launch``)."""
    root = tmp_path_factory.mktemp("shipped")
    runs = {}
    for name in SHIPPED:
        (root / name).mkdir()
        config = _shipped(name, root / name)
        flags = [*RUN_FLAGS, "--model_name_or_path", str(tiny_folder), "--output_dir", str(root / name / "run")]
        runs[name] = ["train", *flags, "--deepspeed", str(config)]
    run_python(["-m", "gym_lightning", *runs.pop(SELF_LAUNCHED)], 600)
    gym_in_one_launch(runs, root / "runs.json", timeout=900)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_json_trains_on_two_cpu_ranks(name: str, shipped_runs: Path) -> None:
    from transformers import AutoModelForCausalLM

    losses = _losses(shipped_runs / name / "run")
    assert len(losses) == 3
    same_kind = MODULE_OPTIMIZER if name in MODULE_OPTIMIZER else JSON_OPTIMIZER
    for other in SHIPPED:
        other_losses = _losses(shipped_runs / other / "run")
        assert losses[0] == pytest.approx(other_losses[0], rel=1e-5), other
        if other in same_kind:
            assert losses == pytest.approx(other_losses, rel=1e-5), other
        else:
            assert losses[1] != pytest.approx(other_losses[1], rel=1e-4), other
    model = AutoModelForCausalLM.from_pretrained(shipped_runs / name / "run" / "hf")  # complete, and it loads
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ------------------------------------------------------------------------------ HfArgumentParser over TrainingArguments
def test_every_training_arguments_field_is_a_flag() -> None:
    from dataclasses import fields

    from transformers import TrainingArguments

    from gym_lightning.commands.train import build_parser

    valid = set(build_parser().valid_flags())
    assert {f"--{spec.name}" for spec in fields(TrainingArguments) if spec.init} <= valid
    assert {"--local_rank", "--max_seq_length", "--model_max_length", "--use_peft", "--devices"} <= valid


def test_hf_types_that_were_refused_before_now_map() -> None:
    args = _cli_args(
        *("--bf16", "True", "--warmup_steps", "0.03", "--max_steps", "20", "--logging_steps", "0.1"),
        *("--save_steps", "0.5", "--eval_steps", "0.25", "--report_to", "csv", "tensorboard", "--run_name", "r1"),
        *("--optim", "adamw_torch", "--local_rank=1", "--data_seed", "5", "--resume_from_checkpoint", "True"),
        *("--lr_scheduler_type", "constant_with_warmup", "--disable_tqdm", "True"),
        *("--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'),
    )
    assert args["trainer.precision"] == "bf16-mixed"
    assert args["model.warmup_ratio"] == "0.03" and args["model.warmup_steps"] == "0"
    # Ratios of --max_steps 20, rounded up as HF: 0.1 -> 2, 0.5 -> 10, 0.25 -> 5.
    assert args["trainer.log_every_n_steps"] == "2" and args["trainer.val_check_interval"] == "5"
    assert json.loads(args["trainer.callbacks"])[0]["init_args"]["every_n_steps"] == 10
    loggers = json.loads(args["trainer.logger"])
    assert [logger["class_path"].rsplit(".", 1)[1] for logger in loggers] == ["CSVLogger", "TensorBoardLogger"]
    assert loggers[0]["init_args"]["version"] == "r1"
    assert args["data.seed"] == "5" and args["seed_everything"] == "42"
    assert args["ckpt_path"] == "last" and args["model.hf_scheduler"] == "constant_with_warmup"
    assert args["trainer.enable_progress_bar"] == "false" and args["model.optim"] == "adamw_torch"
    assert json.loads(args["model.scheduler_kwargs"]) == {"min_lr_rate": 0.1}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--push_to_hub"], "--push_to_hub True is not supported: gym train does not upload"),
        (["--optim", "adamw_8bit"], "--optim adamw_8bit: not built by gym_lightning"),
        (["--lr_scheduler_type", "reduce_lr_on_plateau"], "reduce_lr_on_plateau: follows a validation metric"),
        (["--report_to", "comet_ml"], "--report_to comet_ml: gym train logs to"),
        (["--logging_steps", "0.1"], "--logging_steps 0.1 is a ratio of the total steps: give --max_steps"),
    ],
)
def test_unmapped_flags_are_refused_in_one_line_naming_them(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *BASE, *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "1 problem(s)" in err


def test_compile_and_liger_flags_make_the_fast_path() -> None:
    assert "model.compile" not in _cli_args("--torch_compile", "False")
    assert _cli_args("--torch_compile")["model.compile"] == "true"
    # transformers: a backend or a mode turns compilation on by itself.
    compiled = json.loads(_cli_args("--torch_compile_mode", "max-autotune-no-cudagraphs")["model.compile"])
    assert compiled == {"mode": "max-autotune-no-cudagraphs"}
    assert json.loads(_cli_args("--use_liger_kernel")["model.fused_ops"]) == {"kernels": "liger"}
    assert json.loads(_cli_args("--enable_liger_kernel", "True")["model.fused_ops"]) == {"kernels": "liger"}
    # liger_kernel_config is a dict (HF's own parser takes it from a YAML/JSON arguments file only).
    args = parse_train_args([*BASE, "--use_liger_kernel"])
    args.liger_kernel_config = {"rope": False, "fused_linear_cross_entropy": True}
    fused = _fast_path_values(args)["model.fused_ops"]
    assert fused == {"kernels": "liger", "rope": False, "linear_cross_entropy": True}
    args.liger_kernel_config = {"geglu": True}
    with pytest.raises(GymUserError, match="--liger_kernel_config keys \\['geglu'\\] are not known"):
        _fast_path_values(args)


def test_dataloader_pin_memory_false_turns_pinning_off() -> None:
    assert "data.pin_memory" not in _cli_args()  # HF's default (True): pinned on a GPU, as data.pin_memory: null
    assert _cli_args("--dataloader_pin_memory", "False")["data.pin_memory"] == "false"


def test_unmapped_flags_at_their_default_are_accepted() -> None:
    _cli_args("--torch_compile", "False", "--push_to_hub", "False", "--ddp_timeout", "1800", "--use_cpu", "False")


def test_arguments_from_one_yaml_or_json_file(tmp_path: Path) -> None:
    flags = {"model_name_or_path": "tiny-llama", "dataset": "addition", "learning_rate": 1e-4, "bf16": True}
    flags |= {"report_to": ["csv"], "max_steps": 10, "warmup_steps": 0.1, "resume_from_checkpoint": True}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(flags))
    (tmp_path / "run.json").write_text(json.dumps(flags))
    from_flags = _cli_args(
        *("--learning_rate", "1e-4", "--bf16", "--report_to", "csv", "--max_steps", "10", "--warmup_steps", "0.1"),
        *("--resume_from_checkpoint", "True"),
    )
    for name in ("run.yaml", "run.json"):
        assert to_cli_args(parse_train_args([str(tmp_path / name)]), env={}) == ["fit"] + [
            f"--{key}={value}" for key, value in from_flags.items()
        ]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(flags | {"lerning_rate": 1}))
    with pytest.raises(GymUserError, match="lerning_rate is not a gym train flag; did you mean learning_rate"):
        to_cli_args(parse_train_args([str(tmp_path / "bad.yaml")]), env={})


# ------------------------------------------------------------------------------------------------------ launchers
@pytest.mark.parametrize(
    ("env", "topology"),
    [
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1"}, (4, 2)),  # torchrun, accelerate
        ({"WORLD_SIZE": "2", "LOCAL_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"}, (2, 1)),  # deepspeed launcher
        ({"SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_NUM_NODES": "3", "SLURM_NTASKS": "6"}, (2, 3)),  # srun
        ({"SLURM_NTASKS": "6", "SLURM_NNODES": "3"}, None),  # the sbatch script itself, before srun
        ({}, None),
    ],
)
def test_launcher_topology_from_the_environment(env: dict[str, str], topology: tuple[int, int] | None) -> None:
    from gym_lightning.commands.train import launcher_topology

    assert launcher_topology(env) == topology


def test_launcher_sets_devices_and_nodes_unless_given() -> None:
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    args = dict(arg[2:].split("=", 1) for arg in to_cli_args(parse_train_args(BASE), env=env)[1:])
    assert (args["trainer.devices"], args["trainer.num_nodes"]) == ("2", "2")
    given = parse_train_args([*BASE, "--devices", "1"])
    args = dict(arg[2:].split("=", 1) for arg in to_cli_args(given, env=env)[1:])
    assert (args["trainer.devices"], args["trainer.num_nodes"]) == ("1", "2")
    args = dict(arg[2:].split("=", 1) for arg in to_cli_args(parse_train_args(BASE), env={})[1:])
    assert (args["trainer.devices"], args["trainer.num_nodes"]) == ("auto", "1")
    with pytest.raises(GymUserError, match="not a multiple of 2 per node"):
        to_cli_args(parse_train_args(BASE), env={"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"})


DS_STAGE0 = {
    "zero_optimization": {"stage": 0},
    **dict.fromkeys(("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"), "auto"),
}


def test_zero_strategy_accepts_stage_0() -> None:
    from gym_lightning.strategies import ZeROStrategy

    assert ZeROStrategy(config=DS_STAGE0).stage == 0 and ZeROStrategy(stage=0).config["zero_optimization"]["stage"] == 0
    with pytest.raises(GymUserError, match="stage=-1 is not a ZeRO stage; use 0"):
        ZeROStrategy(stage=-1)  # type: ignore[arg-type]


@pytest.mark.slow
def test_torchrun_without_devices_runs_two_ranks_and_deepspeed_stage0_matches_ddp(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 -m gym_lightning train`` with no --devices: 2 ranks from LOCAL_WORLD_SIZE
    (before, Lightning took devices=1 and refused the world size of 2). Then the same run with a ``"stage": 0``
    DeepSpeed JSON (refused before): DeepSpeed's engine without partitioning is plain fp32 data parallelism, so its
    losses equal DDP's (measured: identical to the last digit over 3 steps). About 60 s on 2 CPU cores."""
    (tmp_path / "ds0.json").write_text(json.dumps(DS_STAGE0))
    flags = [*BASE, *("--max_steps", "3", "--per_device_train_batch_size", "4", "--max_seq_length", "32")]
    flags += ["--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--logging_steps", "1"]
    flags += ["--report_to", "csv", "--save_strategy", "no", "--use_cpu", "True"]
    losses = {}
    for name, extra in (("ddp", []), ("stage0", ["--deepspeed", str(tmp_path / "ds0.json")])):
        out, env = tmp_path / name, rank_env()
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", env["MASTER_PORT"]]
        command = [*launcher, "-m", "gym_lightning", "train", *flags, *extra, "--output_dir", str(out)]
        proc = run_python(command, 300, env=env)
        assert "MEMBER: 2/2" in proc.stdout + proc.stderr
        (config,) = out.glob("logs/version_*/config.yaml")
        trainer = yaml.safe_load(config.read_text())["trainer"]
        assert str(trainer["devices"]) == "2"
        assert (out / "hf" / "config.json").is_file()
        losses[name] = _losses(out)
    assert "ZeROStrategy" in str(trainer["strategy"])
    assert len(losses["ddp"]) == 3 and losses["stage0"] == pytest.approx(losses["ddp"], rel=1e-5)


def test_trainer_state_log_history_is_hf_shaped() -> None:
    from gym_lightning.callbacks.curves import Curves
    from gym_lightning.callbacks.trainer_state import trainer_state

    curves = Curves(steps=[1, 2], loss=[2.0, 1.5], lr=[0.0, 0.1], val_steps=[2], val_loss=[1.7])
    state = trainer_state(curves, steps_per_epoch=4, global_step=2, max_steps=8)
    assert state == {
        "global_step": 2,
        "max_steps": 8,
        "epoch": 0.5,
        "log_history": [
            {"loss": 2.0, "learning_rate": 0.0, "epoch": 0.25, "step": 1},
            {"loss": 1.5, "learning_rate": 0.1, "epoch": 0.5, "step": 2},
            {"eval_loss": 1.7, "epoch": 0.5, "step": 2},  # after the step's training entry, as HF logs it
        ],
    }


def test_tf32_sets_torch_switches_in_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "run_lightning_cli", lambda args: None)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:  # torch's cuBLAS switch is a property of a module proxy: monkeypatch cannot read it back
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        main([*BASE, "--tf32", "True"])
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_deepspeed_launcher_node_rank_reaches_lightning() -> None:
    from gym_lightning.commands.train import launcher_node_rank

    assert launcher_node_rank({"CROSS_RANK": "1", "LOCAL_SIZE": "2"}) == {"NODE_RANK": "1"}
    assert launcher_node_rank({"CROSS_RANK": "1", "NODE_RANK": "1"}) == {}  # already set
    assert launcher_node_rank({"GROUP_RANK": "0"}) == {}  # torchrun's


def test_report_to_all_is_every_installed_logger_and_a_missing_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from gym_lightning.commands import train

    installed = {"tensorboard"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    loggers = json.loads(_cli_args("--report_to", "all")["trainer.logger"])
    assert [logger["class_path"].rsplit(".", 1)[1] for logger in loggers] == ["CSVLogger", "TensorBoardLogger"]
    problems = train.flag_problems(parse_train_args([*BASE, "--report_to", "mlflow"]))
    assert problems == ["--report_to mlflow: the mlflow package is not installed (pip install mlflow)."]


def test_fractional_epochs_train_ceil_of_the_fraction_of_steps_as_hf(tmp_path: Path) -> None:
    """``--num_train_epochs 1.5`` on 20 records of batch 4 (5 steps an epoch): ceil(7.5) = 8 steps, the HF rule, and
    the linear schedule ends at 0 at step 8 (the schedule was built for 8 steps, not for 2 whole epochs)."""
    from gym_lightning.callbacks.epochs import fractional_epoch_steps

    assert fractional_epoch_steps(1.5, 5) == 8 and fractional_epoch_steps(0.01, 5) == 1
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}"}) + "\n" for i in range(20)))
    out = tmp_path / "run"
    flags = [
        "--model_name_or_path", "tiny-llama", "--train_file", str(data), "--output_dir", str(out),
        "--per_device_train_batch_size", "4", "--num_train_epochs", "1.5", "--learning_rate", "1e-3",
        "--lr_scheduler_type", "linear", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "True", "--devices", "1", "--seed", "0",
    ]  # fmt: skip
    cli.main(["train", *flags])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["max_steps"] == 8
    rates = [entry["learning_rate"] for entry in state["log_history"] if "learning_rate" in entry]
    assert len(rates) == 8 and rates[-1] == pytest.approx(1e-3 / 8)  # linear: lr x (8 - 7) / 8 at the last step


# ------------------------------------------------------------------------------------------------ TRL and LLaMA-Factory
# TRL's documented SFT command line (its docs' `trl sft` example) after --model_name_or_path and --dataset_name.
TRL_SFT_LINE = shlex.split(
    "--use_peft --lora_r 32 --lora_alpha 16 --lora_dropout 0.05 --bf16 --gradient_checkpointing "
    "--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --learning_rate 2.0e-4 --lr_scheduler_type cosine "
    "--warmup_ratio 0.03"
)


def _flags(*flags: str) -> dict[str, str]:
    """Like ``_cli_args``, without BASE's data set (the flags name their own)."""
    args = to_cli_args(parse_train_args(["--model_name_or_path", "tiny-llama", *flags]), env={})
    return dict(arg[2:].split("=", 1) for arg in args[1:])


def _jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _problems(*flags: str) -> list[str]:
    from gym_lightning.commands.train import flag_problems

    return flag_problems(parse_train_args(["--model_name_or_path", "tiny-llama", *flags]))


def test_trl_sft_command_line_maps(tmp_path: Path) -> None:
    """TRL's documented SFT line (before: "unrecognized argument --dataset_name")."""
    data = _jsonl(tmp_path / "data.jsonl", [{"text": "1 plus 1 is 2"}])
    args = _flags("--dataset_name", str(data), *TRL_SFT_LINE)
    assert json.loads(args["model.lora"]) == {"r": 32, "alpha": 16, "dropout": 0.05}
    assert json.loads(args["data.train_files"]) == [str(data)] and args["data.val_files"] == "null"
    expected = {
        "trainer.precision": "bf16-mixed",
        "model.gradient_checkpointing": "true",
        "data.batch_size": "2",
        "trainer.accumulate_grad_batches": "4",
        "model.lr": "0.0002",
        "model.hf_scheduler": "cosine",
        "model.warmup_ratio": "0.03",
        "data.max_seq_length": "1024",  # TRL's max_length default (and run_clm's block size cap)
        "data.mask_prompt": "true",
    }
    assert {key: args[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--max_length", "256"], {"data.max_seq_length": "256"}),
        (["--cutoff_len", "128"], {"data.max_seq_length": "128"}),
        (["--packing"], {"data.packing": "true"}),
        (["--neat_packing"], {"data.packing": "true"}),
        (["--packing", "--packing_strategy", "bfd", "--padding_free"], {"data.packing": "true"}),
        (["--completion_only_loss", "False"], {"data.mask_prompt": "false"}),
        (["--assistant_only_loss"], {"data.mask_prompt": "true"}),
        (["--assistant_only_loss", "False"], {"data.mask_prompt": "false"}),
        (["--train_on_prompt"], {"data.mask_prompt": "false"}),
        (["--dataset_num_proc", "4"], {"data.num_proc": "4"}),
        (["--preprocessing_num_workers", "3"], {"data.num_proc": "3"}),
        (["--dataset_streaming"], {"data.streaming": "true"}),
        (["--dtype", "bfloat16"], {"model.torch_dtype": "bfloat16"}),
        (["--flash_attn", "sdpa"], {"model.attn_implementation": "sdpa"}),
        (["--test_split_size", "0.1"], {"data.val_split": "0.1"}),
        (["--val_size", "0.2"], {"data.val_split": "0.2"}),
        (["--dataset_text_field", "content"], {"data.format": "text", "data.columns": '{"text": "content"}'}),
        (["--max_samples", "5"], {"data.sources": '[{"path": ["DATA"], "max_samples": 5}]'}),
        (["--use_peft", "--lora_target_modules", "all-linear"], {"model.lora": '{"target_modules": ["all-linear"]}'}),
        (["--use_peft", "--lora_target", "q_proj,v_proj"], {"model.lora": '{"target_modules": ["q_proj", "v_proj"]}'}),
        (["--use_peft", "--lora_rank", "4"], {"model.lora": '{"r": 4}'}),
        (
            ["--use_peft", "--lora_target_parameters", "all-experts"],
            {"model.lora": '{"target_parameters": ["all-experts"]}'},
        ),
        (
            ["--use_peft", "--lora_target_parameters", "experts.gate_up_proj,experts.down_proj"],
            {"model.lora": '{"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}'},
        ),
        # Accepted at what gym_lightning does anyway: no refusal, no setting.
        (["--model_revision", "main", "--lora_task_type", "CAUSAL_LM", "--shuffle_dataset", "True"], {}),
        (["--loss_type", "chunked_nll", "--truncation_mode", "keep_start", "--eval_packing", "False"], {}),
        (["--overwrite_cache", "--plot_loss", "--ignore_bias_buffers", "True", "--pad_to_multiple_of", "auto"], {}),
    ],
)
def test_trl_and_llama_factory_flags_map_onto_fit_settings(
    tmp_path: Path, flags: list[str], expected: dict[str, str]
) -> None:
    data = _jsonl(tmp_path / "data.jsonl", [{"text": "1 plus 1 is 2"}])
    args = _flags("--train_file", str(data), *flags)
    assert {key: args.get(key, "").replace(str(data), "DATA") for key in expected} == expected


def test_dataset_name_takes_files_folders_with_splits_and_hub_sets(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "set" / "train.jsonl", [{"text": "a"}])
    test = _jsonl(tmp_path / "set" / "test.jsonl", [{"text": "b"}])
    folder = _flags("--dataset_name", str(tmp_path / "set"), "--do_eval")
    assert json.loads(folder["data.train_files"]) == [str(train.resolve())]
    assert json.loads(folder["data.val_files"]) == [str(test.resolve())]  # the test split, with evaluation on
    assert _flags("--dataset_name", str(tmp_path / "set"))["data.val_files"] == "null"  # off: not read, as TRL
    hub = _flags("--dataset_name", "org/set", "--dataset_config", "en", "--dataset_train_split", "train[:10]")
    assert json.loads(hub["data.sources"]) == [{"path": "org/set", "split": "train[:10]", "subset": "en"}]
    assert hub["data.train_files"] == "null"
    glob = _flags("--dataset_name", str(tmp_path / "set" / "*.jsonl"))
    assert json.loads(glob["data.train_files"]) == [str(tmp_path / "set" / "*.jsonl")]
    assert _problems("--dataset_name", "org/set", "--do_eval") == [
        "--dataset_test_split test: gym_lightning reads validation data from files; pass --validation_file, a "
        "validation fraction (--validation_split_percentage) or --eval_strategy no."
    ]
    assert "without a test split" in _problems("--dataset_name", str(train), "--do_eval")[0]
    assert "no such file" in _problems("--dataset_name", str(tmp_path / "missing.jsonl"))[0]
    assert "each choose the training data" in _problems("--dataset_name", str(train), "--dataset", "addition")[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--load_in_8bit"], "--load_in_8bit True is not supported: gym_lightning quantises the base to 4 bits only"),
        (["--use_dora"], "--use_dora True is not supported: DoRA is not wired into"),
        (["--use_rslora"], "pass --lora_alpha alpha x sqrt(r)"),
        (["--model_revision", "v1.0"], "--model_revision 'v1.0' is not supported"),
        (["--padding_free"], "--padding_free True is not supported"),
        (["--chat_template_path", "t.jinja"], "--chat_template_path 't.jinja' is not supported"),
        (["--lora_task_type", "SEQ_CLS"], "--lora_task_type 'SEQ_CLS' is not supported"),
        (["--loss_type", "dft"], "--loss_type 'dft' is not supported"),
        (["--stage", "rm"], "--stage rm (reward modelling): a reward model is a sequence classifier"),
        (["--finetuning_type", "freeze"], "--finetuning_type 'freeze' is not supported"),
        (["--quantization_bit", "8"], "--quantization_bit 8 is not supported"),
        (["--quantization_method", "gptq"], "--quantization_method 'gptq' is not supported"),
        (["--template", "alpaca"], "--template alpaca: LLaMA-Factory's own prompt format"),
        (["--template", "llama3"], "--template llama3: the tokenizer has another chat template"),
        (["--val_size", "100"], "--val_size 100: give a fraction"),
        (["--datasets", "a"], "--datasets (TRL's mixture) is not read"),
    ],
)
def test_refused_trl_and_llama_factory_flags_fail_in_one_line_naming_them(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    base = ["--model_name_or_path", "tiny-llama"] + ([] if "--datasets" in flags else ["--dataset", "addition"])
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *base, *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "1 problem(s)" in err, err


def test_loss_switches_that_disagree_are_refused() -> None:
    problems = _problems("--dataset", "addition", "--completion_only_loss", "True", "--assistant_only_loss", "False")
    assert problems == [
        "--completion_only_loss True and --assistant_only_loss False: gym_lightning has one switch for both "
        "(data.mask_prompt); make them agree."
    ]


def test_config_file_with_overriding_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gym train --config sft.yaml --flag ...`` (TRL's parser): the file's keys under any flag name, flags win."""
    data = _jsonl(tmp_path / "data.jsonl", [{"text": "1 plus 1 is 2"}])
    config = {
        "model_name_or_path": "tiny-llama",
        "dataset_name": str(data),
        "max_length": 64,  # TRL's name
        "use_peft": True,
        "lora_r": 16,
        "learning_rate": "2e-4",  # YAML 1.1 reads this as text; argparse converts it as a flag value
        "bf16": True,
        "load_in_4bit": True,
        "bnb_4bit_quant_storage": "bfloat16",
        "env": {"GYM_TEST_FROM_CONFIG": "1"},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.delenv("GYM_TEST_FROM_CONFIG", raising=False)
    args = to_cli_args(parse_train_args(["--config", str(tmp_path / "sft.yaml"), "--learning_rate", "1e-3"]), env={})
    values = dict(arg[2:].split("=", 1) for arg in args[1:])
    assert values["model.lr"] == "0.001" and values["data.max_seq_length"] == "64"  # the flag wins, the file stays
    assert json.loads(values["model.lora"]) == {"r": 16} and values["trainer.precision"] == "bf16-mixed"
    assert json.loads(values["model.quantization"])["quant_storage"] == "bfloat16"
    assert os.environ["GYM_TEST_FROM_CONFIG"] == "1"
    as_first = to_cli_args(parse_train_args([str(tmp_path / "sft.yaml"), "--learning_rate", "1e-3"]), env={})
    assert as_first == args
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config | {"max_lenght": 3, "cutoff_len": 8, "use_dora": True}))
    with pytest.raises(GymUserError) as info:
        to_cli_args(parse_train_args(["--config", str(tmp_path / "bad.yaml")]), env={})
    lines = str(info.value).splitlines()
    assert lines[0] == "Invalid gym train flags (3 problem(s)):"
    assert "max_lenght is not a gym train flag; did you mean max_length?" in lines[1]
    assert "cutoff_len and max_length both set max_seq_length" in lines[2]
    assert "--use_dora True is not supported" in lines[3]


def llama_factory_sft(model: Path, dataset: str) -> str:
    """LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml (quoted in launch_lines.py) with the model and
    dataset changed and its commented-out eval block switched on, as YAML text."""
    config = yaml.safe_load(LLAMA_FACTORY_LORA_SFT) | {"model_name_or_path": str(model), "dataset": dataset}
    config |= {"val_size": 0.1, "per_device_eval_batch_size": 1, "eval_strategy": "steps", "eval_steps": 500}
    return yaml.safe_dump(config, sort_keys=False)


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder with a Llama-3-style chat template (the shipped tokenizer's vocabulary)."""
    from gym_lightning.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
        "<|eot_id|>{% endfor %}"
    )
    folder = tmp_path_factory.mktemp("llama3-tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def test_llama_factory_lora_sft_yaml_maps(tmp_path: Path, llama3_tokenizer: Path) -> None:
    """LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml with the model and data paths changed."""
    first = _jsonl(tmp_path / "identity.jsonl", [{"instruction": "who", "output": "me"}])
    second = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "1+1", "input": "", "output": "2"}])
    config = tmp_path / "llama3_lora_sft.yaml"
    config.write_text(llama_factory_sft(llama3_tokenizer, f"{first},{second}"))
    args = parse_train_args([str(config)])
    values = dict(arg[2:].split("=", 1) for arg in to_cli_args(args, env={})[1:])
    assert json.loads(values["model.lora"]) == {"r": 8, "alpha": 16, "target_modules": ["all-linear"]}
    assert json.loads(values["data.sources"]) == [
        {"path": str(first), "max_samples": 1000},
        {"path": str(second), "max_samples": 1000},
    ]
    expected = {
        "model.gradient_checkpointing": "true",  # LLaMA-Factory's default
        "model.trust_remote_code": "true",
        "data.max_seq_length": "2048",
        "data.num_proc": "16",
        "data.num_workers": "4",
        "data.val_split": "0.1",
        "data.eval_batch_size": "1",
        "trainer.val_check_interval": "4000",  # 500 optimizer steps x 8 micro-batches
        "trainer.precision": "bf16-mixed",
        "trainer.max_epochs": "3",
        "model.warmup_ratio": "0.1",
    }
    assert {key: values[key] for key in expected} == expected
    assert json.loads(values["trainer.strategy"])["init_args"]["timeout"] == "2083 days, 8:00:00"
    from gym_lightning.commands.train import flag_notes

    # LLaMA-Factory's mix_strategy (default concat): each set once, one after the other, as there.
    assert values["data.mix"] == "concat"
    notes = flag_notes(args)
    assert len(notes) == 1 and "tokenizer's own chat template" in notes[0]


def test_llama_factory_qlora_and_dataset_info(tmp_path: Path, llama3_tokenizer: Path) -> None:
    """The QLoRA example's quantization_bit/quantization_method, and dataset names from dataset_info.json (formats,
    columns, a folder)."""
    _jsonl(tmp_path / "data" / "qa.jsonl", [{"q": "1+1", "a": "2"}])
    _jsonl(tmp_path / "data" / "chats" / "part-0.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}])
    info = {
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "q", "response": "a"}},
        "chats": {"file_name": "chats", "formatting": "sharegpt"},
        "pairs": {"file_name": "qa.jsonl", "ranking": True},
    }
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(info))
    text = llama_factory_sft(llama3_tokenizer, "qa,chats")
    text += f"quantization_bit: 4\nquantization_method: bitsandbytes\ndataset_dir: {tmp_path / 'data'}\n"
    (tmp_path / "qlora.yaml").write_text(text)
    values = dict(arg[2:].split("=", 1) for arg in to_cli_args(parse_train_args([str(tmp_path / "qlora.yaml")]))[1:])
    assert json.loads(values["model.quantization"]) == {"double_quant": True}  # LLaMA-Factory's default
    assert json.loads(values["data.sources"]) == [
        {
            "path": str(tmp_path / "data" / "qa.jsonl"),
            "format": "alpaca",
            "columns": {"instruction": "q", "output": "a"},
            "max_samples": 1000,
        },
        {"path": [str(tmp_path / "data" / "chats" / "part-0.jsonl")], "format": "sharegpt", "max_samples": 1000},
    ]
    (tmp_path / "pairs.yaml").write_text(text.replace("qa,chats", "pairs"))
    with pytest.raises(GymUserError, match=r"pairs: preference data \(ranking: true\): train it with --stage dpo"):
        to_cli_args(parse_train_args([str(tmp_path / "pairs.yaml")]))
    (tmp_path / "pt.yaml").write_text(text.replace("stage: sft", "stage: pt"))
    with pytest.raises(GymUserError, match=r"qa: .*raw text is one column here"):  # stage pt reads raw text
        to_cli_args(parse_train_args([str(tmp_path / "pt.yaml")]))


def test_llama_factory_dataset_paths_and_the_bundled_set() -> None:
    assert _cli_args()["data.dataset"] == "addition"  # the bundled set keeps its meaning
    problems = _problems("--dataset", "alpaca_en_demo")
    assert problems == [
        "--dataset alpaca_en_demo: not a bundled data set (addition, addition_preference), a data file or folder, or a "
        "name in data/dataset_info.json; give the data file's path (or set --dataset_dir)."
    ]


def test_other_llama_factory_keys_are_accepted_at_their_default_and_refused_otherwise(tmp_path: Path) -> None:
    config = {"model_name_or_path": "tiny-llama", "dataset": "addition", "use_fast_tokenizer": True}
    config |= {"infer_backend": "vllm", "freeze_trainable_layers": 4, "disable_shuffling": True}
    (tmp_path / "lf.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(GymUserError) as info:
        to_cli_args(parse_train_args([str(tmp_path / "lf.yaml")]), env={})
    assert str(info.value).splitlines()[1:] == [
        f"  - {tmp_path / 'lf.yaml'}: disable_shuffling True is not supported: the training data is shuffled every "
        "epoch; leave it at False."
    ]


def test_trl_eos_and_pad_tokens_replace_the_tokenizers_own() -> None:
    values = _cli_args("--eos_token", "<|im_end|>", "--pad_token", "<|im_start|>")
    assert json.loads(values["model.special_tokens"]) == {"eos_token": "<|im_end|>", "pad_token": "<|im_start|>"}
    assert json.loads(_cli_args()["model.special_tokens"]) is None


def test_the_flags_of_pefts_fsdp_qlora_script_map() -> None:
    """HF's FSDP + QLoRA guide runs PEFT's examples/sft/train.py, whose flags differ from TRL's."""
    flags = [
        "--use_peft_lora", "True", "--use_4bit_quantization", "True", "--use_nested_quant", "True",
        "--bnb_4bit_compute_dtype", "bfloat16", "--bnb_4bit_quant_storage_dtype", "bfloat16", "--max_seq_len", "256",
        "--splits", "train,test", "--chat_template_format", "chatml", "--add_special_tokens", "False",
        "--append_concat_token", "False", "--use_reentrant", "True",
    ]  # fmt: skip
    args = parse_train_args([*BASE, *flags])
    assert (args.use_lora, args.load_in_4bit, args.bnb_4bit_use_double_quant) == (True, True, True)
    assert args.bnb_4bit_quant_storage == "bfloat16" and args.max_seq_length == 256
    assert (args.dataset_train_split, args.dataset_test_split) == ("train", "test")
    values = _cli_args(*flags)
    assert json.loads(values["model.quantization"])["double_quant"] is True
    assert any("--chat_template_format chatml" in note for note in flag_notes(args))
    with pytest.raises(GymUserError, match="--add_special_tokens True is not supported"):
        to_cli_args(parse_train_args([*BASE, "--add_special_tokens", "True"]), env={})
