"""scripts/bootstrap.sh reuses an up-to-date .venv without touching the network, and rebuilds a stale one.

Each test runs the script in a temporary copy of the repository's requirement files, with a fake .venv whose python
only answers ``-c`` and with ``python3``, ``pip`` and ``apt-get`` on PATH replaced by stubs that record being called
and fail: nothing is installed or downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STUB = '#!/usr/bin/env bash\necho "$0 $*" >> "{log}"\nexit {code}\n'


def _stub(path: Path, log: Path, code: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STUB.format(log=log, code=code))
    path.chmod(0o755)


def _copy(tmp_path: Path) -> Path:
    """A repository copy with the script and the files its stamp hashes, a fake .venv, and stubbed tools."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/bootstrap.sh", "setup.cfg", "pyproject.toml"):
        shutil.copy(REPO_ROOT / name, repo / name)
    calls = tmp_path / "calls.log"
    _stub(repo / ".venv" / "bin" / "python", calls, 0)
    for tool in ("python3", "pip", "apt-get"):
        _stub(tmp_path / "bin" / tool, calls, 1)
    _stub(tmp_path / "bin" / "dpkg", calls, 0)  # "libaio-dev is installed": no apt-get from the test
    return repo


def _bootstrap(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{repo.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "scripts/bootstrap.sh", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )


def _write_matching_stamp(repo: Path) -> None:
    stamp = _bootstrap(repo, "--print-stamp")
    assert stamp.returncode == 0, stamp.stderr
    assert len(stamp.stdout.strip()) == 64  # a sha256
    (repo / ".venv" / ".bootstrap-stamp").write_text(stamp.stdout)


def test_up_to_date_venv_is_reused_within_seconds(tmp_path: Path) -> None:
    repo = _copy(tmp_path)
    _write_matching_stamp(repo)
    start = time.monotonic()
    proc = _bootstrap(repo)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 10
    assert "reusing" in proc.stdout
    calls = (tmp_path / "calls.log").read_text().splitlines()
    # the only thing it ran: no install
    assert calls == [".venv/bin/python -c import torch, importlib.metadata as m; m.version('gym-lightning')"]
    assert (repo / ".venv" / "bin" / "python").exists()


def test_changed_requirements_or_torch_spec_rebuild(tmp_path: Path) -> None:
    repo = _copy(tmp_path)
    _write_matching_stamp(repo)
    before = _bootstrap(repo, "--print-stamp").stdout
    assert _bootstrap(repo, "--torch", "torch==2.12.0", "--print-stamp").stdout != before
    with (repo / "setup.cfg").open("a") as file:
        file.write("\n# a new requirement\n")
    assert _bootstrap(repo, "--print-stamp").stdout != before
    proc = _bootstrap(repo)  # stale stamp: deletes .venv and calls python3 -m venv (the stub fails)
    assert proc.returncode != 0
    assert "-m venv .venv" in (tmp_path / "calls.log").read_text()
    assert not (repo / ".venv").exists()


def test_broken_venv_with_matching_stamp_is_rebuilt(tmp_path: Path) -> None:
    repo = _copy(tmp_path)
    _write_matching_stamp(repo)
    _stub(repo / ".venv" / "bin" / "python", tmp_path / "calls.log", 1)  # `import gym_lightning, torch` fails
    proc = _bootstrap(repo)
    assert proc.returncode != 0 and "reusing" not in proc.stdout
    assert "-m venv .venv" in (tmp_path / "calls.log").read_text()
