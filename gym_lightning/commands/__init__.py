"""The commands beside LightningCLI's ``fit``/``validate``/``test``/``predict``, in one place.

Each is a module with ``main(argv)``, imported only when its command runs (``gym_lightning.cli`` dispatches):

- ``gym train`` (:mod:`~gym_lightning.commands.train`): Hugging Face Trainer flags, run as ``gym fit``;
- ``gym plan`` (:mod:`~gym_lightning.commands.plan`): memory per rank before launching;
- ``gym export`` (:mod:`~gym_lightning.commands.export`): a Hugging Face folder from a checkpoint.

Their argument parsers are ``CommandParser``: a bad flag ends in one line and exit status 2, like every user error.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

# name -> ("module:function" taking the remaining arguments, the line ``gym --help`` shows).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("gym_lightning.commands.train:main", "train with Hugging Face Trainer flags (--deepspeed ds.json, ...)"),
    "plan": ("gym_lightning.commands.plan:main", "predict memory per rank of a model/strategy before launching"),
    "export": ("gym_lightning.commands.export:main", "write a Hugging Face folder from a checkpoint"),
}


class CommandParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``gym_lightning: error: gym CMD: ...``) with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gym_lightning: error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


__all__ = ["COMMANDS", "CommandParser"]
