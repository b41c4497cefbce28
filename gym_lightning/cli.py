"""Command line: ``python -m gym_lightning {fit,validate,test,predict} --config ...`` (also installed as ``gym``).

A LightningCLI over ``CausalLMModule`` and ``CausalLMDataModule``. Errors in the user's settings end the program
with one readable line and a non-zero exit status instead of a traceback.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.module import CausalLMModule, resolve_tokenizer_source

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)


class GymCLI(LightningCLI):
    """LightningCLI whose data module always tokenizes with the model's tokenizer."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One source of truth: the data module cannot be given a tokenizer that differs from the model's.
        parser.link_arguments(("model.model", "model.tokenizer"), "data.tokenizer", compute_fn=resolve_tokenizer_source)
        parser.link_arguments("model.trust_remote_code", "data.trust_remote_code")


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
        run_lightning_cli(args)
    except USER_ERRORS as err:
        print(f"gym_lightning: error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
