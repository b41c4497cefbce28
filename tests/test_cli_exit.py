"""A command that finished ends its process with its own status, even where the interpreter's finalisation would
abort: ``cli.end_process`` (the product's exit path, ``gym fit`` / ``gym train`` on CPU ranks).

gloo's C++ threads can outlive their process group and abort the process while the interpreter finalises ("terminate
called without an active exception", exit -6) after a run that succeeded, now and then (pytorch #179291). That
race cannot be had on demand, so the child process here holds an object whose finaliser aborts the process, as
those threads do, in a module's globals, where only the finalisation reaches it. Beside it: an ``atexit``
handler (a logger's flush) and a non-daemon thread still writing (a writer thread) that must both finish before
the process ends, an idle ``ThreadPoolExecutor`` (torch inductor compiles through one; its workers end only when
``concurrent.futures``' exit callback stops them, which the interpreter runs before it joins threads: joining first
waited forever), and a 1-rank gloo process group, which is what makes ``end_process`` take over. The 20-run loop of
real 2-rank ``gym fit`` runs is ``benchmarks/exit_loop.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.dist import free_port, rank_env

from gym_lightning import _compat

CHILD = """
import atexit, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from gym_lightning import cli

out = Path(sys.argv[1])


class AbortsWhenFinalised:  # what gloo's threads do to a finalising interpreter
    def __del__(self, abort=os.abort):  # bound now: finalisation may have cleared the module's globals by then
        abort()


ABORTER = AbortsWhenFinalised()
atexit.register(lambda: (out / "atexit").write_text("flushed"))


def command(args, from_sys_argv):  # a command that trains on a process group, then returns: it succeeded
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    writer = threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done")))
    writer.start()
    global EXECUTOR  # kept, as inductor keeps its pool: an executor collected earlier stops its workers itself
    EXECUTOR = ThreadPoolExecutor(2)
    EXECUTOR.submit(print, "trained", flush=True).result()  # its worker threads stay, idle
    if args[0] == "refused":
        raise cli.GymUserError("a user error")


cli._dispatch = command
sys.argv = ["gym", sys.argv[2]]
cli.main()
"""


def start_child(folder: Path, command: str) -> subprocess.Popen:
    folder.mkdir()
    script = folder / "child.py"
    script.write_text(textwrap.dedent(CHILD).replace("{port}", str(free_port())))
    return subprocess.Popen(
        [sys.executable, str(script), str(folder), command], env=rank_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_finished_command_exits_with_its_status_after_its_exit_handlers(tmp_path: Path) -> None:
    statuses = {"fit": 0, "refused": 2}  # a command that succeeded; one that refused the user's input
    children = {command: start_child(tmp_path / command, command) for command in statuses}  # side by side: 1 import
    for command, child in children.items():
        stdout, stderr = child.communicate(timeout=120)
        assert child.returncode == statuses[command], f"{command}: {stderr[-3000:]}"
        assert "trained" in stdout
        assert (tmp_path / command / "atexit").read_text() == "flushed"  # the loggers' atexit flushes ran
        assert (tmp_path / command / "thread").read_text() == "done"  # a writer thread was waited for


def test_the_exit_handlers_runner_exists_upstream() -> None:
    import atexit
    import threading

    assert callable(getattr(atexit, "_run_exitfuncs", None)) and callable(getattr(threading, "_shutdown", None))
    assert callable(_compat.run_exit_handlers) and callable(_compat.stop_threads_as_at_exit)
