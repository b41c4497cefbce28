"""DeepSpeed's ops are built once per machine: the cache key names what an op is built from, never where."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.dist import REPO_ROOT

from gym_lightning.strategies.zero import ops


def _builder(root: Path, source_text: str = "int f() { return 1; }", header_text: str = "#define X 1") -> Any:
    """A stand-in for a DeepSpeed op builder whose sources live under ``root`` (one environment's site-packages)."""
    (root / "csrc" / "includes").mkdir(parents=True)
    (root / "csrc" / "op.cpp").write_text(source_text)
    (root / "csrc" / "includes" / "op.h").write_text(header_text)
    return SimpleNamespace(
        name="toy_op",
        sources=lambda: ["csrc/op.cpp"],
        include_paths=lambda: ["csrc/includes"],
        cxx_args=lambda: ["-O3", "-march=native"],
        extra_ldflags=lambda: [],
        strip_empty_entries=lambda args: [a for a in args if a],
        deepspeed_src_path=lambda path: str(root / path),
    )


def test_the_key_does_not_change_with_the_environment_path(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    here, there = ops.op_key(_builder(tmp_path / "venv-a")), ops.op_key(_builder(tmp_path / "elsewhere" / "venv-b"))
    assert here == there and here.startswith("toy_op-")


@pytest.mark.parametrize("changed", ["source", "header", "flags"])
def test_the_key_changes_with_what_the_op_is_built_from(tmp_path: Path, changed: str) -> None:
    pytest.importorskip("deepspeed")
    reference = ops.op_key(_builder(tmp_path / "a"))
    other = _builder(
        tmp_path / "b",
        source_text="int f() { return 2; }" if changed == "source" else "int f() { return 1; }",
        header_text="#define X 2" if changed == "header" else "#define X 1",
    )
    if changed == "flags":
        other.cxx_args = lambda: ["-O2", "-march=native"]
    assert ops.op_key(other) != reference


def test_what_a_zero_run_loads() -> None:
    assert ops.ops_needed("cpu", "torch", nvme=False) == [ops.SHM_COMM]
    assert ops.ops_needed("cpu", "deepspeed", nvme=True) == [ops.SHM_COMM, ops.CPU_ADAM, ops.ASYNC_IO]
    assert ops.ops_needed("cuda", "torch", nvme=False) == []
    # HF's ds_config_zero3.json: DeepSpeed makes its own CPU Adam for an offloaded "optimizer" block.
    hf_json = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert ops.ops_needed("cuda", "torch", nvme=False, config=hf_json) == [ops.CPU_ADAM]
    assert ops.ops_needed("cuda", "torch", nvme=False, config={**hf_json, "zero_optimization": {}}) == []


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ops.CACHE_ENV_VAR, str(tmp_path / "mine"))
    assert ops.cache_root() == tmp_path / "mine"
    monkeypatch.delenv(ops.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ops.cache_root() == tmp_path / "xdg" / "gym_lightning" / "deepspeed_ops"


@pytest.mark.slow
def test_a_built_op_is_loaded_from_the_cache_not_from_torchs_folder(tmp_path: Path) -> None:
    # The session's warm-up (conftest.py) built the op into the machine-wide cache. A new process whose torch
    # extensions folder is empty, as in a new virtual environment, loads it from there without building.
    pytest.importorskip("deepspeed")
    code = (
        "from gym_lightning.strategies.zero.ops import load_op\n"
        "module, how = load_op('ShareMemCommBuilder')\n"
        "print(how, module.__file__)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    how, library = proc.stdout.split()[-2:]
    assert how == "cached" and Path(library).is_relative_to(ops.cache_root())
    assert not (tmp_path / "empty").exists()
