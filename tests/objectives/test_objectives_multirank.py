"""2 ranks = 1 process for the preference objectives' normalisation (``objectives.preference``): 2 gloo ranks, each
with half of a batch, give the loss (rank mean), the DDP-averaged gradients and the logged metrics (at a logging step:
all-reduced) that 1 process gives on the whole batch. The cases cover the token-mean terms (TRL's ``sft``, CPO's and
ORPO's NLL over the micro-batch's tokens of every rank), ``step_pairs``, and KTO's KL term averaged over ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.dist import rank_env, run_python
from objective_harness import save_folder
from preference_rank_worker import cases, run_case


@pytest.mark.slow
def test_two_ranks_give_what_one_process_gives(tmp_path: Path) -> None:
    folder, reference = save_folder(tmp_path / "policy", seed=0), save_folder(tmp_path / "reference", seed=1)
    out = tmp_path / "ranks.pt"
    worker = Path(__file__).with_name("preference_rank_worker.py")
    run_python([str(worker), str(folder), str(reference), str(out)], timeout=600, env=rank_env())
    ranks = torch.load(out, weights_only=True)
    for name, make in cases(str(reference)).items():
        one = run_case(name, make, str(folder), rank=0, world=1)
        two = ranks[name]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5), name
        torch.testing.assert_close(two["grads"], one["grads"], rtol=1e-5, atol=1e-6, msg=name)
        assert two["metrics"].keys() == one["metrics"].keys() and one["metrics"], name
        assert two["metrics"] == pytest.approx(one["metrics"], abs=1e-5), name
