"""Host syncs per quiet training step of ``gym fit``, at world sizes 1 and 2, as CUDA would pay them (issue 55).

On CUDA the host stops until the GPU has run everything queued before when it reads a device value, sizes a result
by the data or copies host data to the device; the next step's kernels are then queued late and the GPU idles. The
census (benchmarks/common/host_syncs.py: a ``TorchDispatchMode`` and a ``TorchFunctionMode``, its docstring says why
and what a CPU run cannot show) counts them on CPU ranks. The budget on quiet steps (no logging, no checkpoint, not
the first): none from gym_lightning; the model forward's one is transformers' padding-mask check ("can the causal
mask be skipped", ``masking_utils``), which a plain loop pays too and which padding-free packed rows (no
``attention_mask``) skip. Lightning's own at 2 ranks is its SIGTERM broadcast (a device tensor made from a host
flag and read back, every batch). benchmarks/host_syncs.py runs every strategy x precision x world size
(docs/benchmarks.md, "Host syncs per quiet step"); this is its cheap subset.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.dist import free_port, rank_env, run_python

from benchmarks.common.host_syncs import (
    DATA_DEPENDENT,
    HOST_READ,
    HOST_TO_DEVICE,
    KINDS,
    READ,
    WAIT,
    HostSyncCounter,
    counting_host_syncs,
    quiet_steps,
)
from gym_lightning.metrics.throughput import batch_counts

STEPS, LOG_EVERY, WARMUP = 12, 5, 2  # the runs' steps, log interval and ThroughputCallback warm-up
QUIET = quiet_steps(STEPS, LOG_EVERY, None, set(range(WARMUP - 1, STEPS, LOG_EVERY)))
# The count agreement's paths: the LM head in chunks (its calls agreed over the ranks), MLPs in tiles.
TILED = ["--model.loss_chunking=on", "--model.loss_chunk_tokens=24", "--model.mlp_tile_tokens=16"]
CASES: dict[str, list[str]] = {  # 2 ranks each (benchmarks/host_syncs.py has world size 1 and the other strategies)
    # gym_ddp's static graph (strategies.ddp.resolve_static_graph) under autocast, the counts of the LM head and MLPs
    "gym_ddp-bf16": ["--trainer.strategy=gym_ddp", "--trainer.precision=bf16-mixed", *TILED],
    "zero3": ["--trainer.strategy=zero3", *TILED],  # decoder layers are leaf modules: only the LM head's agreed
}


# ----------------------------------------------------------------------------------------------------- the census
def census(work: Callable[[], Any]) -> Counter[tuple[str, str]]:
    """``(kind, op)`` of every sync ``work`` makes (outside any training loop)."""
    counter = HostSyncCounter(counting=True)
    with counting_host_syncs(counter):
        work()
    return Counter((e.kind, e.op) for e in counter.events)


def test_the_census_sees_reads_data_dependent_shapes_and_copies_of_host_data() -> None:
    device_tensor = torch.arange(6.0)  # the compute device's on CUDA: nothing marks it as host memory
    assert census(lambda: device_tensor.sum().item()) == {(READ, "aten._local_scalar_dense"): 1}
    assert census(lambda: bool(device_tensor[0])) == {(READ, "aten._local_scalar_dense"): 1}
    assert census(lambda: device_tensor.tolist()) == {(READ, "Tensor.tolist"): 1}  # no aten op on a CPU tensor
    assert census(lambda: device_tensor.nonzero()) == {(DATA_DEPENDENT, "aten.nonzero"): 1}
    assert census(lambda: device_tensor[device_tensor > 2]) == {(DATA_DEPENDENT, "aten.index"): 1}
    assert census(lambda: device_tensor.new_tensor(3)) == {(HOST_TO_DEVICE, "aten.lift_fresh"): 1}
    assert census(lambda: torch.tensor([1, 2], device=device_tensor.device)) == {(HOST_TO_DEVICE, "aten.lift_fresh"): 1}
    # Made on the host (no device), then an operand of a device op: on CUDA it had to be copied to the device first.
    moved = {(HOST_TO_DEVICE, "aten.stack <- host tensor"): 1}
    assert census(lambda: torch.stack([device_tensor[:2], torch.tensor([1.0, 2.0])])) == moved


def test_the_census_leaves_host_memory_alone() -> None:
    device_tensor = torch.arange(6.0)

    def host_work() -> None:
        counts = torch.tensor([3, 4])  # host integers made a host tensor: no device on CUDA either
        counts.max().item()
        counts.tolist()
        device_tensor * torch.tensor(2.0)  # a 0-d host tensor is a CPU scalar CUDA kernels take as an argument
        torch.full((), 5, device=device_tensor.device)  # a fill on the device: the number is a kernel argument

    assert census(host_work) == Counter()


def test_the_census_takes_deepspeed_s_compute_device_name_for_the_device() -> None:
    """DeepSpeed names the device by ``get_accelerator().device_name()``: ``"cpu"`` on CPU ranks, ``"cuda"`` on
    GPUs. Its ``.to(name)`` is a move to the compute device, not a copy to the host (ZeRO-3's all-gathers)."""
    from deepspeed.accelerator import get_accelerator

    tensor = torch.arange(4.0)
    assert census(lambda: tensor.to(get_accelerator().device_name())) == Counter()
    assert census(lambda: tensor.to("cpu")) == {(READ, "Tensor.to"): 1}


def test_batch_counts_copy_no_host_data_to_the_device() -> None:
    """ThroughputCallback counts every micro-batch on the device; the row count used to be ``new_tensor(<int>)``,
    a blocking copy of host data (a stream sync on CUDA) per micro-batch."""
    batch = {"input_ids": torch.ones(3, 8, dtype=torch.long), "attention_mask": torch.ones(3, 8, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    assert census(lambda: batch_counts(batch)) == Counter()
    assert batch_counts(batch).tolist() == [3, 24, 21, 3 * 64]


# ----------------------------------------------------------------------------------------------------- agreement
def _agree_on_rank(rank: int, port: int, nccl_only: bool, results: multiprocessing.Queue) -> None:
    import gym_lightning.loss as loss
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeRO3Strategy

    torch.distributed.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if nccl_only:  # as an NCCL-only default group would answer: no CPU backend there
            loss.has_cpu_backend = lambda group=None: group is not None
        answers, counter = {}, HostSyncCounter(counting=True)
        with counting_host_syncs(counter):
            for strategy in (GymDDPStrategy(), GymFSDPStrategy(), ZeRO3Strategy()):
                strategy.parallel_devices = [torch.device("cpu")] * 2  # as the Trainer sets them
                counts = strategy.start_agreed_counts([2 + 3 * rank, 5 - 3 * rank])  # [loss chunks, MLP tiles]
                answers[type(strategy).__name__] = (counts[0], counts[1])
        results.put((rank, answers, [(e.kind, e.op, e.chain[-1]) for e in counter.events]))
    except Exception as error:  # reported, not left for the parent's timeout
        results.put((rank, repr(error), []))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("nccl_only", [False, True])
def test_ranks_agree_on_call_counts_over_host_memory_and_only_where_calls_are_collectives(nccl_only: bool) -> None:
    """The loss chunks' count is agreed (the LM head may be gathered per call); the MLP tiles' only under ZeRO-3,
    whose decoder layers here are not leaf modules (no model was set up); the agreement is a host tensor (over a gloo
    group of its own where the default group has no CPU backend): no copy of host data to the device, and no device
    read (before: ``torch.tensor(local, device=...)``, and a device read on NCCL-only groups)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_agree_on_rank, args=(rank, port, nccl_only, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    got = sorted(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    for rank, answers, events in got:
        assert events == [], events
        own_tiles = 5 - 3 * rank
        assert answers == {"GymDDPStrategy": (5, own_tiles), "GymFSDPStrategy": (5, own_tiles), "ZeRO3Strategy": (5, 5)}


# ----------------------------------------------------------------------------------------------------- gym fit
def _fit_args(name: str, flags: list[str], root: Path) -> list[str]:
    return [
        "--config", "configs/quickstart.yaml", *flags, "--trainer.devices=2", f"--trainer.max_steps={STEPS}",
        f"--trainer.log_every_n_steps={LOG_EVERY}", "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root / name}", "--export.output_dir=null", "--data.batch_size=4",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every case's events per rank, from one torchrun launch of 2 ranks (benchmarks/workers/host_sync_worker.py: one
    fit after the other, so that the series pays for one start of two processes)."""
    root = tmp_path_factory.mktemp("host_syncs")
    cases = [{"name": name, "args": _fit_args(name, flags, root)} for name, flags in CASES.items()]
    spec = root / "spec.json"
    spec.write_text(json.dumps({"out": str(root), "cases": cases}))
    launch = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--rdzv_backend", "c10d"]
    launch += ["--rdzv_endpoint", f"127.0.0.1:{free_port()}", "-m", "benchmarks.workers.host_sync_worker"]
    run_python([*launch, str(spec)], timeout=600, env=rank_env())
    return {name: [json.loads((root / f"{name}.{rank}.json").read_text()) for rank in (0, 1)] for name in CASES}


def _syncs(rank: dict[str, Any], steps: set[int], owner: str | None = None) -> Counter[str]:
    """``op @ innermost site`` of the syncs in ``steps`` (of ``owner`` when given)."""
    return Counter(
        f"{e['op']} @ {e['chain'][-1]}"
        for e in rank["events"]
        if e["step"] in steps and e["kind"] in KINDS and (owner is None or e["owner"] == owner)
    )


def _nonfinite_read_under_zero(name: str, site: str) -> bool:
    """NonFiniteGuard reads its flags at once where the optimizer cannot skip a step itself (DeepSpeed's engine),
    by its docstring: one sync per step under ZeRO (callbacks/nonfinite.py, ``read_now``), xfailed below."""
    return name.startswith("zero") and "callbacks/nonfinite.py" in site


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_gym_fit_quiet_steps_make_no_gym_lightning_host_sync(runs: dict[str, Any], name: str) -> None:
    assert sorted(QUIET) == [2, 3, 5, 7, 8, 10]  # neither logging (4, 9; ThroughputCallback's 1, 6, 11) nor the first
    for rank in runs[name]:
        own = _syncs(rank, QUIET, "gym_lightning")
        assert not [site for site in own if not _nonfinite_read_under_zero(name, site)], own
        # The model forward's one: transformers' padding-mask check, once per forward (no accumulation here).
        model = _syncs(rank, QUIET, "transformers")
        assert set(model) <= {"aten._local_scalar_dense @ transformers/masking_utils.py:292"}, model
        assert sum(model.values()) == len(QUIET)
        # Lightning's at 2 ranks: its SIGTERM broadcast, a flag made a device tensor and read back every batch.
        lightning = _syncs(rank, QUIET, "lightning")
        assert sum(lightning.values()) == 2 * len(QUIET), lightning
        assert all("training_epoch_loop.py" in site for site in lightning)
        # torch acting on its own (DDP's reducer, FSDP2, the optimizer) and DeepSpeed wait for nothing but ZeRO-3's
        # grad-norm check (runtime/utils.py is_invalid_grad_norm); its throughput timer no longer synchronises.
        assert _syncs(rank, QUIET, "torch") == Counter()
        assert set(_syncs(rank, QUIET, "deepspeed")) <= {"aten._local_scalar_dense @ deepspeed/runtime/utils.py:233"}
        assert not [e for e in rank["events"] if e["kind"] == WAIT]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="NonFiniteGuard reads its flags at once under ZeRO (callbacks/nonfinite.py)")
def test_zero3_quiet_steps_make_no_gym_lightning_host_sync_at_all(runs: dict[str, Any]) -> None:
    assert all(_syncs(rank, QUIET, "gym_lightning") == Counter() for rank in runs["zero3"])


@pytest.mark.slow
def test_gym_ddp_s_static_graph_reads_host_memory_only(runs: dict[str, Any]) -> None:
    """Under the static graph DDP's reducer reads its host-side ``local_used_map_`` once per parameter in every
    backward (reducer.cpp ``finalize_bucket_dense``): the "29 syncs inside backward" of the first census, which saw
    every CPU tensor as a device tensor. On CUDA that map is host memory: no device is waited for."""
    for rank in runs["gym_ddp-bf16"]:
        reads = Counter(e["step"] for e in rank["events"] if e["kind"] == HOST_READ)
        assert {reads[step] for step in QUIET} == {29}  # one per parameter of the 3-layer tiny Llama


@pytest.mark.slow
def test_a_logging_step_stays_within_its_budget(runs: dict[str, Any]) -> None:
    """A logging step that is no checkpoint step: the loggers' and the progress bar's reads (was 4-7 per step on
    every step before the first census, commit 4556a79)."""
    rank = runs["gym_ddp-bf16"][0]
    logging = {LOG_EVERY - 1}
    wrapper = _syncs(rank, logging, "gym_lightning") + _syncs(rank, logging, "lightning")
    assert sum(wrapper.values()) <= 4 + 2, wrapper  # + Lightning's SIGTERM broadcast at 2 ranks
