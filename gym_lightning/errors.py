"""The one exception type for mistakes in what the user gave: settings, flags, files, checkpoints.

Every validation site raises ``GymUserError`` (directly for one problem, through ``raise_if_problems`` for a list),
so the command line can tell a user's mistake from a bug: ``gym_lightning.cli`` prints a ``GymUserError`` as one line
and exits with status 2, and lets every other exception keep its traceback. It subclasses ``ValueError`` so that
code catching ``ValueError`` around the Python API keeps working.

A message says what was wrong (naming the file, flag or value), what was expected, and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable


class GymUserError(ValueError):
    """A problem with the user's input (a setting, flag, file or checkpoint), with its fix in the message."""


class EveryRankError(GymUserError):
    """A user error that every rank of a job raises at the same point, after the ranks agreed on it (a damaged
    checkpoint file found by one rank): the command line prints it on global rank 0 only, once per job."""


def raise_if_problems(subject: str, problems: Iterable[str]) -> None:
    """Raise one ``GymUserError`` about ``subject`` that lists every problem; do nothing when there is none.

    ``subject`` names what was checked (``"Invalid ZeROStrategy configuration"``); each problem is one sentence
    that names the value and its fix. All problems come in one message so that a user fixes them in one go.
    """
    problems = [str(problem) for problem in problems]
    if not problems:
        return
    lines = "\n".join(f"  - {problem}" for problem in problems)
    raise GymUserError(f"{subject} ({len(problems)} problem(s)):\n{lines}")


__all__ = ["EveryRankError", "GymUserError", "raise_if_problems"]
