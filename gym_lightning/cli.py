"""Command line: ``python -m gym_lightning {fit,validate,test,predict} --config ...`` (also installed as ``gym``).

``fit``/``validate``/``test``/``predict`` are a LightningCLI over ``CausalLMModule`` and ``CausalLMDataModule``.
Other commands (``gym train``, ...) live in their own modules, listed in ``COMMANDS`` and imported only when used.
Errors in the user's settings end the program with one readable line and a non-zero exit status, not a traceback.
"""

from __future__ import annotations

import importlib
import sys

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from gym_lightning.callbacks import HFExport, NonFiniteGuard
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.module import CausalLMModule, resolve_tokenizer_source
from gym_lightning.prediction_writer import JsonlPredictionWriter

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)

# Commands beside LightningCLI's subcommands: name -> "module:function" taking the remaining arguments.
COMMANDS: dict[str, str] = {
    "train": "gym_lightning.hf_train:main",
    "plan": "gym_lightning.planner.cli:main",
    "export": "gym_lightning.checkpointing.export:main",
}


class GymCLI(LightningCLI):
    """LightningCLI whose data module always tokenizes with the model's tokenizer."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One source of truth: the data module cannot be given a tokenizer that differs from the model's.
        parser.link_arguments(("model.model", "model.tokenizer"), "data.tokenizer", compute_fn=resolve_tokenizer_source)
        parser.link_arguments("model.trust_remote_code", "data.trust_remote_code")
        parser.add_lightning_class_args(HFExport, "export")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")

    def before_predict(self) -> None:  # LightningCLI calls ``before_<subcommand>`` hooks by name
        """``predict`` from the command line writes its completions to a file unless a writer is configured."""
        if not any(isinstance(callback, JsonlPredictionWriter) for callback in self.trainer.callbacks):
            self.trainer.callbacks.append(JsonlPredictionWriter())


def run_lightning_cli(args: list[str]) -> None:
    GymCLI(
        CausalLMModule,
        CausalLMDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``gym`` and ``python -m gym_lightning``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in COMMANDS:
            module_name, function = COMMANDS[args[0]].split(":")
            getattr(importlib.import_module(module_name), function)(args[1:])
        else:
            run_lightning_cli(args)
    except USER_ERRORS as err:
        print(f"gym_lightning: error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
