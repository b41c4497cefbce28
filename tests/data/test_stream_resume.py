"""``streaming: true`` resumes exactly in a real 2-rank run: the resumed run trains on the batches the uninterrupted
run trained on after the checkpoint, rank by rank (tests/helpers/stream_resume_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dist import HELPERS, run_ranks

WORKER = str(HELPERS / "stream_resume_worker.py")


def run(train: Path, out: Path, max_steps: int, resume: str) -> list[list[dict]]:
    out.mkdir(parents=True)
    run_ranks([WORKER, str(train), str(out), str(max_steps), resume], timeout=600)
    return [json.loads((out / f"seen.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_streaming_two_ranks_resume_sees_exactly_the_uninterrupted_batches(tmp_path):
    # 60 records of distinct lengths: 30 per rank, 15 micro-batches of 2, windows of 2 micro-batches per step.
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i) + "!" * (i % 5)} for i in range(60)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    full = run(train, tmp_path / "full", max_steps=5, resume="none")
    checkpoint = tmp_path / "full" / "ckpt" / "epoch=0-step=2.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in (tmp_path / "full" / "ckpt").iterdir())
    resumed = run(train, tmp_path / "resumed", max_steps=5, resume=str(checkpoint))
    for rank in (0, 1):
        assert [b["step"] for b in full[rank]] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        assert resumed[rank] == full[rank][4:]  # same ids, same steps, same step token counts
    ranks = [{tuple(row) for b in full[rank] for row in b["ids"]} for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 20 and not ranks[0] & ranks[1]  # each rank its own share
