"""Run several short command lines of this repository's entry points, each in a process of its own, paying the
import of torch, Lightning and gym_lightning once: one interpreter imports them, then forks one child per command.

A plain subprocess per command spends ~6-8 s of its life importing (Lightning alone ~5 s on this 2-core machine);
``--help`` and a bad flag are answered in milliseconds after that. The child runs the command as ``python SCRIPT
ARGS`` or ``python -m MODULE ARGS`` would (``helpers.zygote.run_as_main``), with its own stdout, stderr and exit status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from helpers.dist import REPO_ROOT, rank_env

# Runs in the parent interpreter: argv[1] is a JSON list of commands, each ["-m", module, *args] or [script, *args].
DRIVER = r"""
import json, os, sys, tempfile
import torch, lightning.pytorch, gym_lightning  # the imports every command shares
from helpers.zygote import run_as_main
results = []
for command in json.loads(sys.argv[1]):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        code = 0
        try:
            run_as_main(command)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if not isinstance(exit.code, int | None):
                print(exit.code, file=sys.stderr)
        except BaseException:
            import traceback; traceback.print_exc(); code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0); err.seek(0)
    results.append([os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()])
print("FORKED-RESULTS" + json.dumps(results))
"""


@dataclass(frozen=True)
class Result:
    """What one command left: its exit status and its output."""

    returncode: int
    stdout: str
    stderr: str


def run_forked(commands: list[list[str]], timeout: float = 300) -> list[Result]:
    """Run ``commands`` (``["-m", "gym_lightning", "plan", ...]`` or ``["benchmarks/run.py", "--help"]``) from the
    repository root, one child process each, in order; returns their results in the same order."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands)],
        cwd=REPO_ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    marker = "FORKED-RESULTS"
    if proc.returncode != 0 or marker not in proc.stdout:
        raise AssertionError(
            f"the forking driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    rows = json.loads(proc.stdout.rsplit(marker, 1)[1])
    return [Result(*row) for row in rows]
