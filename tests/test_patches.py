"""Importing gym_lightning changes nothing in the process but registration; ``apply_patches`` applies each patch
once, only where its probe finds the installed library still needs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gym_lightning import _compat, patches

REPO = Path(__file__).resolve().parents[1]

# The third-party packages `import gym_lightning` imports: imported first by the probe, so that what they do to the
# process on import (transformers and datasets add warning filters, ...) is not counted as gym_lightning's.
THIRD_PARTY = """
import sys
before = set(sys.modules)
import gym_lightning
print(" ".join(sorted({m for m in set(sys.modules) - before if "." not in m and not m.startswith(("gym_", "_"))})))
"""
# What `import gym_lightning` may change, and what it may not, read in a fresh interpreter.
PROBE = """
import importlib, json, logging, os, sys, warnings
for name in sys.argv[1:]:
    importlib.import_module(name)
env, filters = dict(os.environ), list(warnings.filters)
loggers = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
move = _ResultMetric.to
import gym_lightning
import torch
from lightning.pytorch.strategies import StrategyRegistry
print(json.dumps({
    "environment": sorted(set(os.environ.items()) ^ set(env.items())),
    "warning_filters": len(warnings.filters) - len(filters),
    "log_filters": [len(logging.getLogger(name).filters) for name in loggers],
    "result_metric_to_patched": _ResultMetric.to is not move,
    "deepspeed_imported": "deepspeed" in sys.modules,
    "registered": sorted(n for n in StrategyRegistry.available_strategies() if n.startswith(("gym_", "zero"))),
    "safe_globals": sorted(c.__name__ for c in torch.serialization.get_safe_globals() if isinstance(c, type)),
}))
"""


def test_importing_gym_lightning_only_registers() -> None:
    third_party = subprocess.run([sys.executable, "-c", THIRD_PARTY], capture_output=True, text=True, cwd=REPO)
    assert third_party.returncode == 0, third_party.stderr[-2000:]
    names = third_party.stdout.split()
    assert "deepspeed" not in names
    proc = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True, text=True, cwd=REPO, check=True)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["environment"] == [] and seen["warning_filters"] == 0 and seen["log_filters"] == [0, 0]
    assert not seen["result_metric_to_patched"] and not seen["deepspeed_imported"]
    assert {"gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"} <= set(
        seen["registered"]
    )
    assert {"GenerationArgs", "LoRAArgs"} <= set(seen["safe_globals"])


def test_the_installed_lightning_still_needs_the_log_walk_patch() -> None:
    # When this fails, Lightning stopped rebuilding a logged value's metadata when nothing moves (its #20388 fix is
    # out): drop the patch (patches.PATCHES and _compat.skip_same_device_result_moves).
    assert _compat.result_moves_walk_when_nothing_moves()


def test_a_patch_is_applied_only_where_its_probe_finds_it_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    applied: list[str] = []
    state = {"applied": False}

    def apply() -> None:
        applied.append("x")
        state["applied"] = True

    fixed_upstream = patches.Patch(
        "fixed", needed=lambda: False, applied=lambda: False, apply=lambda: applied.append("!")
    )
    needed = patches.Patch("needed", needed=lambda: True, applied=lambda: state["applied"], apply=apply)
    monkeypatch.setattr(patches, "PATCHES", (fixed_upstream, needed))
    assert patches.apply_patches() == ["needed"]
    assert patches.apply_patches() == ["needed"]  # once per process
    assert applied == ["x"]


def test_the_probe_sees_an_upstream_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    def early_return(self: _ResultMetric, *args: object, **kwargs: object) -> _ResultMetric:
        return self  # what a fixed Lightning does when nothing moves

    monkeypatch.setattr(_ResultMetric, "to", early_return)
    assert not _compat.result_moves_walk_when_nothing_moves()


def test_the_installed_py_cpuinfo_still_starts_a_process_per_call() -> None:
    # When this fails, py-cpuinfo keeps its answer itself: drop the cpu_info_once patch.
    assert patches.cpu_info_spawns()


def test_deepspeed_s_op_builders_ask_py_cpuinfo_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpuinfo import cpuinfo
    from deepspeed.accelerator import get_accelerator

    answers = ['{"arch": "X86_64", "flags": ["avx2"]}']
    monkeypatch.setattr(cpuinfo, "get_cpu_info_json", lambda: answers.append(answers[0]) or answers[0])
    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    builder.cxx_args()  # its cpu_arch and simd_width: what strategies.zero.ops keys an op on
    assert len(answers) == 1 + 2  # without the patch, a process per question
    patches.query_cpu_info_once()
    builder.cxx_args()
    builder.cxx_args()
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]}
    assert len(answers) == 1 + 2 + 1 and patches.cpu_info_queried_once()


def test_a_failed_cpu_info_query_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpuinfo import cpuinfo

    answers = iter(["{}", '{"arch": "X86_64"}'])
    monkeypatch.setattr(cpuinfo, "get_cpu_info_json", lambda: next(answers))
    patches.query_cpu_info_once()
    assert cpuinfo.get_cpu_info() == {}  # py-cpuinfo's answer when its child process failed
    assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info() == {"arch": "X86_64"}
