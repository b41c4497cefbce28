"""A non-finite gradient on one rank (its loss finite) is skipped on every rank or on none, on 2 real CPU ranks,
under gym_fsdp (``16-mixed`` with its loss scaler, ``bf16-mixed`` with ``NonFiniteGuard(action="skip")``) and ZeRO
offload (``zero2_offload``, ``zero3_offload``: DeepSpeed's own overflow check, all-reduced with MAX).

``helpers.nonfinite_grad_worker`` poisons one element of rank 1's gradient in step 3 (global_step 2) and of both
ranks' in step 4, so that after the reduction the ranks hold different verdicts about their own shards. Each case
must skip both steps on both ranks and end with finite, equal weights; under ``16-mixed`` both ranks' scales must
have backed off twice. The second poisoning is the one torch's ``ShardedGradScaler`` gets wrong with fused
optimizers (its all-reduced flag sums to 2; ``precision.GymShardedGradScaler`` clamps it). What only a GPU shows
(the scale and the flag read from the host before their copies land, under ``cpu_offload``) is in
``test_nonfinite_offload.py``; on CPU ranks ``cpu_offload`` changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dist import HELPERS, run_ranks

pytestmark = pytest.mark.slow
WORKER = str(HELPERS / "nonfinite_grad_worker.py")
CASES = ("fsdp-16-mixed", "fsdp-bf16-skip", "zero2_offload-bf16", "zero3_offload-bf16")


def test_a_gradient_overflow_on_one_rank_is_skipped_on_every_rank(tmp_path: Path) -> None:
    run_ranks([WORKER, str(tmp_path), *CASES], timeout=600)
    for case in CASES:
        ranks = [json.loads((tmp_path / f"{case}.rank{rank}.json").read_text()) for rank in (0, 1)]
        for rank, result in enumerate(ranks):
            assert result["error"] is None and result["global_step"] == 5 and result["finite"], (case, rank, result)
        skips = {key: [r[key] for r in ranks] for key in ("guard_skipped", "engine_skipped", "scale")}
        for key, values in skips.items():
            assert values[0] == values[1], f"{case}: {key} differs between the ranks: {values}"
        if case == "fsdp-16-mixed":
            assert ranks[0]["scaler"] == "GymShardedGradScaler" and ranks[0]["scale"] == 16.0 / 4, ranks[0]
        elif case.startswith("fsdp"):
            assert ranks[0]["guard_skipped"] == 2, ranks[0]
        else:  # DeepSpeed skipped both steps itself; the guard saw finite losses
            assert ranks[0]["engine_skipped"] == 2 and ranks[0]["guard_skipped"] == 0, ranks[0]
