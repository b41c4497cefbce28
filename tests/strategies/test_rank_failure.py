"""A rank that stops answering: the job ends within the collective timeout plus a bounded grace, one line names the
rank and the collective, no process of the job is left, checkpoints stay intact and a resume continues exactly.

The 2-rank test runs ``gym fit`` as users do (``configs/ddp.yaml`` shortened, Lightning's launcher starting rank 1,
``trainer.strategy.init_args.timeout: 0:00:15``) with rank 1 stopping itself (SIGSTOP) during step 3, after the
step-2 checkpoint. Before ``strategies.rank_failure``, rank 0 ended after the timeout with gloo's "Timed out waiting
30000ms for recv operation" (no rank named) and the stopped rank stayed behind.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli_runs import run_config, tensors_of
from helpers.jobs import run_job

from gym_lightning.checkpointing.manifest import file_problems
from gym_lightning.strategies.rank_failure import (
    Responder,
    StallWatch,
    failed_collective,
    is_collective_failure,
    kill_if_same,
    process_state,
    roll_call,
    send_verdict,
    this_process,
    watch_periods,
)

TIMEOUT_SECONDS = 15
GRACE_SECONDS = 60  # the bound the job's end must keep after the timeout (roll call <= 15 s here, kill, exit)


@pytest.mark.slow
def test_a_stopped_rank_is_named_killed_and_the_run_resumes_exactly(cli_run, tmp_path: Path) -> None:
    _hang_end_and_resume(cli_run, tmp_path, nccl_like=False)


@pytest.mark.slow
def test_a_stopped_rank_is_handled_before_an_nccl_like_abort(cli_run, tmp_path: Path) -> None:
    # As with NCCL: rank 0's timed-out collective raises nothing, and rank 0 dies by SIGABRT at the timeout. Its
    # watchdog thread must have named rank 1, killed it and exited with status 1 before then.
    seconds = _hang_end_and_resume(cli_run, tmp_path, nccl_like=True)
    print(f"the job ended {seconds:.1f} s after rank 1 stopped")  # shown with pytest -s
    assert seconds < TIMEOUT_SECONDS, f"ended {seconds:.1f} s after the stop: the abort would have come first"


def _hang_end_and_resume(cli_run: Any, tmp_path: Path, nccl_like: bool) -> float:
    """Rank 1 stops at step 2 (rank 0, if ``nccl_like``, as NCCL: no error raised, SIGABRT at the timeout): the
    contract of the module docstring. Returns the seconds from the stop to the job's end."""
    reference = cli_run("gym_ddp")  # the same config, never interrupted
    marker = tmp_path / "stopped.json"
    stop = {"class_path": "helpers.faults.StopRank", "init_args": {"rank": 1, "step": 2, "marker": str(marker)}}
    abort = {"class_path": "helpers.faults.AbortLikeNccl", "init_args": {"rank": 0, "marker": str(marker)}}
    abort["init_args"]["timeout"] = TIMEOUT_SECONDS
    timeout = {"trainer.strategy.init_args.timeout": f"0:00:{TIMEOUT_SECONDS}"}
    faults = [stop, abort] if nccl_like else [stop]
    hung = run_config("gym_ddp", False, tmp_path, callbacks=faults, name="hung.yaml", **timeout)
    job = run_job(["-m", "gym_lightning", "fit", "--config", str(hung)], timeout=300, settle=0)
    ended = time.time()

    assert job.returncode == 1, f"exit {job.returncode}{job.log()}"
    assert not job.leftovers, f"processes left behind: {job.leftovers}{job.log()}"
    stopped = json.loads(marker.read_text())
    assert ended - stopped["time"] < TIMEOUT_SECONDS + GRACE_SECONDS, f"{ended - stopped['time']:.0f} s{job.log()}"
    errors = [line for line in job.stderr.splitlines() if line.startswith("gym_lightning: error:")]
    assert len(errors) == 1, f"{errors}{job.log()}"
    print(errors[0])  # shown with pytest -s
    assert f"rank 1 (pid {stopped['pid']} on " in errors[0] and "stopped (SIGSTOP), killed) did not arrive" in errors[0]
    assert "did not arrive: rank 0 waited " in errors[0] and "--ckpt_path last" in errors[0]
    assert "Traceback" not in job.stderr

    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "last.ckpt").resolve().name == "step-00000002.ckpt"
    assert file_problems(checkpoints / "step-00000002.ckpt") == [], "the checkpoint written before the hang is intact"
    resume = run_config("gym_ddp", False, tmp_path, name="resume.yaml", **timeout)
    resumed = run_job(["-m", "gym_lightning", "fit", "--config", str(resume), "--ckpt_path", "last"], timeout=300)
    assert resumed.returncode == 0 and not resumed.leftovers, resumed.log()
    got, want = tensors_of(tmp_path / "hf"), tensors_of(reference.export())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "resume is not exact"
    return ended - stopped["time"]


def test_only_collectives_that_failed_because_of_a_peer_are_diagnosed() -> None:
    gloo_timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    peer_died = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6534")
    assert is_collective_failure(gloo_timeout) and is_collective_failure(peer_died)
    assert not is_collective_failure(RuntimeError("CUDA out of memory")) and not is_collective_failure(ValueError("x"))


def test_the_failed_collective_is_named_with_the_line_that_called_it() -> None:
    def all_reduce() -> None:  # stands for torch.distributed's function; see the patched filename below
        raise RuntimeError("Timed out waiting 30000ms for recv operation to complete")

    all_reduce.__code__ = all_reduce.__code__.replace(co_filename="/x/torch/distributed/distributed_c10d.py")

    def training_step() -> None:
        all_reduce()

    with pytest.raises(RuntimeError) as info:
        training_step()
    assert failed_collective(info.value).startswith("all_reduce, called from ")
    assert "in training_step" in failed_collective(info.value)


def test_process_states_tell_stopped_from_exited_and_a_reused_pid() -> None:
    import dataclasses
    import subprocess
    import sys

    me = this_process()
    assert process_state(me) in ("running", "sleeping")
    assert process_state(dataclasses.replace(me, started=me.started - 100)) == "exited", "a reused pid is not it"
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"])
    deadline = time.time() + 20
    state = dataclasses.replace(me, pid=child.pid, started=__import__("psutil").Process(child.pid).create_time())
    while process_state(state) != "stopped (SIGSTOP)" and time.time() < deadline:
        time.sleep(0.05)
    assert process_state(state) == "stopped (SIGSTOP)"
    child.kill()
    child.wait()
    assert process_state(state) == "exited"


def test_a_kill_returns_once_the_killed_rank_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGKILL is delivered asynchronously: here the "process" stays running for 3 reads after the signal.
    import gym_lightning.strategies.rank_failure as rank_failure

    signals, states = [], iter(["running", "running", "running", "running", "exited"])
    monkeypatch.setattr(rank_failure.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    monkeypatch.setattr(rank_failure, "process_state", lambda process: next(states))
    gone = this_process()
    assert kill_if_same(gone, wait_seconds=10) and len(signals) == 1
    assert next(states, "read") == "read", "it returned before it saw the rank exited"
    states = iter(["running"] * 1000)
    start = time.monotonic()
    assert kill_if_same(gone, wait_seconds=0.2) and time.monotonic() - start < 5  # bounded: a rank that never ends


def test_gym_train_ddp_timeout_sets_the_strategy_timeout() -> None:
    from gym_lightning.commands.train import parse_train_args, to_cli_args

    base = ["--model_name_or_path", "tiny-llama", "--dataset", "addition", "--ddp_timeout", "30"]
    cases = {(): "GymDDPStrategy", ("--strategy", "zero3"): "ZeROStrategy", ("--strategy", "ddp"): "DDPStrategy"}
    for extra, cls in cases.items():
        [strategy] = [a for a in to_cli_args(parse_train_args([*base, *extra]), env={}) if "strategy" in a]
        value = json.loads(strategy.split("=", 1)[1])
        assert value["class_path"].endswith(cls) and value["init_args"]["timeout"] == str(timedelta(seconds=30))
    plain = to_cli_args(parse_train_args(base[:-2]), env={})
    assert not any("trainer.strategy" in a for a in plain), "HF's default timeout changes nothing"


@pytest.mark.parametrize(
    ("mode", "state"),
    [
        ("exit", "exited) did not arrive: rank 0's all_reduce"),
        ("stop", "stopped (SIGSTOP), killed) did not arrive: rank 0 waited"),
    ],
    ids=["exited", "stopped"],
)
def test_the_roll_call_names_a_dead_or_stopped_rank_and_kills_a_stopped_one(mode: str, state: str, tmp_path: Path):
    # Two bare gloo processes around a RankWatch (no Lightning): rank 1 dies or stops before an all_reduce.
    import subprocess
    import sys

    from helpers.dist import REPO_ROOT, rank_env

    script, out, env = REPO_ROOT / "tests" / "helpers" / "roll_call_worker.py", tmp_path / "line.txt", rank_env()
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), mode, str(out)], env=env) for r in (0, 1)]
    try:
        assert ranks[0].wait(timeout=120) == 0
        assert ranks[1].wait(timeout=10) == (-9 if mode == "stop" else 3), "a stopped rank is killed by rank 0"
    finally:
        for process in ranks:
            process.kill()
    line = out.read_text()
    assert line.startswith("gym_lightning: rank 1 (pid ") and state in line, line


def test_the_watchdog_never_fires_while_disarmed() -> None:
    checked: list[float] = []
    watch = StallWatch(0.2, lambda began: checked.append(began) is None)  # every rank answered: watch on
    try:
        time.sleep(0.8)
        assert checked == [], "never armed: no roll call"
        for _ in range(8):  # short batches: armed, then disarmed well within the stall
            watch.arm()
            time.sleep(0.05)
            watch.disarm()
        time.sleep(0.5)
        assert checked == [], "every batch ended in time, and nothing happens between batches"
        watch.arm()
        deadline = time.monotonic() + 5
        while len(checked) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(checked) >= 2 and checked[1] > checked[0], "a stalled batch: roll calls, each after another stall"
    finally:
        watch.close()


def test_a_slow_but_alive_rank_answers_the_roll_call_and_a_stopped_or_dead_one_does_not() -> None:
    verdicts: list[dict[str, Any]] = []
    alive = Responder(verdicts.append)  # its rank's main thread is busy (below): the responder answers anyway
    stopped = socket.create_server(("127.0.0.1", 0))  # a stopped process: its kernel accepts, nothing answers
    with socket.create_server(("127.0.0.1", 0)) as gone:
        dead = f"127.0.0.1:{gone.getsockname()[1]}"  # a dead process: the connection is refused
    busy = threading.Event()
    spinner = threading.Thread(target=lambda: [sum(range(10_000)) for _ in iter(busy.is_set, True)], daemon=True)
    spinner.start()
    try:
        assert roll_call(["me:0", alive.address], 0, wait=2.0) == [True, True]
        started = time.monotonic()
        answers = roll_call([alive.address, "me:0", f"127.0.0.1:{stopped.getsockname()[1]}", dead], 1, wait=1.0)
        assert answers == [True, True, False, False]
        assert time.monotonic() - started < 3, "the ranks are pinged at once, each for at most the wait"
        impostor = alive.address.rsplit("/", 1)[0] + "/0123"  # not the job's token: ignored
        assert roll_call([impostor, "me:0"], 1, wait=1.0) == [False, True]
        send_verdict(impostor, {"arrived": [False, True]})
        send_verdict(alive.address, {"arrived": [True, False]})
        deadline = time.monotonic() + 5
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert verdicts == [{"arrived": [True, False]}]
    finally:
        busy.set()
        alive.close()
        stopped.close()
    assert watch_periods(timedelta(seconds=15)) == (5.0, 5.0) and watch_periods(None) == (60.0, 30.0)
    assert sum(watch_periods(timedelta(minutes=30))) < 30 * 60 * 2 / 3
