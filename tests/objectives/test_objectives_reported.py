"""Every step metric a preference objective logs is one that ``CurvesCallback`` records (and ``trainer_state.json``
reports, under TRL's name): a metric added to an objective without it would reach the loggers but not the log
history a TRL user reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from objective_harness import harness, save_folder, tokenized_pairs, tokenized_unpaired

from gym_lightning.callbacks.curves import PREFERENCE_METRICS
from gym_lightning.objectives import DPO, KTO, ORPO, SimPO


@pytest.mark.parametrize(
    "make",
    [
        lambda: DPO(loss_type=["sigmoid", "sft"]),
        lambda: KTO(),
        lambda: ORPO(),
        lambda: SimPO(cpo_alpha=1.0),
    ],
    ids=["dpo", "kto", "orpo", "simpo"],
)
def test_every_logged_step_metric_is_recorded(make: Any, tmp_path: Path) -> None:
    folder = save_folder(tmp_path / "policy", seed=0)
    objective = make()
    ours = harness(folder, objective)
    batch = tokenized_unpaired(folder) if objective.batch_kind == "unpaired" else tokenized_pairs(folder)
    objective.training_step(ours, batch)
    objective.validation_loss(ours, batch)
    train = set(ours.logged) - {"train/loss"} - {name for name in ours.logged if name.startswith("val/")}
    validation = {name.removeprefix("val/") for name in ours.logged if name.startswith("val/")}
    assert "rewards/margins" in train and "rewards/chosen" in validation
    assert train <= set(PREFERENCE_METRICS), sorted(train - set(PREFERENCE_METRICS))
    assert validation <= set(PREFERENCE_METRICS), sorted(validation - set(PREFERENCE_METRICS))
