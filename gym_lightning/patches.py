"""Every change gym_lightning makes to another library's behaviour for the whole process, applied in one place.

Importing gym_lightning changes nothing outside it (it only registers its strategy names and allow-lists its own
hyper-parameter classes for ``weights_only`` checkpoint loading: ``gym_lightning.registration``). What follows is
applied by :func:`apply_patches`, which the command line calls before it builds anything (``gym fit``, ``gym
train``); a Python user calls it once before ``Trainer.fit`` to get the same. Each patch has a probe that tells
whether the installed library still needs it, and is applied only where it does (tests/test_patches.py checks both
sides):

- ``lightning_log_device_walk``: Lightning rebuilds a logged value's metadata on every ``self.log`` even when nothing
  moves (``_compat.skip_same_device_result_moves`` has the upstream issue; docs/benchmarks-history.md, "Lightning's
  self.log device walk", what it cost). Probe: ``_compat.result_moves_walk_when_nothing_moves``.

Not here because they are not process-wide: DeepSpeed engines get a ``weights_only=True`` checkpoint loader
(``checkpointing.safe_load.use_weights_only_engine``) and ZeRO-3's module trace fix (``strategies.zero.trace``, with
its own probe), per engine, when a strategy builds one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gym_lightning._compat import (
    result_moves_patched,
    result_moves_walk_when_nothing_moves,
    skip_same_device_result_moves,
)


@dataclass(frozen=True)
class Patch:
    """A process-wide change: ``needed`` probes the installed library, ``applied`` says whether it is in place,
    ``apply`` puts it in place (idempotent)."""

    name: str
    needed: Callable[[], bool]
    applied: Callable[[], bool]
    apply: Callable[[], None]


PATCHES: tuple[Patch, ...] = (
    Patch(
        "lightning_log_device_walk",
        needed=result_moves_walk_when_nothing_moves,
        applied=result_moves_patched,
        apply=skip_same_device_result_moves,
    ),
)


def apply_patches() -> list[str]:
    """Apply every patch the installed libraries need (once per process); returns the names of those in place."""
    in_place = []
    for patch in PATCHES:
        if not patch.applied() and patch.needed():
            patch.apply()
        if patch.applied():
            in_place.append(patch.name)
    return in_place


__all__ = ["PATCHES", "Patch", "apply_patches"]
