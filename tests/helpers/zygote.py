"""Rank processes forked from a server that has already imported torch, Lightning, transformers, datasets, peft,
DeepSpeed and gym_lightning: a test launch of ``nproc`` ranks as torchrun starts them, without paying each rank's
imports again.

Why: every rank process of the suite spent ~6 s of CPU importing the same libraries before its first step (torch
~1.5 s, Lightning ~3 s with torch._dynamo and torchmetrics, datasets ~0.5 s; ``python -X importtime``), most of a
tiny run's cost, and the suite starts hundreds of them on 2 cores. Python's ``forkserver`` start method (the
server imports ``PRELOAD`` once per pytest worker; each rank is a ``fork`` of it) is what the standard library
offers for exactly this; torch's ``multiprocessing`` uses the same machinery.

Each rank is still a separate process with its own gloo process group, environment (torchrun's variables:
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID`` ... so Lightning sees a torchelastic launch and
starts no processes itself), working directory, ``sys.argv`` and output files. What it cannot re-read is what the
preloaded libraries took from the environment at import: the server starts with this worker's environment (one
intra-op thread) and the launches that use it change nothing read at import. Real launchers stay covered where they
are the subject: torchrun (tests/commands/test_train.py, tests/checkpointing/test_elastic.py,
tests/commands/test_launch_lines.py, tests/test_host_syncs.py), Lightning's own launcher (the SIGKILLed runs, the
rank failure and damaged-checkpoint tests, ``gym train --devices 2``) and ``gym ...`` as a subprocess
(tests/test_cli.py, the notebooks).
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import time
import uuid
import warnings
from pathlib import Path

PRELOAD = ("torch", "lightning.pytorch", "transformers", "datasets", "peft", "deepspeed", "gym_lightning.cli")
_STARTED: list[multiprocessing.context.BaseContext] = []


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context of this process, its server started with ``PRELOAD`` imported (once)."""
    if not _STARTED:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by OpenMP when torch loads: one thread per rank, as rank_env
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _STARTED.append(ctx)
    return _STARTED[0]


def torchrun_env(env: dict[str, str], rank: int, nproc: int, run_id: str) -> dict[str, str]:
    """What torchrun's agent sets for local rank ``rank`` of ``nproc`` on one node (rank 0 hosts the store)."""
    return {
        **env,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }  # fmt: skip


def _rank_main(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In the forked rank: its output files, environment and directory, then ``argv`` (:func:`run_as_main`)."""
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # PYTHONUNBUFFERED's effect
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    faulthandler.enable()  # PYTHONFAULTHANDLER's effect: a rank that aborts in C++ still shows its stacks
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    try:
        run_as_main(argv)
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit does; multiprocessing ends its children with os._exit


def run_as_main(argv: list[str]) -> None:
    """Run ``python ARGV`` in this process, as ``__main__``: ``argv[0]`` a script's path, or ``-m`` and a module name
    (also the forked commands of ``helpers.forked``)."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` puts the script's folder
        runpy.run_path(argv[0], run_name="__main__")


def run_ranks(argv: list[str], env: dict[str, str], cwd: Path, nproc: int, logs: Path, timeout: float) -> list[int]:
    """``python ARGV`` as ``nproc`` torchrun-style local ranks forked from the server; waits for all of them (a rank
    still there at ``timeout`` is killed, as is every other rank once one has failed) and returns their exit codes.
    Rank ``r`` writes ``logs/rank<r>.out`` and ``logs/rank<r>.err``."""
    logs.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    ranks = []
    for rank in range(nproc):
        args = (argv, torchrun_env(env, rank, nproc, run_id), str(cwd), *rank_logs(logs, rank))
        ranks.append(context().Process(target=_rank_main, args=args, name=f"rank{rank}"))
        ranks[-1].start()
    deadline = time.monotonic() + timeout
    while any(rank.is_alive() for rank in ranks) and time.monotonic() < deadline:
        if any(rank.exitcode not in (None, 0) for rank in ranks):  # torchrun stops the others when one fails
            break
        time.sleep(0.2)
    for rank in ranks:
        if rank.is_alive():
            rank.kill()
        rank.join()
    return [rank.exitcode for rank in ranks]


def rank_logs(logs: Path, rank: int) -> tuple[str, str]:
    """Where rank ``rank`` of a :func:`run_ranks` launch writes its stdout and stderr."""
    return str(logs / f"rank{rank}.out"), str(logs / f"rank{rank}.err")
