"""The CPU micro-benchmarks the step-time model reads on CPU ranks (gym_lightning/metrics/calibrate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.dist import free_port

from gym_lightning.metrics.calibrate import collective_figures, matmul_flops, measure_host, memory_bandwidth


def test_alone_there_is_nothing_to_measure_between_ranks() -> None:
    figures = measure_host(128)
    assert figures.matmul_flops > 0 and figures.memory_bandwidth > 0
    assert (figures.bus_bandwidth, figures.gather_bus_bandwidth, figures.scatter_bus_bandwidth) == (0, 0, 0)
    assert collective_figures() == {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "latency": 0.0}


def test_rectangular_matmul_counts_its_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    from gym_lightning.metrics import calibrate

    monkeypatch.setattr(calibrate, "_median_seconds", lambda run, repeats, budget: 2.0)
    assert matmul_flops(64, rows=10, cols=30) == 2 * 10 * 64 * 30 / 2.0  # rows x width x cols multiply-adds
    assert memory_bandwidth(nbytes=4096) == 3 * 4096 / 2.0  # x += y: two reads and a write


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    figures = collective_figures(nbytes=2**20, repeats=2)
    Path(out, f"{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def test_two_gloo_ranks_measure_each_collective_alike(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]  # the slower rank's times, on both
    assert all(ranks[0][name] > 0 for name in ("all_reduce", "all_gather", "reduce_scatter", "latency"))
