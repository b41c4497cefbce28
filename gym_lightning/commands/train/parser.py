"""The ``gym train`` parser: ``HfArgumentParser`` over every source's flags (``hf``, ``trl``, ``peft_script``,
``llama_factory``) and gym train's own (``GymArguments``), one flat namespace as each source's command line is flat.

A YAML/JSON file of flags (``--config FILE``, TRL's; or ``gym train FILE``, HF's one-file form) sets the flags'
defaults, which the command line then overrides. A key of the file may be any name of a flag (``cutoff_len``,
``max_length``, ``lora_rank``, ``dtype``, ``use_peft``, ...), TRL's ``env`` mapping (set in the environment), or an
LLaMA-Factory key that is no flag here, which its table accepts or refuses (``llama_factory_table``); any other key
is a problem of the one error message, as refused flags are.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser

from gym_lightning.commands.train import hf, llama_factory_table
from gym_lightning.commands.train.hf import GymTrainingArguments
from gym_lightning.commands.train.llama_factory import LlamaFactoryArguments
from gym_lightning.commands.train.peft_script import PeftScriptArguments
from gym_lightning.commands.train.rows import Row, mapped, merged
from gym_lightning.commands.train.stages import STAGES
from gym_lightning.commands.train.trl import PreferenceArguments, TrlDataArguments, TrlModelArguments
from gym_lightning.data.formats import FORMATS
from gym_lightning.errors import GymUserError
from gym_lightning.vocabulary import AUTO_STRATEGY

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
# Every LLaMA-Factory key, for the keys of a config file that are no flag here.
LLAMA_FACTORY_KEYS: dict[str, Row] = merged(*llama_factory_table.TABLES.values())


@dataclass
class GymArguments:
    """Flags of gym train beyond the sources' (devices, strategy, stage, ...)."""

    stage: str = field(
        default="sft", metadata={"help": "What to train (LLaMA-Factory's stage): sft, pt, ... (the stage table)."}
    )
    data_format: str = field(default="auto", metadata={"choices": list(FORMATS), "help": "Record format."})
    devices: str | None = field(
        default=None, metadata={"help": "Devices per node (number, list, auto); default: the launcher's, else auto."}
    )
    num_nodes: int | None = field(default=None, metadata={"help": "Nodes; default: the launcher's, else 1."})
    accelerator: str = field(default="auto", metadata={"help": "cpu, gpu, cuda, auto."})
    strategy: str | None = field(
        default=None,
        metadata={
            "help": f"A Lightning strategy name instead of --deepspeed; {AUTO_STRATEGY}: the planner picks the fastest "
            "that fits this model, batch and hardware as the run starts (one line says which and why)."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Ranks sharing each sequence (Ulysses, as ALST/TRL name it); needs gym_ddp/gym_fsdp/ZeRO."},
    )
    warmup_ratio: float = field(default=0.0, metadata={"help": "transformers < 5: same as --warmup_steps < 1."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "transformers < 5; accepted, no effect."})
    print_config: bool = field(default=False, metadata={"help": "Print the equivalent `gym fit` YAML and exit."})


GYM: dict[str, Row] = {
    "stage": mapped("model.objective and its data settings (the stage table)"),
    "data_format": mapped("data.format (auto detects it from the fields; stage pt reads text)"),
    "devices": mapped("trainer.devices (default: the launcher's, else auto)"),
    "num_nodes": mapped("trainer.num_nodes (default: the launcher's, else 1)"),
    "accelerator": mapped("trainer.accelerator"),
    "strategy": mapped(f"trainer.strategy: gym_ddp, gym_fsdp, zero1..., Lightning's names, {AUTO_STRATEGY}"),
    "sequence_parallel_size": mapped("the strategy's sequence_parallel_size (Ulysses)"),
    "warmup_ratio": mapped("model.warmup_ratio (transformers < 5's name)"),
    "overwrite_output_dir": mapped("nothing: <output_dir> is reused as it is (transformers < 5's flag)"),
    "print_config": mapped("prints the gym fit YAML of the run and exits (gym fit --config repeats it)"),
    "config": mapped("a YAML/JSON file of flags (TRL's --config; gym train FILE too); flags override it"),
    "max_prompt_length": mapped(
        "data.max_prompt_length in the preference stages: keep the last N prompt tokens (older TRL's field)"
    ),
}
DATACLASSES = (
    hf.ModelArguments,
    hf.DataArguments,
    GymTrainingArguments,
    TrlModelArguments,
    TrlDataArguments,
    PreferenceArguments,
    PeftScriptArguments,
    LlamaFactoryArguments,
    GymArguments,
)
# The sources' flags typed ``bool | None`` (None: "by the data", "the stage's"): a bare flag means True, as for bools.
OPTIONAL_BOOLS = frozenset(
    spec.name
    for cls in DATACLASSES
    if cls is not GymTrainingArguments  # HF's own flags parse as HfArgumentParser makes them
    for spec in dataclasses.fields(cls)
    if str(spec.type) == "bool | None"
)


class TrainArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` whose errors are one line (exit 2, as ``CommandParser``) and suggest the closest flag."""

    def __init__(self) -> None:
        super().__init__(DATACLASSES, prog="gym train", allow_abbrev=False)
        for action in self._actions:
            if action.dest == "report_to":  # a list in HF's docs, but a plain str field for argparse
                action.nargs = "+"
            if action.dest in OPTIONAL_BOOLS and action.option_strings:
                action.nargs, action.const = "?", True
            if action.dest == "stage":  # the stage table's rows (read now: a row added later is a choice too)
                action.choices = list(STAGES)
        self.add_argument(
            "--config",
            help="A YAML/JSON file of flags (TRL's --config; `gym train FILE` too); flags given here override it.",
        )
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

    def key_destinations(self) -> dict[str, str]:
        """Every name a config file key may use (a flag without its dashes) -> the argument it sets."""
        names: dict[str, str] = {}
        for action in self._actions:
            # --no_X flags (store_false) set X to False: a key "no_X: true" is not a name of X.
            if isinstance(action, (argparse._HelpAction, argparse._StoreFalseAction)) or action.dest == "config":
                continue
            names |= {flag.lstrip("-"): action.dest for flag in action.option_strings}
        return names

    def set_config_defaults(self, values: Mapping[str, Any], source: str) -> list[str]:
        """The file's values as the arguments' defaults (TRL's ``set_defaults_with_config``: flags given on the
        command line then override them); returns a problem per key that is no flag or sets an argument twice."""
        names, problems = self.key_destinations(), []
        chosen: dict[str, str] = {}  # argument -> the key that set it
        for key, value in values.items():
            dest = names.get(str(key))
            if dest is None and (row := LLAMA_FACTORY_KEYS.get(str(key))) is not None:
                if not row.takes(value, row.default):  # an LLaMA-Factory key that is no flag here
                    problems.append(
                        f"{source}: {key} {value!r} is not supported: {row.note}; leave it at {row.default!r}."
                    )
            elif dest is None:
                hint = _suggestion(f"--{key}", self.valid_flags()).replace("; did you mean --", "; did you mean ")
                problems.append(f"{source}: {key} is not a gym train flag{hint}")
            elif dest in chosen:
                problems.append(f"{source}: {chosen[dest]} and {key} both set {dest}; keep one.")
            else:
                chosen[dest] = key
                self.set_defaults(**{dest: value})
        for action in self._actions:
            if action.dest in chosen:
                action.required = False
        return problems


def _suggestion(flag: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(flag, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""


def build_parser() -> TrainArgumentParser:
    """The ``gym train`` flags: every ``TrainingArguments`` field (HF's names, types, defaults) and the sources'."""
    return TrainArgumentParser()


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """All flags as one namespace: from the command line, over a ``.yaml``/``.yml``/``.json`` file given with
    ``--config FILE`` or first (HF and TRL style). Problems of the file's keys are kept in ``config_problems`` for
    ``problems.flag_problems``, so that one message lists them with the refused flags."""
    parser = build_parser()
    argv, config = _config_file(list(argv))
    problems = parser.set_config_defaults(_read_config(config), config) if config else []
    args = parser.parse_args(argv)
    args.config, args.config_problems = config, problems
    if args.splits:  # PEFT's script: "train,test" names the training split, then the validation one
        names = [name.strip() for name in args.splits.split(",") if name.strip()]
        args.dataset_train_split = names[0] if names else args.dataset_train_split
        args.dataset_test_split = names[1] if len(names) > 1 else args.dataset_test_split
    return args


def _config_file(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without its config file, and that file: ``--config FILE``, ``--config=FILE`` or a first argument."""
    files = [argv.pop(0)] if argv and not argv[0].startswith("-") and argv[0].endswith(CONFIG_SUFFIXES) else []
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            files.append(argv[index + 1])
            del argv[index : index + 2]
            break
        if arg.startswith("--config="):
            files.append(argv.pop(index).split("=", 1)[1])
            break
    if len(files) > 1:
        raise GymUserError(f"gym train: two config files ({files[0]}, {files[1]}); give one (flags override it).")
    return argv, files[0] if files else None


def _read_config(path: str) -> dict[str, Any]:
    """The keys of a YAML or JSON config file; TRL's ``env`` mapping is set in the environment (as TRL does)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:  # missing, unreadable or malformed
        raise GymUserError(f"gym train {path}: {' '.join(str(err).split())}") from err
    if not isinstance(values, dict):
        raise GymUserError(f"gym train {path}: the file must hold a mapping of flag names to values.")
    env = values.pop("env", None) or {}
    if not isinstance(env, dict):
        raise GymUserError(f"gym train {path}: env must be a mapping of variable names to values.")
    os.environ.update({str(key): str(value) for key, value in env.items()})
    return values


def parser_defaults() -> dict[str, Any]:
    """What the parser yields for each argument when no flag is given (argparse passes string defaults through
    ``type``, so a field's default and the parser's can differ: debug None vs "")."""
    return vars(build_parser().parse_args(["--model_name_or_path", "-"]))


__all__ = [
    "DATACLASSES",
    "GYM",
    "LLAMA_FACTORY_KEYS",
    "OPTIONAL_BOOLS",
    "GymArguments",
    "TrainArgumentParser",
    "build_parser",
    "parse_train_args",
    "parser_defaults",
]
