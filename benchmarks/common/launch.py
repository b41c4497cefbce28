"""Starting the processes a benchmark measures: free ports, child processes that import this working tree (or another
tree under test), ``torchrun`` launches of N CPU ranks, and gloo ranks spawned from a function.

Every child runs as ``python -m MODULE`` with the repository root on ``PYTHONPATH`` (``child_env``): that is how
``benchmarks`` and the working tree's ``gym_lightning`` are found, with no ``sys.path`` edit in any benchmark.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.paths import REPO_ROOT


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(*trees: str | Path, threads: int | None = 1, **extra: str) -> dict[str, str]:
    """``os.environ`` for a child process: ``trees`` (default: this repository) first on ``PYTHONPATH``, then what
    was there; ``threads`` intra-op threads (``OMP_NUM_THREADS``; ``None`` leaves it as it is), quiet tokenizers and
    warnings, unbuffered output; ``extra`` last.

    A tree other than this repository is a tree under test (an older commit): its ``gym_lightning`` comes first,
    and this repository follows it so that ``benchmarks`` still imports (an older tree has no ``benchmarks``
    package, and a folder without ``__init__.py`` never shadows one that has it).
    """
    paths = [str(tree) for tree in trees or (REPO_ROOT,)]
    if str(REPO_ROOT) not in paths:
        paths.append(str(REPO_ROOT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def python_module(module: str, *args: str | Path) -> list[str]:
    """``python -m MODULE ARGS`` with this interpreter (run it with ``cwd=REPO_ROOT`` and ``child_env()``)."""
    return [sys.executable, "-m", module, *map(str, args)]


def torchrun_command(nproc: int, module: str, *args: str | Path) -> list[str]:
    """``torchrun`` of ``python -m MODULE ARGS`` on ``nproc`` local ranks, rendezvous on a free local port."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc)]
    launch += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [*launch, "-m", module, *map(str, args)]


def spawn_gloo(worker: Callable[..., Any], nprocs: int, args: Sequence[Any] = ()) -> None:
    """``worker(rank, port, *args)`` in ``nprocs`` spawned processes that share a free port (each initialises its
    own gloo group on ``127.0.0.1:port``); returns when all ended, raises if one failed."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(free_port(), *args), nprocs=nprocs, join=True)


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """The process group of a spawned rank (``spawn_gloo``): gloo on ``127.0.0.1:port``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
