"""``gym train``: Hugging Face Trainer flags mapped onto the LightningCLI configuration of ``gym fit``.

    gym train --model_name_or_path Qwen/Qwen3-0.6B --deepspeed configs/deepspeed/ds_zero3.json \\
        --train_file data.jsonl --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --bf16 True
    torchrun --nproc_per_node 2 -m gym_lightning train ...   # (or deepspeed, accelerate launch, srun) no --devices
    gym train run.yaml                                        # every flag from one YAML or JSON file, as HF scripts

Nothing here trains: the flags are parsed by ``transformers.HfArgumentParser`` over ``TrainingArguments`` (every
field, with HF's types and defaults) and this module's ``ModelArguments``/``DataArguments``/``GymArguments``, then
become dotted LightningCLI arguments (``--trainer.max_steps=...``) run through ``gym_lightning.cli.run_lightning_cli``,
the code path of ``python -m gym_lightning fit``. ``--print_config`` prints that run as YAML;
``python -m gym_lightning fit --config that.yaml`` repeats it. ``TrainingArguments.__post_init__`` is not run: it
initialises accelerate's ``PartialState`` (a process group under ``torchrun``) and DeepSpeed, which Lightning owns.

A ``TrainingArguments`` field that is not mapped is accepted at its default and refused, in one line naming the flag
and why, when set to anything else (``refused_flags``).

Mapping decisions (where Lightning and the HF Trainer differ):

- ``--output_dir``: ``trainer.default_root_dir`` (logs, ``checkpoints/``); the final model is exported as a
  Hugging Face folder to ``<output_dir>/hf`` (``export.output_dir``) — HF writes it to ``output_dir`` itself.
  ``<output_dir>/trainer_state.json`` holds HF's ``log_history`` (loss, learning_rate, epoch, step per optimizer
  step; eval_loss per validation) and ``<output_dir>/curves.png`` the loss/lr curves (``TrainerStateCallback``).
- ``--save_steps N``: ``gym_lightning.checkpointing.StepCheckpoint(every_n_steps=N)`` in ``<output_dir>/checkpoints``
  keeping the last ``--save_total_limit`` (all by default, as HF), ``last.ckpt`` linked; ``--save_strategy no``
  turns checkpointing off. ``--resume_from_checkpoint True`` resumes from that ``last.ckpt`` (HF: the newest
  checkpoint in output_dir), a path resumes from the path.
- ``--logging_steps``/``--eval_steps``/``--save_steps`` below 1 are ratios of ``--max_steps`` (rounded up, as HF),
  and ``--warmup_steps`` below 1 is a ratio of the total steps (``--warmup_ratio`` of transformers < 5 also works).
- ``--eval_steps N``: validation every N optimizer steps (Lightning counts micro-batches, so
  ``val_check_interval = N x accumulation``); ``--eval_strategy`` defaults to ``steps`` when ``--eval_steps`` is
  given, else ``no`` (as HF).
- ``--bf16``/``--fp16``: ``bf16-mixed``/``16-mixed`` (HF's flags select mixed precision with fp32 weights);
  ``--tf32`` sets torch's TF32 switches in each rank's process (``apply_tf32``), as HF does.
- ``--max_steps > 0`` overrides ``--num_train_epochs`` (as HF). A fraction of an epoch (``1.5``) trains
  ``ceil(1.5 x steps per epoch)`` optimizer steps, as HF: ``trainer.max_epochs = 2`` and an ``EpochFraction``
  callback that sets the step count once the DataLoader exists, before the optimizer and schedule are built.
- ``--optim``: ``model.optim``, built as the HF Trainer builds it (``optim.build_optimizer``: ``adamw_torch``,
  ``adamw_torch_fused`` (HF's default), ``sgd``, ``adagrad``, ``rmsprop``, ``adafactor``); the others need packages
  or devices not used here and are refused.
- ``--weight_decay``: on the HF Trainer's parameters (``model.decay_rule: hf``: not biases, LayerNorm/norm weights).
- ``--lr_scheduler_type``/``--lr_scheduler_kwargs``: ``model.hf_scheduler``/``model.scheduler_kwargs``, built by
  ``transformers.get_scheduler`` (HF's numbers, warm-up included); ``reduce_lr_on_plateau``/``greedy`` are refused.
- ``--report_to``: one or more of ``csv``, ``tensorboard``, ``wandb``, ``mlflow`` (``all``: those installed), written
  under ``<output_dir>/logs``; ``--run_name`` names the run. ``none`` (HF's default: no external service) keeps
  ``gym fit``'s local CSV + TensorBoard logs, which ``trainer_state.json`` and ``curves.png`` do not need.
- ``--ddp_timeout SECONDS`` (HF's default 1800 is Lightning's too): the strategy's collective ``timeout``; a rank
  that does not arrive within it is named and the job ends (``strategies.rank_failure``). Without ``--strategy`` or
  ``--deepspeed`` it selects ``gym_ddp`` (the strategy Lightning's ``auto`` would pick is plain DDP).
- ``--deepspeed ds.json``: ``trainer.strategy = ZeROStrategy(config=ds.json)`` (stage from the JSON, ``"auto"``
  resolved from these flags). ``--gradient_accumulation_steps`` and ``--max_grad_norm`` left at HF's defaults take
  the JSON's explicit numbers (they are one setting each, see ``strategies/zero/hf_auto.py``).
- Errors from the run name ``gym fit`` settings; ``gym train`` adds the flag that sets each one
  (``trainer.accumulate_grad_batches (gym train: --gradient_accumulation_steps)``, ``SETTING_FLAGS``).
- Several processes: under ``torchrun``/``python -m torch.distributed.run``, ``accelerate launch`` (both set
  ``LOCAL_WORLD_SIZE``), the ``deepspeed`` launcher (``LOCAL_SIZE``, and ``--local_rank`` is accepted) and ``srun``
  (``SLURM_STEP_*``), ``--devices``/``--num_nodes`` come from the environment (``launcher_topology``; the deepspeed
  launcher's ``CROSS_RANK`` becomes Lightning's ``NODE_RANK``); without a launcher ``--devices N`` lets Lightning
  start the ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, get_args

from transformers import HfArgumentParser, TrainingArguments

from gym_lightning.errors import GymUserError, raise_if_problems
from gym_lightning.optim import HFSchedulerName, OptimizerName
from gym_lightning.strategies.zero.config import load_deepspeed_json
from gym_lightning.strategies.zero.hf_auto import adopted_value

# The HF schedules and optimizers the module builds (transformers.get_scheduler; optim.build_optimizer).
SCHEDULERS: tuple[str, ...] = get_args(HFSchedulerName)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
# --report_to -> (Lightning logger class, the package it needs).
LOGGERS = {
    "csv": ("lightning.pytorch.loggers.CSVLogger", None),
    "tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", "tensorboard"),
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
}
HF_DDP_TIMEOUT = 1800  # seconds, TrainingArguments' default: Lightning's default collective timeout too
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
QUANT_FLAGS = ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage")
# TrainingArguments fields mapped below (or without effect here, e.g. local_rank: the launcher's rank, which
# Lightning reads from the environment). Every other field is refused unless at its default (refused_flags).
MAPPED_FIELDS = frozenset(
    [
        "output_dir",
        "per_device_train_batch_size",
        "num_train_epochs",
        "max_steps",
        "learning_rate",
        "lr_scheduler_type",
        "warmup_steps",
        "tf32",
        "optim",
        "lr_scheduler_kwargs",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "bf16",
        "fp16",
        "gradient_checkpointing",
        "logging_steps",
        "report_to",
        "run_name",
        "eval_strategy",
        "eval_steps",
        "per_device_eval_batch_size",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "seed",
        "data_seed",
        "use_cpu",
        "dataloader_num_workers",
        "disable_tqdm",
        "do_train",
        "do_eval",
        "do_predict",
        "resume_from_checkpoint",
        "local_rank",
        "deepspeed",
        "ddp_timeout",
        "log_level",
        "log_level_replica",
    ]
)
# Why a field is refused, where there is more to say than that gym train has no equivalent.
REFUSAL_REASONS = {
    "push_to_hub": "gym train does not upload; upload <output_dir>/hf with `huggingface-cli upload`",
    "fsdp": "use --strategy fsdp (Lightning's FSDP) instead",
    "fsdp_config": "use --strategy fsdp (Lightning's FSDP) instead",
    "torch_compile": "torch.compile is not wired into gym train",
    "optim_args": "the optimizers take --learning_rate, --weight_decay and (AdamW) --adam_beta1/2, --adam_epsilon",
    "average_tokens_across_devices": "gym_lightning always normalises the loss by the tokens of the whole step",
    "load_best_model_at_end": "the final model is the last one; pick a checkpoint from <output_dir>/checkpoints",
}
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
    "model.warmup_ratio": "--warmup_steps",
    "model.optim": "--optim",
    "model.hf_scheduler": "--lr_scheduler_type",
    "model.scheduler_kwargs": "--lr_scheduler_kwargs",
}
_SETTING_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in SETTING_FLAGS) + r")(?![\w.])")


# ---------------------------------------------------------------------------------------------------- arguments
@dataclass
class ModelArguments:
    """The model flags of HF's ``run_clm.py`` (plus LoRA, as TRL's ``ModelConfig``)."""

    model_name_or_path: str = field(metadata={"help": "Preset (tiny-llama, tiny-qwen3), folder or hub name."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    torch_dtype: str | None = field(
        default=None, metadata={"help": "Parameter dtype.", "choices": ["auto", "float32", "bfloat16", "float16"]}
    )
    attn_implementation: str | None = field(
        default=None, metadata={"choices": ["eager", "sdpa", "flash_attention_2", "flex_attention"]}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code from the model repository."})
    use_lora: bool = field(default=False, metadata={"aliases": ["--use_peft"], "help": "Train LoRA adapters only."})
    lora_r: int | None = field(default=None, metadata={"help": "LoRA rank (default 8)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 16)."})
    lora_dropout: float | None = field(default=None, metadata={"help": "LoRA dropout (default 0)."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Layers to adapt, e.g. q_proj v_proj, or all-linear."}
    )
    # TRL's ModelConfig / transformers' BitsAndBytesConfig names: the 4-bit base of QLoRA (gym_lightning.quant).
    load_in_4bit: bool = field(default=False, metadata={"help": "Hold the frozen base in 4-bit NF4 (QLoRA)."})
    bnb_4bit_quant_type: str | None = field(default=None, metadata={"choices": ["nf4"], "help": "Only nf4."})
    bnb_4bit_compute_dtype: str | None = field(
        default=None, metadata={"choices": ["bfloat16", "float16", "float32"], "help": "Dequantise to (bfloat16)."}
    )
    bnb_4bit_use_double_quant: bool = field(
        default=False,
        metadata={"aliases": ["--use_bnb_nested_quant"], "help": "Quantise the scales too (4.14 bits a weight)."},
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"choices": ["uint8"], "help": "Storage of the codes: uint8 only."}
    )


@dataclass
class DataArguments:
    """The data flags (names of HF's ``run_clm.py`` and LLaMA-Factory where they exist)."""

    dataset: str | None = field(default=None, metadata={"help": "A bundled data set (e.g. addition)."})
    train_file: list[str] | None = field(default=None, metadata={"help": "Training .jsonl/.json/.txt files or globs."})
    validation_file: list[str] | None = field(default=None, metadata={"help": "Validation files or globs."})
    validation_split_percentage: int = field(default=0, metadata={"help": "Percent of --train_file held out."})
    data_format: str = field(
        default="auto",
        metadata={"choices": ["auto", "text", "alpaca", "chat", "prompt_completion"], "help": "Record format."},
    )
    max_seq_length: int = field(
        default=512, metadata={"aliases": ["--model_max_length", "--cutoff_len"], "help": "Tokens per sample."}
    )
    packing: bool = field(default=False, metadata={"help": "Pack training samples into full-length rows."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens."})


@dataclass
class GymArguments:
    """Flags of gym train beyond the HF Trainer's."""

    devices: str | None = field(
        default=None, metadata={"help": "Devices per node (number, list, auto); default: the launcher's, else auto."}
    )
    num_nodes: int | None = field(default=None, metadata={"help": "Nodes; default: the launcher's, else 1."})
    accelerator: str = field(default="auto", metadata={"help": "cpu, gpu, cuda, auto."})
    strategy: str | None = field(default=None, metadata={"help": "A Lightning strategy name instead of --deepspeed."})
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Ranks sharing each sequence (Ulysses, as ALST/TRL name it); needs gym_ddp/gym_fsdp/ZeRO."},
    )
    warmup_ratio: float = field(default=0.0, metadata={"help": "transformers < 5: same as --warmup_steps < 1."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "transformers < 5; accepted, no effect."})
    print_config: bool = field(default=False, metadata={"help": "Print the equivalent `gym fit` YAML and exit."})


@dataclass
class GymTrainingArguments(TrainingArguments):
    """``TrainingArguments`` without ``__post_init__``: that one starts accelerate's ``PartialState`` (a process group
    under torchrun, DeepSpeed with --deepspeed) and checks devices; Lightning does both here."""

    def __post_init__(self) -> None:
        pass


DATACLASSES = (ModelArguments, DataArguments, GymTrainingArguments, GymArguments)


class TrainArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` whose errors are one line (exit 2, as ``CommandParser``) and suggest the closest flag."""

    def __init__(self) -> None:
        super().__init__(DATACLASSES, prog="gym train", allow_abbrev=False)
        for action in self._actions:
            if action.dest == "report_to":  # a list in HF's docs, but a plain str field for argparse
                action.nargs = "+"
        self.description = "Finetune a causal LM with Hugging Face Trainer flags (runs `gym fit` underneath)."

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gym_lightning: error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")

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
    """The ``gym train`` flags: every ``TrainingArguments`` field (HF's names, types, defaults) and this module's."""
    return TrainArgumentParser()


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """All flags as one namespace, from the command line or from one ``.yaml``/``.yml``/``.json`` file (HF style)."""
    parser = build_parser()
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
        try:
            read = parser.parse_json_file if argv[0].endswith(".json") else parser.parse_yaml_file
            parts = read(os.path.abspath(argv[0]))
        except (TypeError, ValueError, OSError) as err:  # missing/extra keys, unreadable file
            raise GymUserError(f"gym train {argv[0]}: {err}") from err
        return argparse.Namespace(**{k: v for part in parts for k, v in vars(part).items()})
    return parser.parse_args(argv)


def refused_flags(args: argparse.Namespace) -> list[str]:
    """One problem per ``TrainingArguments`` field that is set to a non-default value but not mapped here."""
    problems = []
    # What the parser yields when a flag is not given (argparse passes string defaults through ``type``).
    parser_defaults = vars(build_parser().parse_args(["--model_name_or_path", "-"]))
    for spec in dataclasses.fields(TrainingArguments):
        if not spec.init or spec.name in MAPPED_FIELDS:
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        value = getattr(args, spec.name, default)
        # The parser's default can differ from the field's (debug: None vs "", include_num_input_tokens_seen:
        # False vs "no"); both count as unset. str(): an enum equals its value's text.
        if str(value) not in (str(default), str(parser_defaults.get(spec.name, default))):
            reason = REFUSAL_REASONS.get(spec.name, "gym train has no equivalent; leave it at its default")
            problems.append(f"--{spec.name} {value!r} is not supported: {reason}.")
    return problems


# ------------------------------------------------------------------------------------------------------ mapping
def flag_problems(args: argparse.Namespace) -> list[str]:
    """Every combination of flags that cannot run, each with its fix."""
    problems = refused_flags(args)
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 exclude each other; pick one.")
    if args.deepspeed and args.strategy:
        problems.append("--deepspeed and --strategy both choose the strategy; pass one.")
    if args.dataset and args.train_file:
        problems.append("--dataset and --train_file both choose the training data; pass one.")
    if not args.dataset and not args.train_file:
        problems.append("no training data: pass --train_file data.jsonl (or --dataset addition).")
    if str(args.optim) not in OPTIMIZERS:
        problems.append(
            f"--optim {args.optim}: not built by gym_lightning (it needs a package or a device not used here); "
            f"use one of {', '.join(OPTIMIZERS)}."
        )
    if str(args.lr_scheduler_type) not in SCHEDULERS:
        problems.append(
            f"--lr_scheduler_type {args.lr_scheduler_type}: follows a validation metric, which gym train does not "
            f"feed to schedules; use one of {', '.join(SCHEDULERS)}."
        )
    problems += _ratio_problems(args) + _report_to_problems(args)
    given_lora = [f"--{name}" for name in LORA_FLAGS if getattr(args, name) is not None]
    if given_lora and not args.use_lora:
        problems.append(f"{', '.join(given_lora)} need --use_lora.")
    given_4bit = [f"--{name}" for name in QUANT_FLAGS if getattr(args, name) not in (None, False)]
    if given_4bit and not args.load_in_4bit:
        problems.append(f"{', '.join(given_4bit)} need --load_in_4bit.")
    if args.load_in_4bit and not args.use_lora:
        problems.append("--load_in_4bit freezes the base in 4 bits: add --use_lora (QLoRA) to train adapters on it.")
    if args.eval_steps is not None and str(args.eval_strategy) not in ("no", "steps"):
        problems.append(f"--eval_steps needs --eval_strategy steps, got {args.eval_strategy}.")
    return problems


def _ratio_problems(args: argparse.Namespace) -> list[str]:
    # HF turns a ratio into steps with the total it computes from the data; here the total is known up front only
    # from --max_steps (the data set's size is known when Lightning builds the loader).
    flags = {"logging_steps": args.logging_steps, "eval_steps": args.eval_steps, "save_steps": args.save_steps}
    return [
        f"--{name} {value} is a ratio of the total steps: give --max_steps too, or a number of steps."
        for name, value in flags.items()
        if value is not None and 0 < value < 1 and args.max_steps <= 0
    ]


def _report_to_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    for name in _report_to(args.report_to):
        if name not in LOGGERS:
            problems.append(f"--report_to {name}: gym train logs to {', '.join(LOGGERS)} (or all, none).")
        elif (package := LOGGERS[name][1]) and importlib.util.find_spec(package) is None:
            problems.append(f"--report_to {name}: the {package} package is not installed (pip install {package}).")
    return problems


def _report_to(report_to: str | list[str] | None) -> list[str]:
    """HF's --report_to as a list of integrations; "all" is every installed one, "none" (HF's default) none."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "all" in names:
        return [name for name, (_, package) in LOGGERS.items() if package is None or importlib.util.find_spec(package)]
    return [name for name in names if name != "none"]


def to_cli_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``gym fit`` (LightningCLI) arguments equivalent to the parsed ``gym train`` flags.

    ``env`` (default ``os.environ``) tells the launcher's process layout (``launcher_topology``)."""
    raise_if_problems("Invalid gym train flags", flag_problems(args))
    ds_config = load_deepspeed_json(args.deepspeed) if args.deepspeed else {}
    # HF's defaults (1, 1.0) count as unset: the JSON's explicit numbers then win, as with HF's "auto".
    given_accumulation = None if args.gradient_accumulation_steps == 1 else args.gradient_accumulation_steps
    accumulation = adopted_value(ds_config.get("gradient_accumulation_steps"), given_accumulation) or 1
    clip = adopted_value(ds_config.get("gradient_clipping"), None if args.max_grad_norm == 1.0 else args.max_grad_norm)
    values: dict[str, Any] = {"seed_everything": args.seed}
    values |= _trainer_values(args, accumulation, 1.0 if clip is None else clip)
    values |= _topology_values(args, os.environ if env is None else env)
    values |= _model_values(args)
    values |= _data_values(args)
    cli_args = ["fit", *(f"--{key}={_format(value)}" for key, value in values.items())]
    if args.resume_from_checkpoint:
        resume = args.resume_from_checkpoint
        # HF: True resumes from the newest checkpoint of output_dir, which StepCheckpoint links as last.ckpt.
        cli_args.append(f"--ckpt_path={'last' if str(resume).lower() == 'true' else resume}")
    return cli_args


def launcher_topology(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(devices per node, nodes)`` of the launcher that started this process, ``None`` without one.

    torchrun (also ``python -m torch.distributed.run`` and ``accelerate launch``, which runs it) sets
    ``LOCAL_WORLD_SIZE``; the ``deepspeed`` launcher sets ``LOCAL_SIZE``; ``srun`` sets ``SLURM_STEP_NUM_TASKS`` and
    ``SLURM_STEP_NUM_NODES`` (only inside a job step, not in the batch script that calls srun).
    """
    if "WORLD_SIZE" in env and ("LOCAL_WORLD_SIZE" in env or "LOCAL_SIZE" in env):
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE") or env["LOCAL_SIZE"])
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_STEP_NUM_NODES" in env:
        world, nodes = int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_STEP_NUM_NODES"])
        local = world // max(1, nodes)
    else:
        return None
    if local < 1 or world % local:
        raise GymUserError(
            f"the launcher started {world} processes, not a multiple of {local} per node; start the same number of "
            "processes on every node."
        )
    return local, world // local


def launcher_node_rank(env: Mapping[str, str]) -> dict[str, str]:
    """``NODE_RANK`` for Lightning where the launcher names it otherwise: the ``deepspeed`` launcher sets
    ``CROSS_RANK`` only, and Lightning's environment reads ``NODE_RANK``/``GROUP_RANK`` (else node 0 everywhere,
    so the second node's ranks would collide with the first's)."""
    if "CROSS_RANK" in env and "NODE_RANK" not in env and "GROUP_RANK" not in env:
        return {"NODE_RANK": env["CROSS_RANK"]}
    return {}


def _topology_values(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    launched = launcher_topology(env)
    devices: int | str | list[int] = _devices(args.devices) if args.devices is not None else "auto"
    num_nodes = args.num_nodes if args.num_nodes is not None else 1
    if launched is not None:
        devices = launched[0] if args.devices is None else devices
        num_nodes = launched[1] if args.num_nodes is None else num_nodes
    return {"trainer.devices": devices, "trainer.num_nodes": num_nodes}


def _trainer_values(args: argparse.Namespace, accumulation: int, clip: float) -> dict[str, Any]:
    values: dict[str, Any] = {
        "trainer.accelerator": "cpu" if args.use_cpu else args.accelerator,
        "trainer.precision": "bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else "32-true",
        "trainer.accumulate_grad_batches": accumulation,
        "trainer.gradient_clip_val": clip,
        "trainer.log_every_n_steps": _steps(args.logging_steps, args.max_steps),
        "trainer.default_root_dir": args.output_dir or "trainer_output",
    }
    if args.disable_tqdm:
        values["trainer.enable_progress_bar"] = False
    if args.deepspeed:
        init_args = {"config": args.deepspeed if isinstance(args.deepspeed, dict) else str(args.deepspeed)}
        values["trainer.strategy"] = {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": init_args}
    elif args.strategy:
        values["trainer.strategy"] = args.strategy
    if args.ddp_timeout != HF_DDP_TIMEOUT:
        timeout = {"timeout": str(timedelta(seconds=args.ddp_timeout))}
        values["trainer.strategy"] = with_init_args(values.get("trainer.strategy"), "--ddp_timeout", timeout)
    if args.sequence_parallel_size != 1:
        size = {"sequence_parallel_size": args.sequence_parallel_size}
        values["trainer.strategy"] = with_init_args(values.get("trainer.strategy"), "--sequence_parallel_size", size)
    if loggers := _report_to(args.report_to):
        values["trainer.logger"] = [
            _logger(name, values["trainer.default_root_dir"], args.run_name) for name in loggers
        ]
    if args.max_steps > 0:
        values |= {"trainer.max_steps": args.max_steps, "trainer.max_epochs": -1}
    else:
        values |= {"trainer.max_epochs": math.ceil(args.num_train_epochs)}
    return values | _eval_values(args, accumulation) | _callback_values(args)


def with_init_args(strategy: str | dict[str, Any] | None, flag: str, init_args: dict[str, Any]) -> dict[str, Any]:
    """``strategy`` (a registered name, a class dict, or ``None`` for auto, which becomes ``gym_ddp``) as a class
    dict with ``init_args`` added: what ``flag`` (``--ddp_timeout``, ``--sequence_parallel_size``) sets."""
    from lightning.pytorch.strategies import StrategyRegistry

    import gym_lightning.strategies  # noqa: F401 - registers gym_lightning's names

    if isinstance(strategy, dict):
        return {**strategy, "init_args": {**strategy.get("init_args", {}), **init_args}}
    name = "gym_ddp" if strategy in (None, "auto") else strategy
    if name not in StrategyRegistry:
        raise GymUserError(f"--strategy {name!r} is not a registered strategy name; see gym fit --help.")
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    if missing := [key for key in init_args if key not in inspect.signature(cls).parameters]:
        raise GymUserError(f"{flag}: strategy {name!r} ({cls.__name__}) has no {missing[0]} argument; drop it.")
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {**entry["init_params"], **init_args}}


def _steps(value: float, max_steps: int) -> int:
    """HF's logging/eval/save steps: a count, or below 1 a ratio of the total steps rounded up."""
    return math.ceil(value * max_steps) if 0 < value < 1 else int(value)


def _eval_values(args: argparse.Namespace, accumulation: int) -> dict[str, Any]:
    given = str(args.eval_strategy) if str(args.eval_strategy) != "no" else None
    strategy = given or ("steps" if args.eval_steps else "epoch" if args.do_eval else "no")
    if strategy == "no":
        return {"trainer.limit_val_batches": 0, "trainer.num_sanity_val_steps": 0}
    if strategy == "epoch":
        return {"trainer.check_val_every_n_epoch": 1, "trainer.val_check_interval": None}
    # Lightning's interval counts micro-batches; HF's eval_steps counts optimizer steps (default: logging_steps).
    steps = _steps(args.eval_steps or args.logging_steps, args.max_steps)
    return {"trainer.check_val_every_n_epoch": None, "trainer.val_check_interval": steps * accumulation}


def _logger(name: str, output_dir: str, run_name: str | None) -> dict[str, Any]:
    class_path = LOGGERS[name][0]
    init_args: dict[str, Any] = {"save_dir": output_dir}
    if name in ("csv", "tensorboard"):
        init_args |= {"name": "logs"} | ({"version": run_name} if run_name else {})
    elif run_name:
        init_args["name" if name == "wandb" else "run_name"] = run_name
    return {"class_path": class_path, "init_args": init_args}


def _callback_values(args: argparse.Namespace) -> dict[str, Any]:
    output_dir = args.output_dir or "trainer_output"
    # trainer_state.json (log_history) and curves.png in output_dir, where HF users look (a CurvesCallback).
    state = {"class_path": "gym_lightning.callbacks.TrainerStateCallback", "init_args": {"output_dir": output_dir}}
    if args.max_steps <= 0 and args.num_train_epochs != int(args.num_train_epochs):
        # HF: ceil(epochs x steps per epoch) steps; the steps per epoch are known once the DataLoader exists.
        fraction = {
            "class_path": "gym_lightning.callbacks.EpochFraction",
            "init_args": {"epochs": args.num_train_epochs},
        }
        state = [state, fraction]
    else:
        state = [state]
    strategy = str(args.save_strategy)
    if strategy == "no":
        return {"trainer.enable_checkpointing": False, "trainer.callbacks": state}
    keep = -1 if args.save_total_limit is None else args.save_total_limit
    dirpath = str(Path(output_dir) / "checkpoints")
    if strategy == "steps":
        init_args = {"dirpath": dirpath, "every_n_steps": _steps(args.save_steps, args.max_steps), "keep_last": keep}
        checkpoint = {"class_path": "gym_lightning.checkpointing.StepCheckpoint", "init_args": init_args}
    else:
        init_args = {"dirpath": dirpath, "every_n_epochs": 1, "save_top_k": keep, "monitor": "step", "mode": "max"}
        checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": init_args}
    return {"trainer.enable_checkpointing": True, "trainer.callbacks": [checkpoint, *state]}


def _model_values(args: argparse.Namespace) -> dict[str, Any]:
    warmup = args.warmup_steps
    ratio = warmup if 0 < warmup < 1 else args.warmup_ratio  # HF 5: warmup_steps < 1 is a ratio
    values: dict[str, Any] = {
        "model.model": args.model_name_or_path,
        "model.tokenizer": args.tokenizer_name,
        "model.torch_dtype": args.torch_dtype,
        "model.attn_implementation": args.attn_implementation,
        "model.trust_remote_code": args.trust_remote_code,
        "model.gradient_checkpointing": bool(args.gradient_checkpointing),
        "model.lr": args.learning_rate,
        "model.weight_decay": args.weight_decay,
        "model.betas": [args.adam_beta1, args.adam_beta2],
        "model.eps": args.adam_epsilon,
        "model.optim": str(args.optim),
        "model.decay_rule": "hf",  # no decay on biases and LayerNorm/norm weights, HF's get_decay_parameter_names
        "model.hf_scheduler": str(args.lr_scheduler_type),  # HF's "constant" ignores the warm-up itself
        "model.scheduler_kwargs": _scheduler_kwargs(args.lr_scheduler_kwargs),
        "model.warmup_steps": 0 if warmup < 1 else int(warmup),
        "model.warmup_ratio": ratio,
        "export.output_dir": str(Path(args.output_dir or "trainer_output") / "hf"),
    }
    if args.use_lora:
        lora = {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout}
        lora["target_modules"] = args.lora_target_modules
        values["model.lora"] = {key: value for key, value in lora.items() if value is not None}
    if args.load_in_4bit:
        # transformers' BitsAndBytesConfig defaults to no double quantisation; the HF/TRL flag turns it on.
        quantization = {"compute_dtype": args.bnb_4bit_compute_dtype, "double_quant": args.bnb_4bit_use_double_quant}
        values["model.quantization"] = {key: value for key, value in quantization.items() if value is not None}
    return values


def _scheduler_kwargs(kwargs: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """HF's --lr_scheduler_kwargs: a dict (from a YAML/JSON file) or its JSON text (from the command line)."""
    if isinstance(kwargs, str):
        try:
            return json.loads(kwargs)
        except json.JSONDecodeError as err:
            raise GymUserError(f"--lr_scheduler_kwargs {kwargs!r} is not JSON: {err}") from err
    return kwargs


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
        "data.seed": args.seed if args.data_seed is None else args.data_seed,
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


def apply_tf32(tf32: bool | None) -> None:
    """HF's ``--tf32``: TF32 matmuls and convolutions on Ampere+ GPUs (no effect on CPU); ``None`` leaves torch's.

    Set in this process, before the run: every rank runs ``gym train`` itself (a launcher's, or Lightning's
    re-run of the command line), so each one sets it. Not part of the ``--print_config`` YAML."""
    if tf32 is None:
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``gym train``."""
    from gym_lightning.cli import run_lightning_cli

    args = parse_train_args(list(sys.argv[1:] if argv is None else argv))
    cli_args = to_cli_args(args)
    apply_tf32(args.tf32)
    os.environ.update(launcher_node_rank(os.environ))
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
    "DATACLASSES",
    "SETTING_FLAGS",
    "DataArguments",
    "GymArguments",
    "GymTrainingArguments",
    "ModelArguments",
    "TrainArgumentParser",
    "build_parser",
    "flag_problems",
    "flags_for_settings",
    "launcher_node_rank",
    "launcher_topology",
    "main",
    "parse_train_args",
    "refused_flags",
    "to_cli_args",
]
