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
- ``cpu_info_once``: py-cpuinfo's ``get_cpu_info`` starts a new Python process at every call (its
  ``get_cpu_info_json``), and DeepSpeed calls it again and again in one process (each op builder's ``cpu_arch`` and
  ``simd_width``, so each op key of ``strategies.zero.ops``; each ``DeepSpeedCPUAdam``): several processes per rank
  at a ZeRO run's start (docs/benchmarks-history.md, "the test suite's time on 2 cores", what it cost). The first
  successful answer is kept for the process (the CPU does not change under it). Probe: :func:`cpu_info_spawns`.

Not here because they are not process-wide: DeepSpeed engines get a ``weights_only=True`` checkpoint loader
(``checkpointing.safe_load.use_weights_only_engine``) and ZeRO-3's module trace fix (``strategies.zero.trace``, with
its own probe), per engine, when a strategy builds one.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
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


def cpu_info_spawns() -> bool:
    """The probe of :func:`query_cpu_info_once`: whether py-cpuinfo is installed and its ``get_cpu_info_json`` (the
    unpatched one of this process) still starts a process at every call instead of keeping its answer."""
    if importlib.util.find_spec("cpuinfo") is None:
        return False
    from cpuinfo import cpuinfo

    query = getattr(cpuinfo.get_cpu_info_json, "__wrapped__", cpuinfo.get_cpu_info_json)
    return "Popen" in inspect.getsource(query) and not hasattr(query, "cache_info")


def cpu_info_queried_once() -> bool:
    """Whether :func:`query_cpu_info_once` has been applied in this process."""
    if importlib.util.find_spec("cpuinfo") is None:
        return False
    from cpuinfo import cpuinfo

    return getattr(cpuinfo.get_cpu_info_json, "_gym_once", False)


def query_cpu_info_once() -> None:
    """Keep py-cpuinfo's first successful answer for the process (idempotent). ``get_cpu_info`` reads the module's
    ``get_cpu_info_json`` at each call, so replacing that one serves every ``from cpuinfo import get_cpu_info``."""
    from cpuinfo import cpuinfo

    if cpu_info_queried_once():
        return
    query = cpuinfo.get_cpu_info_json
    kept: list[str] = []

    @functools.wraps(query)
    def get_cpu_info_json() -> str:
        if not kept:
            answer = query()
            if answer == "{}":  # the child failed: py-cpuinfo's own failure value, asked again next time
                return answer
            kept.append(answer)
        return kept[0]

    get_cpu_info_json._gym_once = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info_json = get_cpu_info_json


PATCHES: tuple[Patch, ...] = (
    Patch(
        "lightning_log_device_walk",
        needed=result_moves_walk_when_nothing_moves,
        applied=result_moves_patched,
        apply=skip_same_device_result_moves,
    ),
    Patch("cpu_info_once", needed=cpu_info_spawns, applied=cpu_info_queried_once, apply=query_cpu_info_once),
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


__all__ = ["PATCHES", "Patch", "apply_patches", "cpu_info_queried_once", "cpu_info_spawns", "query_cpu_info_once"]
