"""The parsed flags as ``gym fit`` arguments (``--trainer.max_steps=...``), the one code path of both commands.

``to_cli_args`` checks every flag first (``problems.flag_problems``: one message lists every problem), then gathers
the ``trainer.*`` (``trainer``), ``model.*`` (``model``) and ``data.*`` settings; ``flag_notes`` are the info lines
about flags taken with a meaning worth saying.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from gym_lightning.commands.train.data import plan_data
from gym_lightning.commands.train.launchers import topology_values
from gym_lightning.commands.train.llama_factory import template_note
from gym_lightning.commands.train.model import model_values
from gym_lightning.commands.train.problems import flag_problems
from gym_lightning.commands.train.stages import resolved_data, stage_of
from gym_lightning.commands.train.trainer import eval_strategy, trainer_values
from gym_lightning.errors import raise_if_problems
from gym_lightning.strategies.zero.config import load_deepspeed_json
from gym_lightning.strategies.zero.hf_auto import adopted_value


def to_cli_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``gym fit`` (LightningCLI) arguments equivalent to the parsed ``gym train`` flags.

    ``env`` (default ``os.environ``) tells the launcher's process layout (``launchers.launcher_topology``)."""
    raise_if_problems("Invalid gym train flags", flag_problems(args))
    ds_config = load_deepspeed_json(args.deepspeed) if args.deepspeed else {}
    # HF's defaults (1, 1.0) count as unset: the JSON's explicit numbers then win, as with HF's "auto".
    given_accumulation = None if args.gradient_accumulation_steps == 1 else args.gradient_accumulation_steps
    accumulation = adopted_value(ds_config.get("gradient_accumulation_steps"), given_accumulation) or 1
    clip = adopted_value(ds_config.get("gradient_clipping"), None if args.max_grad_norm == 1.0 else args.max_grad_norm)
    values: dict[str, Any] = {"seed_everything": args.seed}
    values |= trainer_values(args, accumulation, 1.0 if clip is None else clip)
    values |= topology_values(args.devices, args.num_nodes, os.environ if env is None else env)
    values |= model_values(args)
    values |= data_values(args)
    cli_args = ["fit", *(f"--{key}={_format(value)}" for key, value in values.items())]
    if args.resume_from_checkpoint:
        resume = args.resume_from_checkpoint
        # HF: True resumes from the newest checkpoint of output_dir, which StepCheckpoint links as last.ckpt.
        cli_args.append(f"--ckpt_path={'last' if str(resume).lower() == 'true' else resume}")
    return cli_args


def data_values(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``data.*`` setting of the flags (the stage's data defaults under the flags given)."""
    stage_data = resolved_data(args)
    values: dict[str, Any] = {"data.dataset": None, "data.format": stage_data["format"]}
    if not args.dataloader_pin_memory:  # HF's default (True) pins on a GPU only, as data.pin_memory's None does
        values["data.pin_memory"] = False
    values |= plan_data(args, eval_strategy(args) != "no").values
    if values.get("data.columns") is None:
        values.pop("data.columns", None)
    values |= {
        "data.max_seq_length": args.max_seq_length,
        "data.packing": stage_data["packing"],
        "data.mask_prompt": stage_data["mask_prompt"],
        "data.batch_size": args.per_device_train_batch_size,
        "data.eval_batch_size": args.per_device_eval_batch_size,
        "data.num_workers": args.dataloader_num_workers,
        "data.seed": args.seed if args.data_seed is None else args.data_seed,
    }
    if args.truncation_mode != "keep_start":  # TRL's preference rows: the stages that read it (others refuse it)
        values["data.truncation_mode"] = args.truncation_mode
    if args.max_prompt_length is not None:
        values["data.max_prompt_length"] = args.max_prompt_length
    if args.dataset_num_proc is not None:
        values["data.num_proc"] = args.dataset_num_proc
    if args.dataset_streaming:
        values["data.streaming"] = True
    return values


HF_LEARNING_RATE = 5e-5  # TrainingArguments' learning_rate, which TRL's preference configs lower to 1e-6


def flag_notes(args: argparse.Namespace) -> list[str]:
    """Info lines about flags that are accepted with a meaning worth saying (printed on rank 0 before the run)."""
    notes = plan_data(args, eval_strategy(args) != "no").notes + template_note(args)
    if str(args.chat_template_format).lower() != "none":
        notes.append(
            f"--chat_template_format {args.chat_template_format}: chats are rendered with the tokenizer's own chat "
            "template and vocabulary (PEFT's script would set that template, add its tokens and resize the "
            "embeddings), and --dataset_text_field names no column (that script writes the rendered chats there)."
        )
    stage = stage_of(args)
    if stage.trl != "SFTConfig" and stage.refusal is None and args.learning_rate == HF_LEARNING_RATE:
        notes.append(
            f"--learning_rate {HF_LEARNING_RATE:g} is TrainingArguments' default, which gym train keeps; TRL's "
            f"{stage.trl} defaults to 1e-06 (and logging_steps 10, gradient_checkpointing, bf16): pass them for "
            "TRL's run."
        )
    if (smoothing := args.dpo_label_smoothing) and stage.name == "dpo":
        notes.append(
            f"--dpo_label_smoothing {smoothing:g}: LLaMA-Factory's smoothed sigmoid (cDPO) is TRL 1.16's loss types "
            f"[sigmoid, robust] weighted [{2 * (1 - smoothing):g}, {-(1 - 2 * smoothing):g}] with label_smoothing "
            f"{smoothing:g} here: the same loss."
        )
    if str(args.stage) == "pt":
        notes.append(
            "--stage pt: each text is cut at --max_seq_length tokens and packed with others into rows that never "
            "attend across texts; LLaMA-Factory's pt (and TRL's wrapped packing) continues a long text in the next row."
        )
    return notes


def _format(value: Any) -> str:
    """A value as jsonargparse reads it: JSON for containers/None/bools, plain text otherwise."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


__all__ = ["data_values", "flag_notes", "to_cli_args"]
