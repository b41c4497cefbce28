"""Launch helpers for multi-rank CPU tests: free ports, one thread per rank, subprocesses with a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS = REPO_ROOT / "tests"
HELPERS = TESTS / "helpers"


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(**extra: str) -> dict[str, str]:
    """Environment for a child run: a fresh MASTER_PORT, 1 intra-op thread per rank, quiet third-party logs."""
    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore",
        # A rank that aborts in C++ (SIGABRT from gloo) lost its block-buffered output and said nothing of where it
        # was: unbuffered output and faulthandler's stacks of every thread make such a failure readable.
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    env.update(extra)
    return env


def run_python(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python args...`` (from the repo root); on failure raise with the tail of its output."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env or rank_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"`python {' '.join(args)}` exited with {proc.returncode}\n"
            f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n--- stderr (tail) ---\n{proc.stderr[-8000:]}"
        )
    return proc


def run_ranks(
    args: list[str], timeout: float, env: dict[str, str] | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    """``python args...`` on ``nproc`` local ranks as torchrun starts them (from the repo root), forked from this
    worker's preloaded server (``helpers.zygote``: no rank pays the imports again). The output is every rank's,
    each line prefixed ``[rank<r>]``; if a rank fails, raise with the tail of it."""
    from helpers import zygote

    with tempfile.TemporaryDirectory(prefix="gym-ranks-") as logs:
        codes = zygote.run_ranks(args, env or rank_env(), REPO_ROOT, nproc, Path(logs), timeout)
        outs = [[Path(f).read_text(errors="replace") for f in zygote.rank_logs(Path(logs), r)] for r in range(nproc)]
    stdout, stderr = (
        "".join(f"[rank{r}] {line}\n" for r, o in enumerate(outs) for line in o[i].splitlines()) for i in (0, 1)
    )
    if any(code != 0 for code in codes):
        raise AssertionError(
            f"`python {' '.join(args)}` on {nproc} ranks exited with {codes} (-9: killed, after {timeout} s or once "
            f"another rank had failed)\n--- stdout (tail) ---\n{stdout[-4000:]}\n"
            f"--- stderr (tail) ---\n{stderr[-8000:]}"
        )
    return subprocess.CompletedProcess(args, 0, stdout, stderr)


def run_worker(spec: dict[str, Any], workdir: Path, timeout: float = 600) -> dict[str, Any]:
    """Run ``strategy_worker.py`` with ``spec`` on 2 ranks (:func:`run_ranks`) and return rank 0's results."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(workdir)}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    run_ranks([str(Path(__file__).with_name("strategy_worker.py")), str(spec_path)], timeout=timeout)
    return json.loads((workdir / "results.json").read_text())


def run_worker_two_nodes(spec: dict[str, Any], workdir: Path, timeout: float = 600) -> dict[str, Any]:
    """Run ``strategy_worker.py`` as 2 nodes x 1 process on loopback (Lightning's NODE_RANK/MASTER_* variables)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(workdir), "devices": 1, "num_nodes": 2}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = rank_env()
    script = str(Path(__file__).with_name("strategy_worker.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(spec_path)],
            cwd=REPO_ROOT,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:  # never leave a rank behind (e.g. its peer died and it waits in a collective)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        logs = [
            f"--- node {node} (exit {proc.returncode}) ---\n{output[-6000:]}"
            for node, (proc, output) in enumerate(zip(procs, outputs, strict=True))
        ]
        raise AssertionError("2-node run failed\n" + "\n".join(logs))
    return json.loads((workdir / "results.json").read_text())
