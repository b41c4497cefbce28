"""The device checks (``bash benchmarks/gpu.sh --part checks``) as tests: every strategy trains, validates and
exports on one CUDA GPU, ``gym fit`` of the shipped configs, and the host syncs of quiet steps; skipped without CUDA.

    python -m pytest tests/gpu                          # on a GPU machine (gpu.sh --part checks runs this)
    GYM_GPU_CPU_SMOKE=1 python -m pytest tests/gpu      # the same tests on the CPU, tiny sizes (gpu.sh --cpu-smoke)

One process for every test (importing torch, DeepSpeed and transformers costs 10-20 s a process) holding one process
group of world size 1 (``cpu:gloo,cuda:nccl`` on CUDA, so that runs keeping tensors on either side share it). The
tests run in ``MODULE_ORDER``: the correctness checks, then the user's path, then the census, which the time budget
gives up first. No DeepSpeed op is built (``refuse_jit_builds``: a build would take the device's minutes; on the CPU
only DeepSpeed's shared-memory collective loads), and ``test_gpu_op_builds.py`` says which loaded.

Set by gpu.sh: ``GYM_GPU_RECORDS`` (a JSON-lines file: one record per test as it ends, ``{"check", "ok", "seconds",
"figures" | "detail" | "skipped"}``, so that a run killed at its limit keeps what finished), ``GYM_GPU_DEADLINE``
(seconds since the epoch: no test starts that would likely end later, the slowest so far being the guess; it is
recorded as skipped) and ``GYM_GPU_WORK`` (the scratch folder; default: a temporary one).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.common.launch import free_port
from benchmarks.common.records import append_record, one_line
from benchmarks.workers.gpu_common import CPU_ONLY_OPS, refuse_jit_builds

SMOKE = os.environ.get("GYM_GPU_CPU_SMOKE") == "1"
MODULE_ORDER = ("test_gpu_checks.py", "test_gpu_configs.py", "test_gpu_host_syncs.py", "test_gpu_op_builds.py")
MIN_TEST_SECONDS = 5.0  # a fit's least cost (set-up, a few steps, an export) before any test was timed
_slowest = [MIN_TEST_SECONDS]


def _in_this_folder(item: pytest.Item) -> bool:
    return Path(str(item.path)).parent == Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests in ``MODULE_ORDER`` (their relative order otherwise kept), the others left in place."""
    slots = [i for i, item in enumerate(items) if _in_this_folder(item)]
    ranked = sorted((items[i] for i in slots), key=lambda item: MODULE_ORDER.index(Path(str(item.path)).name))
    for slot, item in zip(slots, ranked, strict=True):
        items[slot] = item


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not torch.cuda.is_available() and not SMOKE:
        pytest.skip("needs a CUDA GPU (GYM_GPU_CPU_SMOKE=1 runs these checks on the CPU at tiny sizes)")
    deadline = os.environ.get("GYM_GPU_DEADLINE")
    if deadline and (left := float(deadline) - time.time()) < _slowest[0]:
        pytest.skip(f"time budget: {left:.0f} s left, the slowest test so far took {_slowest[0]:.0f} s")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One record per test into ``GYM_GPU_RECORDS``, as it ends (its call, or a setup that failed or skipped)."""
    if report.when == "call":
        _slowest[0] = max(_slowest[0], report.duration)
    out = os.environ.get("GYM_GPU_RECORDS")
    if not out or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    properties = dict(report.user_properties)
    record: dict[str, Any] = {"check": properties.get("check", report.nodeid.split("::", 1)[-1])}
    record |= {"ok": None if report.skipped else report.passed, "seconds": round(report.duration, 2)}
    if report.skipped:
        record["skipped"] = str(report.longrepr[-1]).removeprefix("Skipped: ")
    elif report.failed:
        record["detail"] = one_line(properties.get("detail") or report.longreprtext.strip().splitlines()[-1])[:2000]
    if "figures" in properties:
        record["figures"] = properties["figures"]
    append_record(Path(out), record)


@pytest.fixture
def check(record_property: Callable[[str, Any], None]) -> Any:
    """``check(name, verdict)`` records the verdict under the check's name and asserts it (``gpu_runs.Check``)."""
    from gpu_runs import Check

    return Check(record_property)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops() -> None:
    """Nothing to build: overrides tests/conftest.py's ``deepspeed_ops`` for the tests of this folder."""


@pytest.fixture(scope="session")
def op_loads() -> list[dict[str, Any]]:
    """DeepSpeed's JIT builds refused for the session (the CPU smoke allows its shared-memory collective); the ops
    loaded, as they load."""
    return refuse_jit_builds(CPU_ONLY_OPS if SMOKE else ())


@pytest.fixture(scope="session")
def device(op_loads: list[dict[str, Any]]) -> Iterator[torch.device]:
    """The device every test trains on, with the session's process group of world size 1 around it."""
    import transformers

    from gym_lightning.quiet import quiet_console

    quiet_console()  # as `gym` does: before DeepSpeed is first imported (op_loads may have imported it: harmless)
    for name in ("lightning.pytorch", "lightning.fabric"):  # one "GPU available" banner per Trainer otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # a "Loading weights" bar per export reload otherwise
    cuda = not SMOKE
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    torch.distributed.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
        world_size=1, timeout=timedelta(seconds=300),
    )  # fmt: skip
    yield torch.device("cuda" if cuda else "cpu")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def work() -> Path:
    folder = os.environ.get("GYM_GPU_WORK")
    path = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="gym_gpu_checks_"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def ctx(device: torch.device, work: Path) -> Any:
    """The device, the scratch folder and the tiny pretrained folder every run starts from."""
    from gpu_runs import Context
    from helpers.strategy_worker import save_tiny_pretrained

    return Context(device=device, work=work, model_dir=save_tiny_pretrained(work / "pretrained"))


@pytest.fixture(scope="session")
def runs(ctx: Any) -> Any:
    """The training runs the checks compare, fitted once each when first asked for (``gpu_runs.Runs``)."""
    from gpu_runs import Runs

    return Runs(ctx)
