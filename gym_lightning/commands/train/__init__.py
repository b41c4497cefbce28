"""``gym train``: the flags of the HF Trainer, TRL, PEFT's script and LLaMA-Factory, run as ``gym fit``.

    gym train --model_name_or_path Qwen/Qwen3-0.6B --deepspeed configs/deepspeed/ds_zero3.json \\
        --train_file data.jsonl --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --bf16 True
    gym train --stage pt --model_name_or_path ... --dataset_name corpus.jsonl   # continued pretraining
    gym train --stage dpo --model_name_or_path ... --dataset_name pairs/ --beta 0.1   # trl dpo (kto, orpo, simpo)
    torchrun --nproc_per_node 2 -m gym_lightning train ...   # (or deepspeed, accelerate launch, srun) no --devices
    gym train run.yaml                                        # every flag from one YAML or JSON file

Nothing here trains: the flags (``parser``) become dotted LightningCLI arguments (``mapping.to_cli_args``) run
through ``gym_lightning.cli.run_lightning_cli``, the code path of ``gym fit``; ``--print_config`` prints that run as
YAML. The tables say how each field of each source is read (``rows.Row``: mapped, accepted, or refused with a
reason): ``hf`` (``TrainingArguments``, ``run_clm.py``), ``trl`` (``ScriptArguments``, ``ModelConfig``, ``SFTConfig``,
``DPOConfig``, ``KTOConfig``, ``ORPOConfig``, ``CPOConfig``), ``peft_script``, ``llama_factory_table``, ``launchers``,
and ``stages`` (what each stage trains: a row plus an objective; ``preference`` turns the preference stages' flags
into their objectives' settings). The manual is docs/gym-train.md, generated from the tables (``docs``).
"""

from __future__ import annotations

import os
import re
import sys
import warnings

from gym_lightning._compat import rank_zero_info
from gym_lightning.commands.train.hf import REFUSAL_REASONS
from gym_lightning.commands.train.launchers import launcher_node_rank, launcher_topology
from gym_lightning.commands.train.mapping import flag_notes, to_cli_args
from gym_lightning.commands.train.model import fast_path_values as _fast_path_values  # noqa: F401 - the former name
from gym_lightning.commands.train.model import lora_targets
from gym_lightning.commands.train.parser import DATACLASSES, TrainArgumentParser, build_parser, parse_train_args
from gym_lightning.commands.train.problems import flag_problems, refused_flags
from gym_lightning.commands.train.stages import STAGES
from gym_lightning.errors import GymUserError
from gym_lightning.vocabulary import SETTING_FLAGS  # SETTING_FLAGS: `gym fit` setting -> its flags

_SETTING_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in SETTING_FLAGS) + r")(?![\w.])")


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
    for note in flag_notes(args):
        rank_zero_info(note)
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
    "REFUSAL_REASONS",
    "SETTING_FLAGS",
    "STAGES",
    "TrainArgumentParser",
    "apply_tf32",
    "build_parser",
    "flag_notes",
    "flag_problems",
    "flags_for_settings",
    "launcher_node_rank",
    "launcher_topology",
    "lora_targets",
    "main",
    "parse_train_args",
    "refused_flags",
    "to_cli_args",
]
