"""Every problem of a ``gym train`` line, found before anything runs and listed in one message: unknown config keys,
refused fields (the tables' ``refused`` rows), the stage, and combinations of flags that cannot run, each with its
fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from typing import Any, get_args

from transformers import TrainingArguments

from gym_lightning.commands.train import llama_factory_table
from gym_lightning.commands.train.data import plan_data
from gym_lightning.commands.train.hf import HF_DDP_TIMEOUT, TRAINING_ARGUMENTS, UNKNOWN_FIELD
from gym_lightning.commands.train.llama_factory import template_problem
from gym_lightning.commands.train.model import four_bit, lora_on
from gym_lightning.commands.train.parser import build_parser, parser_defaults
from gym_lightning.commands.train.peft_script import PEFT_SCRIPT
from gym_lightning.commands.train.rows import Row, merged, refusal
from gym_lightning.commands.train.stages import foreign_rows, resolved_data, stage_of, stage_problems
from gym_lightning.commands.train.trainer import LOGGERS, eval_strategy, report_to
from gym_lightning.commands.train.trl import TRL_COMMON
from gym_lightning.data.sources import MIX_STRATEGIES
from gym_lightning.optim import HFSchedulerName, OptimizerName
from gym_lightning.vocabulary import AUTO_STRATEGY

# The HF schedules and optimizers the module builds (transformers.get_scheduler; optim.build_optimizer).
SCHEDULERS: tuple[str, ...] = get_args(HFSchedulerName)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters")
QUANT_FLAGS = ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage")
# Refused fields with a check of their own (the data plan's message names TRL's mixture).
CHECKED_ELSEWHERE = frozenset({"datasets"})


def flag_problems(args: argparse.Namespace) -> list[str]:
    """Every combination of flags that cannot run, each with its fix (the config file's unknown keys first)."""
    problems = list(getattr(args, "config_problems", [])) + _choice_problems(args) + refused_flags(args)
    problems += stage_problems(args)
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 exclude each other; pass one.")
    if args.deepspeed and args.strategy:
        problems.append("--deepspeed and --strategy both choose the strategy; pass one.")
    problems += _auto_strategy_problems(args)
    problems += plan_data(args, eval_strategy(args) != "no").problems
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
    problems += _ratio_problems(args) + _report_to_problems(args) + _adapter_problems(args) + _loss_problems(args)
    padding_free = stage_of(args).fields.get("padding_free")  # the preference stages refuse it in their rows
    if args.padding_free and not resolved_data(args)["packing"] and padding_free and padding_free.kind == "mapped":
        problems.append(
            "--padding_free True is not supported without --packing: a batch is padded to its longest row here; "
            "--packing makes padding-free rows (as TRL's packing does)."
        )
    if args.eval_steps is not None and str(args.eval_strategy) not in ("no", "steps"):
        problems.append(f"--eval_steps needs --eval_strategy steps, got {args.eval_strategy}.")
    if args.mix_strategy not in MIX_STRATEGIES:
        problems.append(f"--mix_strategy {args.mix_strategy}: not wired in; use one of {', '.join(MIX_STRATEGIES)}.")
    if template := template_problem(args):
        problems.append(template)
    return problems


def flag_rows(args: argparse.Namespace) -> dict[str, Row]:
    """The row of each flag that is not a ``TrainingArguments`` field, by the argument it sets: the stage's fields
    first (its TRL config's ``loss_type``, the preference keys it reads), then the refusals of other stages' fields,
    TRL's model and data fields, PEFT's script and LLaMA-Factory's keys."""
    stage = stage_of(args)
    tables = [stage.fields, foreign_rows(stage), TRL_COMMON, PEFT_SCRIPT, *llama_factory_table.TABLES.values()]
    rows: dict[str, Row] = {}
    for name, row in merged(*tables).items():
        rows.setdefault(row.flag or name, row)
    return rows


def refused_flags(args: argparse.Namespace) -> list[str]:
    """One problem per field set to a value its table refuses: ``TrainingArguments``' (every field of the installed
    transformers: one the table does not know is refused unless at its default), then the other sources'."""
    problems = []
    defaults = parser_defaults()
    for spec in dataclasses.fields(TrainingArguments):
        row = TRAINING_ARGUMENTS.get(spec.name, UNKNOWN_FIELD)
        if not spec.init or row.kind != "refused":
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        value = getattr(args, spec.name, default)
        # The parser's default can differ from the field's (debug: None vs "", include_num_input_tokens_seen:
        # False vs "no"); both count as unset.
        if not (row.takes(value, default) or row.takes(value, defaults.get(spec.name, default))):
            problems.append(refusal(spec.name, value, row))
    stage = stage_of(args)
    # A refused stage's one line says it all: the stages' fields are not checked against it.
    skipped = CHECKED_ELSEWHERE | (set(stage.fields) | set(foreign_rows(stage)) if stage.refusal else set())
    for dest, row in flag_rows(args).items():
        if dest not in defaults or dest in skipped:
            continue
        value = getattr(args, dest)
        if not row.takes(value, defaults[dest]):
            problems.append(refusal(dest, value, row))
    return problems


def _auto_strategy_problems(args: argparse.Namespace) -> list[str]:
    """``--strategy gym_auto`` with a flag that sets an argument of the strategy: refused, since the strategy does not
    exist yet when the flags are mapped (the planner picks it as the run starts, ``cli.resolve_auto_strategy``) and
    not every strategy it may pick takes every argument."""
    if args.strategy != AUTO_STRATEGY:
        return []
    given = {
        "--ddp_timeout": args.ddp_timeout != HF_DDP_TIMEOUT,
        "--sequence_parallel_size": args.sequence_parallel_size != 1,
    }
    return [
        f"{flag} sets an argument of the strategy, and --strategy {AUTO_STRATEGY} leaves the choice to the planner; "
        f"drop {flag}, or name the strategy (gym plan --config run.yaml ranks them)."
        for flag, set_here in given.items()
        if set_here
    ]


def _choice_problems(args: argparse.Namespace) -> list[str]:
    """Values outside a flag's choices: argparse checks a flag's value, not a default that a config file set."""
    problems = []
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        if not action.choices or value is None or not action.option_strings:
            continue
        for item in value if isinstance(value, list) else [value]:
            if str(item) not in {str(choice) for choice in action.choices}:
                choices = ", ".join(map(str, action.choices))
                problems.append(f"{action.option_strings[0]} {item}: choose one of {choices}.")
    return problems


def _adapter_problems(args: argparse.Namespace) -> list[str]:
    """LoRA and 4-bit flags that need the flag that turns them on, or contradict it."""
    problems = []
    given_lora = [f"--{name}" for name in LORA_FLAGS if getattr(args, name) is not None]
    if given_lora and not lora_on(args):
        problems.append(f"{', '.join(given_lora)} need --use_lora.")
    if args.use_lora and args.finetuning_type == "full":
        problems.append("--use_lora and finetuning_type full contradict each other; pass one.")
    given_4bit = [f"--{name}" for name in QUANT_FLAGS if getattr(args, name) not in (None, False)]
    if given_4bit and not four_bit(args):
        problems.append(f"{', '.join(given_4bit)} need --load_in_4bit.")
    if four_bit(args) and not lora_on(args):
        problems.append("--load_in_4bit freezes the base in 4 bits: add --use_lora (QLoRA) to train adapters on it.")
    return problems


def _loss_problems(args: argparse.Namespace) -> list[str]:
    """The loss-masking flags, which all set the one switch ``data.mask_prompt``."""
    chosen = {
        f"--{name} {value}": value
        for name in ("completion_only_loss", "assistant_only_loss")
        if (value := getattr(args, name)) is not None
    }
    if len(set(chosen.values())) > 1:
        return [f"{' and '.join(chosen)}: gym_lightning has one switch for both (data.mask_prompt); make them agree."]
    if args.train_on_prompt and any(chosen.values()):
        return [f"--train_on_prompt and {' '.join(chosen)} contradict each other; pass one."]
    return []


def _ratio_problems(args: argparse.Namespace) -> list[str]:
    # HF turns a ratio into steps with the total it computes from the data; here the total is known up front only
    # from --max_steps (the data set's size is known when Lightning builds the loader).
    flags: dict[str, Any] = {"logging_steps": args.logging_steps, "eval_steps": args.eval_steps}
    flags["save_steps"] = args.save_steps
    return [
        f"--{name} {value} is a ratio of the total steps: give --max_steps too, or a number of steps."
        for name, value in flags.items()
        if value is not None and 0 < value < 1 and args.max_steps <= 0
    ]


def _report_to_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    for name in report_to(args.report_to):
        if name not in LOGGERS:
            problems.append(f"--report_to {name}: gym train logs to {', '.join(LOGGERS)} (or all, none).")
        elif (package := LOGGERS[name][1]) and importlib.util.find_spec(package) is None:
            problems.append(f"--report_to {name}: the {package} package is not installed (pip install {package}).")
    return problems


__all__ = ["OPTIMIZERS", "SCHEDULERS", "flag_problems", "flag_rows", "refused_flags"]
