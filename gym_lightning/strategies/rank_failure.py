"""When a collective fails because a rank stopped answering or died: name the ranks, end what cannot end itself.

A rank that stops (SIGSTOP, a GPU hang, a node that drops off the network) leaves the others waiting in a
collective until the process group's timeout. Gloo's error then names no rank ("Timed out waiting 30000ms for
recv operation"), the job exits non-zero, and the stopped process stays where it is, holding its memory (and on a GPU
node its device): Lightning's launcher kills its child processes only on Ctrl-C, torchrun's agent only kills workers
on its own node, nothing stops a rank on another node. ``RankWatch`` runs beside every gym_lightning strategy:

- at set-up, once: a separate gloo process group for the roll call below (whatever the main backend, so it also
  works beside NCCL) and every rank's process identity (host, pid, start time), one ``all_gather_object``;
- when a collective raises on a rank (``is_collective_failure``), a roll call on that group: each live rank reports
  to rank 0 within ``roll_call_seconds`` (the collective timeout, at most 30 s); rank 0 answers each of them with the
  list of ranks that arrived. The ranks that did not arrive are the stopped or dead ones, with their state read on
  their host (``psutil``: stopped, exited, running);
- the lowest rank that arrived on each host kills (SIGKILL) that host's ranks that did not, checking the pid's start
  time first so that a reused pid is never hit; every process of the job on a host with a live rank ends;
- the exception gets a note (``add_note``, PEP 678) with one line: the ranks that did not arrive, the collective and
  the line that waited in it, and what to do. ``gym fit``/``gym train`` print that line alone and exit with status 1
  (the traceback with ``GYM_DEBUG=1``), and bound the exit (``exit_within``): a process group whose peer vanished can
  block in its destructor.

Why not ``torch.distributed.monitored_barrier``: it names the ranks that did not reach it only while they are alive;
for a rank that died it raises gloo's "Connection closed by peer [127.0.0.1]:6534", naming an address (measured
here, torch 2.13). The roll call is point-to-point sends and receives on the same gloo transport, a rank each.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gym_lightning._compat import set_collective_timeout
from gym_lightning.strategies._common import leave_process_group_at_exit

ROLL_CALL_SECONDS = 30.0  # longest wait for the other live ranks (they time out at about the same moment)
NOTE_PREFIX = "gym_lightning: "  # the note this module adds begins so; the command line prints it alone
QUIET_PREFIX = "gym_lightning (reported by rank 0): "  # a rank with nothing to add: the command line prints nothing
# Messages of a collective that failed because of another rank: gloo's timeout, a peer that closed its connection
# (it died), NCCL's watchdog. Everything else (a bug, out of memory) is left alone.
_FAILURE_PATTERNS = re.compile(
    r"Timed out waiting|timed out|Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"Watchdog caught collective operation timeout"
)
_C10D_FILES = ("torch/distributed/distributed_c10d.py",)


@dataclass(frozen=True)
class RankProcess:
    """Which process a rank is: enough to find it on its host and to know it is still the same process."""

    host: str
    pid: int
    started: float  # psutil's create_time: a pid reused by another process has another one


def this_process() -> RankProcess:
    import psutil

    return RankProcess(socket.gethostname(), os.getpid(), psutil.Process().create_time())


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed because of another rank (a timeout or a lost peer)."""
    return isinstance(exception, RuntimeError) and (
        isinstance(exception, dist.DistError) or bool(_FAILURE_PATTERNS.search(str(exception)))
    )


def failed_collective(exception: BaseException) -> str:
    """Where ``exception`` was raised: the innermost ``torch.distributed`` function (else the innermost frame) and
    the nearest line outside torch that led there (``all_reduce, called from gym_lightning/module.py:232 in
    _start_step_token_count``)."""
    frames = traceback.extract_tb(exception.__traceback__)
    if not frames:
        return "a collective"
    c10d = [i for i, frame in enumerate(frames) if _path(frame).endswith(_C10D_FILES[0])]
    op = c10d[-1] if c10d else len(frames) - 1
    # The caller to name: the nearest frame outside torch and Lightning (the module's, DeepSpeed's, the user's).
    callers = [frame for frame in frames[:op] if not any(part in _path(frame) for part in ("/torch/", "/lightning/"))]
    inner = frames[op]
    if "/torch/" not in _path(inner):
        return f"the collective awaited at {_short(inner)}"
    where = f", called from {_short(callers[-1])}" if callers else ""
    place = "" if c10d else f" ({_short(inner).rsplit(' in ', 1)[0]})"
    return f"{inner.name}{place}{where}"


def _path(frame: traceback.FrameSummary) -> str:
    return frame.filename.replace(os.sep, "/")


def _short(frame: traceback.FrameSummary) -> str:
    path = _path(frame)
    for marker in ("/site-packages/", "/gym_lightning/"):
        if marker in path:
            path = ("gym_lightning/" if marker == "/gym_lightning/" else "") + path.rsplit(marker, 1)[1]
            break
    return f"{path}:{frame.lineno} in {frame.name}"


def process_state(process: RankProcess) -> str:
    """What became of a rank's process, seen from its host: stopped, exited, a zombie, running, ..."""
    import psutil

    try:
        found = psutil.Process(process.pid)
        if abs(found.create_time() - process.started) > 1e-3:
            return "exited"
        status = found.status()
    except psutil.NoSuchProcess:
        return "exited"
    except psutil.Error:
        return "in an unknown state"
    return {psutil.STATUS_STOPPED: "stopped (SIGSTOP)", psutil.STATUS_ZOMBIE: "exited"}.get(status, status)


def kill_if_same(process: RankProcess) -> bool:
    """SIGKILL ``process`` if it is still the process the rank was (same pid and start time); True if it was."""
    if process_state(process) == "exited":
        return False
    try:
        os.kill(process.pid, signal.SIGKILL)  # also ends a stopped process
    except ProcessLookupError:
        return False
    return True


class RankWatch:
    """Roll call, diagnosis and clean-up of a failed collective (see the module docstring). Collective to build."""

    def __init__(self, timeout: timedelta | None) -> None:
        wait = min(ROLL_CALL_SECONDS, timeout.total_seconds() if timeout is not None else ROLL_CALL_SECONDS)
        self.roll_call_seconds = max(1.0, wait)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.roll_call_seconds))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.processes: list[RankProcess] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(self.processes, this_process())
        self.timeout = timeout

    def diagnose(self, exception: BaseException) -> str | None:
        """After a failed collective: the roll call, the kills, and the note for ``exception`` (``None`` when it is
        not a failed collective). Rank 0 says which ranks did not arrive; the others' note is ``QUIET_PREFIX``
        (nothing to add), unless rank 0 itself did not answer: then the lowest rank of each host says so."""
        if not is_collective_failure(exception):
            return None
        answer = self._roll_call()
        arrived = answer if answer is not None else [rank != 0 for rank in range(self.world_size)]
        missing = [rank for rank, present in enumerate(arrived) if not present]
        states = {rank: process_state(self.processes[rank]) for rank in missing if self._is_local(rank)}
        killed = self._end_missing_local_ranks(arrived)
        if self.rank == 0 or (answer is None and self._lowest_arrived_on_host(arrived)):
            return self._message(exception, missing, states, killed)
        return f"{QUIET_PREFIX}rank {self.rank}: a collective failed; rank 0 says which ranks did not arrive."

    def _roll_call(self) -> list[bool] | None:
        """Rank 0: which ranks reported within the wait (and tell each of them); other ranks: rank 0's answer,
        ``None`` if rank 0 did not give one."""
        if self.rank != 0:
            try:
                dist.send(torch.tensor([self.rank]), dst=0, group=self.group)
                answer = torch.zeros(self.world_size, dtype=torch.int8)
                dist.recv(answer, src=0, group=self.group)
            except RuntimeError:
                return None
            return [bool(value) for value in answer.tolist()]
        works = {}
        for rank in range(1, self.world_size):
            try:  # a rank that died: its connection is closed, and receiving from it fails at once
                works[rank] = dist.irecv(torch.zeros(1, dtype=torch.long), src=rank, group=self.group)
            except RuntimeError:
                continue
        arrived = [True] + [False] * (self.world_size - 1)
        for rank, work in works.items():
            try:
                work.wait()
                arrived[rank] = True
            except RuntimeError:
                continue
        answer = torch.tensor(arrived, dtype=torch.int8)
        for rank in (rank for rank, present in enumerate(arrived) if present and rank != 0):
            try:
                dist.send(answer, dst=rank, group=self.group)
            except RuntimeError:
                continue
        return arrived

    def _is_local(self, rank: int) -> bool:
        return self.processes[rank].host == self.processes[self.rank].host

    def _lowest_arrived_on_host(self, arrived: list[bool]) -> bool:
        local = [rank for rank in range(self.world_size) if self._is_local(rank) and arrived[rank]]
        return bool(local) and min(local) == self.rank

    def _end_missing_local_ranks(self, arrived: list[bool]) -> list[int]:
        """The lowest arrived rank on this host kills this host's ranks that did not arrive; returns them."""
        if not self._lowest_arrived_on_host(arrived):
            return []
        local = [rank for rank in range(self.world_size) if self._is_local(rank)]
        return [rank for rank in local if not arrived[rank] and kill_if_same(self.processes[rank])]

    def _message(self, exception: BaseException, missing: list[int], states: dict[int, str], killed: list[int]) -> str:
        where = failed_collective(exception)
        timed_out = "timed out" in str(exception).lower() and self.timeout is not None
        if timed_out:
            waited = f"rank {self.rank} waited {self.timeout} (the collective timeout) in {where}"
        else:
            waited = f"rank {self.rank}'s {where} failed ({_first_line(exception)[:160]})"
        if not missing:
            return (
                f"{NOTE_PREFIX}a collective failed on rank {self.rank} ({where}) but every rank answered the roll "
                f"call afterwards: {_first_line(exception)}"
            )
        described = [f"rank {rank} ({self._describe(rank, states, killed)})" for rank in missing]
        return (
            f"{NOTE_PREFIX}{', '.join(described)} did not arrive: {waited}. The job "
            "stops; checkpoints already written are intact: fix or replace the node, then resume with --ckpt_path "
            "last. A rank that needs longer (a slow first data preparation or checkpoint save) needs a larger "
            "strategy timeout (trainer.strategy.init_args.timeout; gym train: --ddp_timeout)."
        )

    def _describe(self, rank: int, states: dict[int, str], killed: list[int]) -> str:
        process = self.processes[rank]
        place = f"pid {process.pid} on {process.host}"
        if rank not in states:
            return f"{place}, another host: end it there if it is still running"
        return f"{place}, {states[rank]}{', killed' if rank in killed else ''}"


def _first_line(exception: BaseException) -> str:
    return next((line.strip() for line in str(exception).splitlines() if line.strip()), type(exception).__name__)


def report_rank_failure(watch: RankWatch | None, exception: BaseException) -> None:
    """A strategy's ``on_exception``: diagnose a failed collective and attach the line to ``exception``. Never raises
    (it runs while an exception is already on its way out)."""
    if watch is None:
        return
    try:
        line = watch.diagnose(exception)
    except Exception as err:  # the diagnosis must not hide the original error
        line = f"{NOTE_PREFIX}could not tell which rank failed ({type(err).__name__}: {err})"
    if is_collective_failure(exception):
        leave_process_group_at_exit()  # its peers are gone: destroying it at exit could block
    if line is not None:
        exception.add_note(line)


def rank_failure_line(exception: BaseException) -> str | None:
    """The note ``report_rank_failure`` attached to ``exception`` (or to what it was raised from), if any: a line
    to print, or (``QUIET_PREFIX``) one to keep quiet about."""
    seen: set[int] = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for note in getattr(current, "__notes__", ()):
            if isinstance(note, str) and note.startswith((NOTE_PREFIX, QUIET_PREFIX)):
                return note
        current = current.__cause__ or current.__context__
    return None


def exit_within(seconds: float, status: int) -> None:
    """End the process with ``status`` after ``seconds`` unless it has ended by then (a daemon thread): the exit
    of a process whose collective peers vanished can block in the process group's destructor."""

    def hard_exit() -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(status)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True
    timer.start()


def watch_collectives(timeout: timedelta | None, groups: Iterable[Any] = ()) -> RankWatch | None:
    """Right after a strategy's process group is up: its collectives (and ``groups``') time out after ``timeout``,
    and a multi-rank job gets its ``RankWatch`` (a collective); ``None`` for one process, where no peer can stop
    answering."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if timeout is not None:
        for group in (None, *groups):
            set_collective_timeout(timeout, group)
    return RankWatch(timeout) if torch.distributed.get_world_size() > 1 else None


__all__ = [
    "NOTE_PREFIX",
    "QUIET_PREFIX",
    "ROLL_CALL_SECONDS",
    "RankProcess",
    "RankWatch",
    "exit_within",
    "failed_collective",
    "is_collective_failure",
    "process_state",
    "rank_failure_line",
    "report_rank_failure",
]
