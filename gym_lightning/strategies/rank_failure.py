"""When a collective fails because a rank stopped answering or died: name the ranks, end what cannot end itself.

A rank that stops (SIGSTOP, a GPU hang, a node that drops off the network) leaves the others waiting in a
collective until the process group's timeout. Gloo's error then names no rank ("Timed out waiting 30000ms for
recv operation"), the job exits non-zero, and the stopped process stays where it is, holding its memory (and on a GPU
node its device): Lightning's launcher kills its child processes only on Ctrl-C, torchrun's agent only kills workers
on its own node, nothing stops a rank on another node. ``RankWatch``, beside every gym_lightning strategy, promises:

- the ranks that did not answer a roll call are named in one line, the failed exception's note (``add_note``,
  PEP 678): the ranks and their state on their host, the collective and the line that waited in it, what to do.
  ``gym fit``/``gym train`` print that line alone and exit with status 1 (the traceback with ``GYM_DEBUG=1``),
  within a bound (``exit_within``): a process group whose peer vanished can block in its destructor;
- the lowest live rank on each host kills (SIGKILL) that host's ranks that did not answer, never a reused pid;
  every process of the job on a host with a live rank ends;
- under NCCL, whose watchdog aborts the process at the timeout without raising in Python (no ``on_exception``
  runs), a watchdog thread (``StallWatch``, armed during training batches by ``BatchWatch``) does the same before
  that abort, and a slow rank is never named (``strategies.roll_call.Responder`` answers for it).

One diagnosis per process, whichever path comes first.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gym_lightning._compat import rank_zero_info, set_collective_timeout
from gym_lightning.strategies._common import leave_process_group_at_exit
from gym_lightning.strategies.roll_call import PING_SECONDS, Responder, for_each, roll_call, send_verdict

ROLL_CALL_SECONDS = 30.0  # longest wait for the other live ranks (they time out at about the same moment)
KILL_WAIT_SECONDS = 5.0  # how long a kill waits for the killed rank to be gone (SIGKILL is delivered asynchronously)
NOTE_PREFIX = "gym_lightning: "  # the note this module adds begins so; the command line prints it alone
QUIET_PREFIX = "gym_lightning (reported by rank 0): "  # a rank with nothing to add: the command line prints nothing
# Messages of a collective that failed because of another rank: gloo's timeout, a peer that closed its connection
# (it died), NCCL's watchdog. Everything else (a bug, out of memory) is left alone.
_FAILURE_PATTERNS = re.compile(
    r"Timed out waiting|timed out|Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"Watchdog caught collective operation timeout"
)
_C10D_FILES = ("torch/distributed/distributed_c10d.py",)
STALL_SECONDS = 60.0  # a training batch not over after this long gets a roll call (a third of the timeout if less)
_ASSUMED_TIMEOUT = timedelta(minutes=10)  # a strategy without ``timeout``: NCCL's default, the shorter of torch's
ERROR_PREFIX = "gym_lightning: error: "  # how the command line prints a failure (gym_lightning.cli.main)
_STOP_HINT = (
    "The job stops; checkpoints already written are intact: fix or replace the node, then resume with --ckpt_path "
    "last. A rank that needs longer (a slow first data preparation or checkpoint save) needs a larger "
    "strategy timeout (trainer.strategy.init_args.timeout; gym train: --ddp_timeout)."
)


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
    return _collective_in(traceback.extract_tb(exception.__traceback__))


def _collective_in(frames: traceback.StackSummary) -> str:
    """The collective a stack (outermost frame first) waits in, named as ``failed_collective`` does."""
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


def kill_if_same(process: RankProcess, wait_seconds: float = KILL_WAIT_SECONDS) -> bool:
    """SIGKILL ``process`` if it is still the process the rank was (same pid and start time), then wait until it
    has exited (at most ``wait_seconds``): a signal is delivered asynchronously, and whoever sees the job end (a
    scheduler, a test of its process group) must not find the killed rank still there. True if it was killed."""
    if process_state(process) == "exited":
        return False
    try:
        os.kill(process.pid, signal.SIGKILL)  # also ends a stopped process
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_seconds
    while process_state(process) != "exited" and time.monotonic() < deadline:  # a zombie counts as exited
        time.sleep(0.02)
    return True


class RankWatch:
    """Roll call, diagnosis and clean-up of a failed collective (the module docstring). Collective to build.

    At set-up, once: a separate gloo process group for the roll call (whatever the main backend, so it also works
    beside NCCL), and every rank's process identity (host, pid, start time) and responder address, one
    ``all_gather_object``. When a collective raises on a rank (``is_collective_failure``, :meth:`diagnose`), a roll
    call on that group: each live rank reports to rank 0 within ``roll_call_seconds`` (the collective timeout, at
    most 30 s); rank 0 answers each of them with the list of ranks that arrived. The ranks that did not arrive are
    the stopped or dead ones, with their state read on their host (``psutil``: stopped, exited, running). Kills check
    the pid's start time first, so that a reused pid is never hit.

    Why not ``torch.distributed.monitored_barrier``: it names the ranks that did not reach it only while they are
    alive; for a rank that died it raises gloo's "Connection closed by peer [127.0.0.1]:6534", naming an address
    (torch 2.13). The roll call is point-to-point sends and receives on the same gloo transport, a rank each.
    """

    def __init__(self, timeout: timedelta | None) -> None:
        wait = min(ROLL_CALL_SECONDS, timeout.total_seconds() if timeout is not None else ROLL_CALL_SECONDS)
        self.roll_call_seconds = max(1.0, wait)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.roll_call_seconds))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        self.stall_seconds, self.ping_seconds = watch_periods(timeout)
        self._verdict_lock = threading.Lock()
        self._concluded = False  # one diagnosis per process, whichever thread gets there first
        self.responder = Responder(self._on_verdict)
        gathered: list[tuple[RankProcess, str]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, (this_process(), self.responder.address))
        self.processes = [process for process, _ in gathered]
        self.addresses = [address for _, address in gathered]
        self.stall_watch = StallWatch(self.stall_seconds, self._on_stall)
        if len({process.host for process in self.processes}) > 1 and any(a.startswith("127.") for a in self.addresses):
            # A rank found no route to MASTER_ADDR and advertised loopback: the other hosts cannot ping it, and a
            # slow batch would name it. Every rank sees the same gathered list and decides alike: the watchdog is
            # off, and a hung rank is found by the collective's own error (gloo) as before.
            self.stall_watch.close()
            rank_zero_info("gym_lightning: the hung-rank watchdog is off: a rank found no route to MASTER_ADDR.")

    def arm(self) -> None:
        """The main thread starts a training batch: if it has not ended ``stall_seconds`` from now, roll call."""
        self.stall_watch.arm()

    def disarm(self) -> None:
        """The main thread is outside training batches (validation, checkpoint saves, teardown): no roll call."""
        self.stall_watch.disarm()

    def close(self) -> None:
        """Stop the watchdog and the responder (the end of a run); no collective, nothing that can wait."""
        self.stall_watch.close()
        self.responder.close()

    def attach(self, trainer: Any) -> None:
        """Arm during ``trainer``'s training batches (``BatchWatch``, first among its callbacks)."""
        trainer.callbacks.insert(0, BatchWatch(self))

    def diagnose(self, exception: BaseException) -> str | None:
        """After a failed collective: the roll call, the kills, and the note for ``exception`` (``None`` when it is
        not a failed collective). Rank 0 says which ranks did not arrive; the others' note is ``QUIET_PREFIX``
        (nothing to add), unless rank 0 itself did not answer: then the lowest rank of each host says so."""
        if not is_collective_failure(exception):
            return None
        self.disarm()  # this thread gives the diagnosis now: the watchdog must not start another
        answer = self._roll_call()
        arrived = answer if answer is not None else [rank != 0 for rank in range(self.world_size)]
        missing = [rank for rank, present in enumerate(arrived) if not present]
        if not self._conclude_once():  # another rank's verdict came first: its thread ends this process
            time.sleep(self.ping_seconds)
            return f"{QUIET_PREFIX}rank {self.rank}: another rank said which ranks did not arrive."
        states = {rank: process_state(self.processes[rank]) for rank in missing if self._is_local(rank)}
        killed = self._end_missing_local_ranks(arrived)
        if self.rank == 0 or (answer is None and self._lowest_arrived_on_host(arrived)):
            return self._message(exception, missing, states, killed)
        return f"{QUIET_PREFIX}rank {self.rank}: a collective failed; rank 0 says which ranks did not arrive."

    def _conclude_once(self) -> bool:
        """True for the first diagnosis of this process (main thread, watchdog or a received verdict), else False."""
        with self._verdict_lock:
            concluded, self._concluded = self._concluded, True
        return not concluded

    def _on_stall(self, began: float) -> bool:
        """The watchdog (its thread): a training batch began ``began`` and has not ended. Roll call; ranks that do
        not answer are named and ended, and this process exits with status 1 (with NCCL the main thread waits in a
        collective that never returns: the process group's watchdog would abort it at the timeout). Returns True
        (watch on) when every rank answered or the batch ended meanwhile (a slow step; a rank that finished the run
        and left is not a failure either)."""
        arrived = roll_call(self.addresses, self.rank, self.ping_seconds)
        if all(arrived) or self.stall_watch.armed_since() != began:
            return True
        waited = time.monotonic() - began
        verdict = {"arrived": arrived, "rank": self.rank, "waited": waited, "where": _main_thread_collective()}
        self._act_on(verdict, tell_others=True)
        return False

    def _on_verdict(self, verdict: dict[str, Any]) -> None:
        """The responder (its thread): another rank's watchdog named the ranks that did not arrive."""
        self._act_on(verdict, tell_others=False)

    def _act_on(self, verdict: dict[str, Any], tell_others: bool) -> None:
        """Kill this host's missing ranks (the lowest arrived rank here), tell the other live ranks, print the one
        line (the lowest live rank), exit with status 1. Once per process."""
        if not self._conclude_once():
            return
        self.disarm()
        arrived = [bool(present) for present in verdict["arrived"]]
        missing = [rank for rank, present in enumerate(arrived) if not present]
        states = {rank: process_state(self.processes[rank]) for rank in missing if self._is_local(rank)}
        killed = self._end_missing_local_ranks(arrived)
        if tell_others:
            live = [self.addresses[rank] for rank, present in enumerate(arrived) if present and rank != self.rank]
            for_each(live, lambda address: send_verdict(address, verdict))
        if self.rank == arrived.index(True):
            waited = timedelta(seconds=round(verdict["waited"]))
            limit = f" (the collective timeout is {self.timeout})" if self.timeout is not None else ""
            because = f"rank {verdict['rank']} waited {waited} in {verdict['where']}{limit}"
            print(ERROR_PREFIX + self._missing_line(missing, states, killed, because), file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # the main thread may wait in a collective that never returns

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
        return NOTE_PREFIX + self._missing_line(missing, states, killed, waited)

    def _missing_line(self, missing: list[int], states: dict[int, str], killed: list[int], because: str) -> str:
        """The line naming the ranks that did not arrive, why this rank knows (``because``), and what to do."""
        described = ", ".join(f"rank {rank} ({self._describe(rank, states, killed)})" for rank in missing)
        return f"{described} did not arrive: {because}. {_STOP_HINT}"

    def _describe(self, rank: int, states: dict[int, str], killed: list[int]) -> str:
        process = self.processes[rank]
        place = f"pid {process.pid} on {process.host}"
        if rank not in states:
            return f"{place}, another host: end it there if it is still running"
        return f"{place}, {states[rank]}{', killed' if rank in killed else ''}"


def watch_periods(timeout: timedelta | None) -> tuple[float, float]:
    """(stall, ping) seconds: a training batch not over after ``stall`` gets a roll call whose answers are awaited
    ``ping``. Together at most two thirds of the collective timeout: the diagnosis is over before NCCL's watchdog
    aborts the process at the timeout (it raises nothing in Python: no ``on_exception`` would run)."""
    third = (timeout or _ASSUMED_TIMEOUT).total_seconds() / 3
    return max(1.0, min(STALL_SECONDS, third)), max(1.0, min(PING_SECONDS, third))


class StallWatch:
    """A rank's watchdog thread. Armed (``arm``, at each training batch's start) and not disarmed ``stall``
    seconds later, it calls ``check(began)`` (the roll call), which returns whether to keep watching; then the
    batch gets another ``stall`` seconds. Disarmed, it never calls anything.

    ``BatchWatch`` arms it from the start to the end of each training batch (disarmed during validation, checkpoint
    saves, data loading and teardown); ``watch_periods`` gives ``stall`` (a third of the collective timeout, at most
    60 s) and the roll call's wait (a third, at most 30 s). Every rank answered: nothing happens (a slow step). Some
    did not, and the batch is still the same (a rank that finished the run and left while this one was still in its
    last batch is no failure): ``RankWatch`` kills the missing ranks, tells the other live ranks (they exit too),
    the lowest live rank prints the one line, and every live rank exits with status 1, well before NCCL's abort.
    """

    def __init__(self, stall: float, check: Callable[[float], bool]) -> None:
        self.stall, self.check = stall, check
        self._lock = threading.Lock()
        self._began: float | None = None  # time.monotonic() at the current batch's start; None: disarmed
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gym-stall-watch", daemon=True)
        self.thread.start()

    def arm(self) -> None:
        with self._lock:
            self._began = time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._began = None

    def armed_since(self) -> float | None:
        with self._lock:
            return self._began

    def close(self) -> None:
        self.disarm()
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(min(1.0, self.stall / 10)):
            began = self.armed_since()
            if began is None or time.monotonic() - began < self.stall:
                continue
            if not self.check(began):
                return
            with self._lock:
                if self._began == began:  # every rank answered and the batch goes on: watch it as a new one
                    self._began = time.monotonic()


def _main_thread_collective() -> str:
    """What the main thread waits in, read from its stack (it is blocked: it cannot say so itself)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    return _collective_in(traceback.extract_stack(frame)) if frame is not None else "a collective"


class BatchWatch(Callback):
    """Arms a rank's watchdog (``RankWatch.arm``) from the start to the end of each training batch, on every rank.
    First in the callback list: its disarm comes before the checkpoint saves of ``on_train_batch_end``."""

    def __init__(self, watch: RankWatch) -> None:
        self.watch = watch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.watch.arm()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.watch.disarm()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.watch.disarm()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.watch.disarm()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.watch.disarm()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.watch.close()


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


def watch_collectives(timeout: timedelta | None, groups: Iterable[Any] = (), module: Any = None) -> RankWatch | None:
    """Right after a strategy's process group is up: its collectives (and ``groups``') time out after ``timeout``,
    and a multi-rank job gets its ``RankWatch`` (a collective), armed during the training batches of ``module``'s
    Trainer (the strategy's ``lightning_module``); ``None`` for one process, where no peer can stop answering."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if timeout is not None:
        for group in (None, *groups):
            set_collective_timeout(timeout, group)
    if torch.distributed.get_world_size() == 1:
        return None
    watch = RankWatch(timeout)
    if module is not None:
        # A module without a Trainer (a LightningModule's ``trainer`` raises) has no training batches to watch.
        with contextlib.suppress(RuntimeError, AttributeError):
            watch.attach(module.trainer)
    return watch


__all__ = [
    "ERROR_PREFIX",
    "NOTE_PREFIX",
    "PING_SECONDS",
    "QUIET_PREFIX",
    "ROLL_CALL_SECONDS",
    "STALL_SECONDS",
    "BatchWatch",
    "RankProcess",
    "RankWatch",
    "Responder",
    "StallWatch",
    "exit_within",
    "failed_collective",
    "is_collective_failure",
    "process_state",
    "rank_failure_line",
    "report_rank_failure",
    "roll_call",
    "send_verdict",
    "watch_periods",
]
