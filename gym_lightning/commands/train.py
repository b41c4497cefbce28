"""``gym train``: Hugging Face Trainer flags mapped onto the LightningCLI configuration of ``gym fit``.

    gym train --model_name_or_path Qwen/Qwen3-0.6B --deepspeed configs/deepspeed/ds_zero3.json \\
        --train_file data.jsonl --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --bf16

Nothing here trains: the flags become dotted LightningCLI arguments (``--trainer.max_steps=...``) and run through
``gym_lightning.cli.run_lightning_cli``, the code path of ``python -m gym_lightning fit``. ``--print_config``
prints that run as YAML; ``python -m gym_lightning fit --config that.yaml`` repeats it.

Mapping decisions (where Lightning and the HF Trainer differ):

- ``--output_dir``: ``trainer.default_root_dir`` (logs, ``checkpoints/``); the final model is exported as a
  Hugging Face folder to ``<output_dir>/hf`` (``export.output_dir``) — HF writes it to ``output_dir`` itself.
- ``--save_steps N``: a ``ModelCheckpoint(every_n_train_steps=N)`` in ``<output_dir>/checkpoints`` keeping the
  last ``--save_total_limit`` (all by default, as HF). ``--save_strategy no`` turns checkpointing off.
- ``--eval_steps N``: validation every N optimizer steps (Lightning counts micro-batches, so
  ``val_check_interval = N x accumulation``); ``--eval_strategy`` defaults to ``steps`` when ``--eval_steps`` is
  given, else ``no`` (as HF).
- ``--bf16``/``--fp16``: ``bf16-mixed``/``16-mixed`` (HF's flags select mixed precision with fp32 weights).
- ``--max_steps > 0`` overrides ``--num_train_epochs`` (as HF); whole epochs only otherwise.
- ``--lr_scheduler_type constant`` ignores warm-up (as HF); ``constant_with_warmup`` keeps it.
- ``--deepspeed ds.json``: ``trainer.strategy = ZeROStrategy(config=ds.json)`` (stage from the JSON, ``"auto"``
  resolved from these flags). ``--gradient_accumulation_steps`` and ``--max_grad_norm`` left unset take the JSON's
  explicit numbers (they are one setting each, see ``strategies/hf_deepspeed_config.py``); else 1 and 1.0.
- Errors from the run name ``gym fit`` settings; ``gym train`` adds the flag that sets each one
  (``trainer.accumulate_grad_batches (gym train: --gradient_accumulation_steps)``, ``SETTING_FLAGS``).
- Several processes: ``--devices N`` (and ``--num_nodes``) let Lightning start the ranks; under ``torchrun`` give
  ``--devices`` equal to ``--nproc_per_node``, Lightning then joins the launched processes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from gym_lightning.commands import CommandParser
from gym_lightning.errors import GymUserError
from gym_lightning.strategies.hf_deepspeed_config import adopted_value, load_deepspeed_json

SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
EVAL_STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch")
# --report_to -> Lightning logger class (None: no logger), written under <output_dir>/logs.
LOGGERS = {
    "none": None,
    "csv": "lightning.pytorch.loggers.CSVLogger",
    "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
    "wandb": "lightning.pytorch.loggers.WandbLogger",
}
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
# The `gym fit` settings that errors name -> the flags that set them here (see flags_for_settings).
SETTING_FLAGS: dict[str, str] = {
    "data.batch_size": "--per_device_train_batch_size",
    "trainer.accumulate_grad_batches": "--gradient_accumulation_steps",
    "trainer.gradient_clip_val": "--max_grad_norm",
    "trainer.precision": "--bf16/--fp16",
    "trainer.max_steps": "--max_steps",
    "trainer.max_epochs": "--num_train_epochs",
    "trainer.devices": "--devices",
    "trainer.num_nodes": "--num_nodes",
    "model.lr": "--learning_rate",
    "model.betas": "--adam_beta1/--adam_beta2",
    "model.eps": "--adam_epsilon",
    "model.weight_decay": "--weight_decay",
    "model.warmup_steps": "--warmup_steps",
    "model.warmup_ratio": "--warmup_ratio",
}
_SETTING_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in SETTING_FLAGS) + r")(?![\w.])")


class TrainArgumentParser(CommandParser):
    """``CommandParser`` that suggests the closest valid flag for a misspelt one."""

    def parse_args(self, args: list[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
        if flags:
            self.error(f"unrecognized argument {flags[0]}{_suggestion(flags[0], self.valid_flags())}")
        if unknown:
            self.error(f"unexpected value {unknown[0]!r} (every value follows its flag, e.g. --max_steps 10)")
        return parsed

    def valid_flags(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]


def _suggestion(flag: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(flag, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""


def build_parser() -> TrainArgumentParser:
    """The ``gym train`` flags (names and defaults of the Hugging Face Trainer unless noted)."""
    parser = TrainArgumentParser(
        prog="gym train",
        description="Finetune a causal LM with Hugging Face Trainer flags (runs `gym fit` underneath).",
        allow_abbrev=False,
    )
    _add_model_flags(parser.add_argument_group("model"))
    _add_data_flags(parser.add_argument_group("data"))
    _add_optim_flags(parser.add_argument_group("optimisation"))
    _add_run_flags(parser.add_argument_group("run, logging and checkpoints"))
    _add_lora_flags(parser.add_argument_group("LoRA"))
    _add_hardware_flags(parser.add_argument_group("hardware and parallelism"))
    parser.add_argument("--print_config", action="store_true", help="Print the equivalent `gym fit` YAML and exit.")
    return parser


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model_name_or_path", required=True, help="Preset (tiny-llama, tiny-qwen3), folder or hub name."
    )
    group.add_argument("--tokenizer_name", help="Tokenizer folder or hub name (default: the model's).")
    group.add_argument("--torch_dtype", choices=("auto", "float32", "bfloat16", "float16"), help="Parameter dtype.")
    group.add_argument("--attn_implementation", choices=("eager", "sdpa", "flash_attention_2", "flex_attention"))
    group.add_argument("--trust_remote_code", action="store_true", help="Run code from the model repository.")
    group.add_argument("--gradient_checkpointing", action="store_true", help="Recompute activations in backward.")


def _add_data_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dataset", help="A bundled data set (e.g. addition) instead of --train_file.")
    group.add_argument("--train_file", nargs="+", help="Training .jsonl/.json/.txt files or glob patterns.")
    group.add_argument("--validation_file", nargs="+", help="Validation files or glob patterns.")
    group.add_argument(
        "--validation_split_percentage", type=int, default=0, help="Percent of --train_file held out (no val file)."
    )
    group.add_argument(
        "--data_format",
        default="auto",
        choices=("auto", "text", "alpaca", "chat", "prompt_completion"),
        help="Record format (auto detects it from the fields).",
    )
    group.add_argument(
        "--max_seq_length", "--model_max_length", "--cutoff_len", type=int, default=512, help="Tokens per sample."
    )
    group.add_argument("--packing", action="store_true", help="Pack training samples into full-length rows.")
    group.add_argument("--train_on_prompt", action="store_true", help="Also train on prompt tokens.")
    group.add_argument("--dataloader_num_workers", type=int, default=0, help="DataLoader worker processes.")


def _add_optim_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--per_device_train_batch_size", type=int, default=8, help="Training micro-batch per device.")
    group.add_argument("--per_device_eval_batch_size", type=int, default=8, help="Evaluation batch per device.")
    group.add_argument(
        "--gradient_accumulation_steps", type=int, help="Micro-batches per optimizer step (default: JSON's, else 1)."
    )
    group.add_argument("--learning_rate", type=float, default=5e-5, help="Peak AdamW learning rate.")
    group.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay (matrices only).")
    group.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW beta1.")
    group.add_argument("--adam_beta2", type=float, default=0.999, help="AdamW beta2.")
    group.add_argument("--adam_epsilon", type=float, default=1e-8, help="AdamW epsilon.")
    group.add_argument(
        "--max_grad_norm", type=float, help="Gradient clipping norm, 0 = off (default: JSON's, else 1.0)."
    )
    group.add_argument("--lr_scheduler_type", default="linear", choices=tuple(SCHEDULERS), help="LR schedule.")
    group.add_argument("--warmup_steps", type=int, default=0, help="Linear warm-up steps (wins over the ratio).")
    group.add_argument("--warmup_ratio", type=float, default=0.0, help="Warm-up as a fraction of all steps.")
    group.add_argument("--num_train_epochs", type=float, default=3.0, help="Epochs (whole numbers).")
    group.add_argument("--max_steps", type=int, default=-1, help="Optimizer steps; > 0 overrides --num_train_epochs.")


def _add_run_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--output_dir", default="trainer_output", help="Logs/checkpoints; HF folder in <dir>/hf.")
    group.add_argument("--seed", type=int, default=42, help="Seed of everything (init, shuffling, dropout).")
    group.add_argument("--logging_steps", type=int, default=500, help="Log every N optimizer steps.")
    group.add_argument(
        "--report_to", choices=tuple(LOGGERS), help="Logger (default: Lightning's, TensorBoard if installed, else CSV)."
    )
    group.add_argument("--eval_strategy", "--evaluation_strategy", choices=EVAL_STRATEGIES, help="When to validate.")
    group.add_argument("--eval_steps", type=int, help="Validate every N optimizer steps (eval_strategy steps).")
    group.add_argument("--save_strategy", default="steps", choices=SAVE_STRATEGIES, help="When to checkpoint.")
    group.add_argument("--save_steps", type=int, default=500, help="Checkpoint every N optimizer steps.")
    group.add_argument("--save_total_limit", type=int, help="Keep only the last N checkpoints (default: all).")
    group.add_argument("--resume_from_checkpoint", help="Lightning .ckpt file (or DeepSpeed checkpoint folder).")
    group.add_argument("--do_train", action="store_true", help="Accepted for HF scripts; training always runs.")
    group.add_argument("--do_eval", action="store_true", help="Validate each epoch unless --eval_strategy says else.")
    group.add_argument("--overwrite_output_dir", action="store_true", help="Accepted for HF scripts (no effect).")


def _add_lora_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--use_lora", "--use_peft", action="store_true", help="Train LoRA adapters only.")
    group.add_argument("--lora_r", type=int, help="LoRA rank (default 8).")
    group.add_argument("--lora_alpha", type=int, help="LoRA alpha (default 16).")
    group.add_argument("--lora_dropout", type=float, help="LoRA dropout (default 0).")
    group.add_argument("--lora_target_modules", nargs="+", help="Layers to adapt, e.g. q_proj v_proj, or all-linear.")


def _add_hardware_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--bf16", action="store_true", help="bf16 mixed precision (trainer.precision=bf16-mixed).")
    group.add_argument("--fp16", action="store_true", help="fp16 mixed precision (16-mixed, CUDA only).")
    group.add_argument("--deepspeed", help="DeepSpeed JSON (HF style, 'auto' allowed): ZeRO stage from the file.")
    group.add_argument("--strategy", help="A Lightning strategy name instead of --deepspeed (e.g. gym_ddp, zero2).")
    group.add_argument("--devices", default="auto", help="Devices per node: a number, a list or auto.")
    group.add_argument("--num_nodes", type=int, default=1, help="Number of nodes.")
    group.add_argument("--accelerator", default="auto", help="cpu, gpu, cuda, auto.")


# ------------------------------------------------------------------------------------------------------ mapping
def flag_problems(args: argparse.Namespace) -> list[str]:
    """Every combination of flags that cannot run, each with its fix."""
    problems = []
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 exclude each other; pick one.")
    if args.deepspeed and args.strategy:
        problems.append("--deepspeed and --strategy both choose the strategy; pass one.")
    if args.dataset and args.train_file:
        problems.append("--dataset and --train_file both choose the training data; pass one.")
    if not args.dataset and not args.train_file:
        problems.append("no training data: pass --train_file data.jsonl (or --dataset addition).")
    if args.max_steps <= 0 and args.num_train_epochs != int(args.num_train_epochs):
        problems.append(f"--num_train_epochs {args.num_train_epochs}: whole epochs only; use --max_steps instead.")
    given_lora = [f"--{name}" for name in LORA_FLAGS if getattr(args, name) is not None]
    if given_lora and not args.use_lora:
        problems.append(f"{', '.join(given_lora)} need --use_lora.")
    if args.eval_steps is not None and args.eval_strategy not in (None, "steps"):
        problems.append(f"--eval_steps needs --eval_strategy steps, got {args.eval_strategy}.")
    return problems


def to_cli_args(args: argparse.Namespace) -> list[str]:
    """The ``gym fit`` (LightningCLI) arguments equivalent to the parsed ``gym train`` flags."""
    problems = flag_problems(args)
    if problems:
        raise GymUserError("Invalid gym train flags: " + " ".join(problems))
    ds_config = load_deepspeed_json(args.deepspeed) if args.deepspeed else {}
    accumulation = adopted_value(ds_config.get("gradient_accumulation_steps"), args.gradient_accumulation_steps) or 1
    clip = adopted_value(ds_config.get("gradient_clipping"), args.max_grad_norm)
    values: dict[str, Any] = {"seed_everything": args.seed}
    values |= _trainer_values(args, accumulation, 1.0 if clip is None else clip)
    values |= _model_values(args)
    values |= _data_values(args)
    cli_args = ["fit", *(f"--{key}={_format(value)}" for key, value in values.items())]
    if args.resume_from_checkpoint:
        cli_args.append(f"--ckpt_path={args.resume_from_checkpoint}")
    return cli_args


def _trainer_values(args: argparse.Namespace, accumulation: int, clip: float) -> dict[str, Any]:
    values: dict[str, Any] = {
        "trainer.accelerator": args.accelerator,
        "trainer.devices": _devices(args.devices),
        "trainer.num_nodes": args.num_nodes,
        "trainer.precision": "bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else "32-true",
        "trainer.accumulate_grad_batches": accumulation,
        "trainer.gradient_clip_val": clip,
        "trainer.log_every_n_steps": args.logging_steps,
        "trainer.default_root_dir": args.output_dir,
    }
    if args.deepspeed:
        init_args = {"config": str(args.deepspeed)}
        values["trainer.strategy"] = {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": init_args}
    elif args.strategy:
        values["trainer.strategy"] = args.strategy
    if args.report_to is not None:
        values["trainer.logger"] = _logger(args.report_to, args.output_dir)
    if args.max_steps > 0:
        values |= {"trainer.max_steps": args.max_steps, "trainer.max_epochs": -1}
    else:
        values |= {"trainer.max_epochs": int(args.num_train_epochs)}
    return values | _eval_values(args, accumulation) | _checkpoint_values(args)


def _eval_values(args: argparse.Namespace, accumulation: int) -> dict[str, Any]:
    strategy = args.eval_strategy or ("steps" if args.eval_steps else "epoch" if args.do_eval else "no")
    if strategy == "no":
        return {"trainer.limit_val_batches": 0, "trainer.num_sanity_val_steps": 0}
    if strategy == "epoch":
        return {"trainer.check_val_every_n_epoch": 1, "trainer.val_check_interval": None}
    # Lightning's interval counts micro-batches; HF's eval_steps counts optimizer steps (default: logging_steps).
    steps = args.eval_steps or args.logging_steps
    return {"trainer.check_val_every_n_epoch": None, "trainer.val_check_interval": steps * accumulation}


def _logger(report_to: str, output_dir: str) -> dict[str, Any] | bool:
    class_path = LOGGERS[report_to]
    if class_path is None:
        return False
    init_args = {"save_dir": output_dir} | ({"name": "logs"} if report_to != "wandb" else {})
    return {"class_path": class_path, "init_args": init_args}


def _checkpoint_values(args: argparse.Namespace) -> dict[str, Any]:
    if args.save_strategy == "no":
        return {"trainer.enable_checkpointing": False}
    every = {"every_n_train_steps": args.save_steps} if args.save_strategy == "steps" else {"every_n_epochs": 1}
    init_args = {
        "dirpath": str(Path(args.output_dir) / "checkpoints"),
        "save_top_k": -1 if args.save_total_limit is None else args.save_total_limit,
        "monitor": "step" if args.save_total_limit is not None else None,
        "mode": "max",
        **every,
    }
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": init_args}
    return {"trainer.enable_checkpointing": True, "trainer.callbacks": [checkpoint]}


def _model_values(args: argparse.Namespace) -> dict[str, Any]:
    # HF's "constant" schedule has no warm-up; "constant_with_warmup" is the module's "constant".
    no_warmup = args.lr_scheduler_type == "constant"
    values: dict[str, Any] = {
        "model.model": args.model_name_or_path,
        "model.tokenizer": args.tokenizer_name,
        "model.torch_dtype": args.torch_dtype,
        "model.attn_implementation": args.attn_implementation,
        "model.trust_remote_code": args.trust_remote_code,
        "model.gradient_checkpointing": args.gradient_checkpointing,
        "model.lr": args.learning_rate,
        "model.weight_decay": args.weight_decay,
        "model.betas": [args.adam_beta1, args.adam_beta2],
        "model.eps": args.adam_epsilon,
        "model.scheduler": SCHEDULERS[args.lr_scheduler_type],
        "model.warmup_steps": 0 if no_warmup else args.warmup_steps,
        "model.warmup_ratio": 0.0 if no_warmup else args.warmup_ratio,
        "export.output_dir": str(Path(args.output_dir) / "hf"),
    }
    if args.use_lora:
        lora = {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout}
        lora["target_modules"] = args.lora_target_modules
        values["model.lora"] = {key: value for key, value in lora.items() if value is not None}
    return values


def _data_values(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "data.dataset": args.dataset,
        "data.train_files": args.train_file,
        "data.val_files": args.validation_file,
        "data.val_split": args.validation_split_percentage / 100,
        "data.format": args.data_format,
        "data.max_seq_length": args.max_seq_length,
        "data.packing": args.packing,
        "data.mask_prompt": not args.train_on_prompt,
        "data.batch_size": args.per_device_train_batch_size,
        "data.eval_batch_size": args.per_device_eval_batch_size,
        "data.num_workers": args.dataloader_num_workers,
        "data.seed": args.seed,
    }


def _devices(devices: str) -> int | str | list[int]:
    text = str(devices).strip()
    if text.isdigit() or (text.startswith("-") and text[1:].isdigit()):
        return int(text)
    if "," in text or text.startswith("["):
        return [int(part) for part in text.strip("[]").split(",") if part.strip()]
    return text


def _format(value: Any) -> str:
    """A value as jsonargparse reads it: JSON for containers/None/bools, plain text otherwise."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def flags_for_settings(message: str) -> str:
    """``message`` with ``(gym train: --flag)`` after the first mention, per line, of each setting a flag sets.

    Errors from below (the strategy, the module) name ``gym fit`` settings; a ``gym train`` user knows the flags.
    """
    return "\n".join(_flags_for_settings_in_line(line) for line in message.split("\n"))


def _flags_for_settings_in_line(line: str) -> str:
    seen: set[str] = set()

    def annotate(match: re.Match[str]) -> str:
        setting = match.group(1)
        if setting in seen:  # once per line: a conflict names its setting twice (the value and the fix)
            return setting
        seen.add(setting)
        return f"{setting} (gym train: {SETTING_FLAGS[setting]})"

    return _SETTING_PATTERN.sub(annotate, line)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``gym train``."""
    from gym_lightning.cli import run_lightning_cli

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cli_args = to_cli_args(args)
    if args.print_config:
        cli_args.insert(1, "--print_config")
    with warnings.catch_warnings():
        # LightningCLI warns when it gets args while sys.argv holds others; here the args ARE the translated argv
        # (sys.argv must stay as it is: Lightning re-runs it to start the other ranks).
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        try:
            run_lightning_cli(cli_args)
        except GymUserError as err:
            raise GymUserError(flags_for_settings(str(err))) from err


__all__ = [
    "SETTING_FLAGS",
    "TrainArgumentParser",
    "build_parser",
    "flag_problems",
    "flags_for_settings",
    "main",
    "to_cli_args",
]
