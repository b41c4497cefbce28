"""The non-finite guard on 2 real CPU ranks: a NaN loss on one rank only is seen, and acted on, by every rank.

The per-rank flags travel in one collective per optimizer step (NonFiniteGuard._nonfinite_ranks). If a rank decided
alone, the other would block in the next collective (the test's timeout) or the replicas would drift apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dist import HELPERS, run_ranks

pytestmark = pytest.mark.slow
WORKER = str(HELPERS / "nonfinite_worker.py")


def run(tmp_path: Path, strategy: str, action: str) -> dict[int, dict]:
    run_ranks([WORKER, str(tmp_path), strategy, action], timeout=300)
    files = {rank: tmp_path / f"rank{rank}.json" for rank in (0, 1)}
    return {rank: json.loads(path.read_text()) for rank, path in files.items() if path.exists()}


def test_skip_drops_the_same_step_on_every_rank(tmp_path: Path) -> None:
    ranks = run(tmp_path, "gym_ddp", "skip")
    assert set(ranks) == {0, 1}
    for result in ranks.values():
        assert result["error"] is None and result["global_step"] == 5 and result["skipped"] == 1 and result["finite"]
    assert ranks[0]["checksum"] is not None


def test_stop_raises_on_the_rank_whose_loss_is_finite_too(tmp_path: Path) -> None:
    # ZeRO-2: the engine keeps the gradients, so only the loss flags (and their collective) can catch it.
    ranks = run(tmp_path, "zero2", "stop")
    assert ranks[0]["error"] is not None, ranks
    assert "loss (NaN or inf) on rank(s) [1] in optimizer step 3" in ranks[0]["error"]
