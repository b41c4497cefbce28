"""Run a whole multi-process job in its own process group and tell which of its processes outlived it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from helpers.dist import REPO_ROOT, rank_env


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    leftovers: list[str]  # "pid (status)" of the job's processes still there after its main process ended

    def log(self) -> str:
        return f"\n--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}"


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def run_job(args: list[str], timeout: float, env: dict[str, str] | None = None, settle: float = 2.0) -> JobResult:
    """``python ARGS`` as the leader of a new process group (Lightning's launcher starts the other ranks in it).
    ``settle``: seconds to wait after the leader ended for processes it had told to stop. Whatever is still in
    the group afterwards is reported, then killed so that no test leaves a process behind."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=REPO_ROOT, env=env or rank_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[test] killed after {timeout} s"
    seconds = time.monotonic() - start
    deadline = time.monotonic() + settle
    while (members := group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = []
    for member in members:
        try:
            status = member.status()
            if status != psutil.STATUS_ZOMBIE:  # exited, not yet reaped (a container's init may never reap it)
                leftovers.append(f"{member.pid} ({status})")
                member.kill()
        except psutil.Error:
            continue
    return JobResult(proc.returncode, stdout, stderr, seconds, leftovers)
