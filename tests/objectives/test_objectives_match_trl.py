"""The preference objectives against TRL 1.16's trainers, their reference definition: on the same tiny model folders
(policy, and a different reference model for DPO/KTO, so that the rewards are not zero), the same collated rows and
settings, one full batch in fp32, the loss and every metric both log agree within 1e-4. TRL's logits/entropy/token
accuracy metrics are not logged by gym (they need the logits, which the engine does not keep).

Each trainer is built once; a case sets the settings its ``compute_loss`` reads. Run with ``-s`` to print the
largest differences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from objective_harness import (
    PAIRS,
    UNPAIRED,
    concatenated_batch,
    differences,
    harness,
    pairs_batch,
    save_folder,
    unpaired_batch,
)
from trl_reference import cpo_step, cpo_trainer, dpo_step, dpo_trainer, kto_step, kto_trainer

from gym_lightning.objectives import DPO, KTO, ORPO, SimPO

TOLERANCE = 1e-4
PAIR_METRICS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"}  # fmt: skip
KTO_METRICS = {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("preference")
    return save_folder(root / "policy", seed=0), save_folder(root / "reference", seed=1)


@pytest.fixture(scope="module")
def trl_dpo(folders: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    return dpo_trainer(*folders, PAIRS, tmp_path_factory.mktemp("dpo"))


def _check(case: str, trl_loss: float, trl_metrics: dict[str, float], ours: Any, loss: torch.Tensor, names: set[str]):
    found = differences(trl_loss, trl_metrics, ours, names)
    detail = ", ".join(f"{name} {value:.1e}" for name, value in found.items())
    print(f"\n{case}: max |ours - TRL| = {max(found.values()):.2e} ({detail})")
    assert max(found.values()) <= TOLERANCE, found
    assert abs(float(loss) - trl_loss) <= TOLERANCE  # what is back-propagated: one process, no step_pairs


DPO_CASES = [
    {"loss_type": "sigmoid", "beta": 0.5},
    {"loss_type": "ipo", "beta": 0.5},
    {"loss_type": "hinge", "beta": 2.0},
    {"loss_type": "robust", "beta": 0.5, "label_smoothing": 0.2},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.3], "beta": 0.5},
    {"loss_type": ["ipo", "sft"], "loss_weights": [0.5, 1.0], "beta": 0.5},
    {"loss_type": "exo_pair", "beta": 0.5, "label_smoothing": 1e-3},
    {"loss_type": "nca_pair", "beta": 0.5},
    {"loss_type": "bco_pair", "beta": 0.5},
    {"loss_type": "sppo_hard", "beta": 0.5},
    {"loss_type": "apo_zero", "beta": 0.5},
    {"loss_type": "apo_down", "beta": 0.5},
    {"loss_type": "discopop", "beta": 0.5, "discopop_tau": 0.1},
    {"loss_type": "sigmoid_norm", "beta": 0.5},
    {"loss_type": "sigmoid", "beta": 0.5, "f_divergence_type": "forward_kl"},
    {"loss_type": "sigmoid", "beta": 0.5, "f_divergence_type": "js_divergence"},
    {"loss_type": ["sigmoid", "ipo"], "beta": 0.5, "f_divergence_type": "alpha_divergence",
     "f_alpha_divergence_coef": 0.3},
]  # fmt: skip


@pytest.mark.parametrize("settings", DPO_CASES, ids=lambda s: f"{s['loss_type']}-{s.get('f_divergence_type', 'kl')}")
def test_dpo_loss_and_metrics_equal_trl(settings: dict[str, Any], folders: tuple[Path, Path], trl_dpo: Any) -> None:
    batch, trl_loss, trl_metrics = dpo_step(trl_dpo, settings)
    objective = DPO(ref_model=str(folders[1]), **settings)
    ours = harness(folders[0], objective)
    loss = objective.training_step(ours, pairs_batch(batch))
    _check(f"dpo {settings}", trl_loss, trl_metrics, ours, loss, PAIR_METRICS)


@pytest.mark.parametrize(
    "settings",
    [
        {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0, "label_smoothing": 0.0, "alpha": 0.0},
        {"beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 1.0, "label_smoothing": 0.1, "alpha": 0.0},
        {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0, "label_smoothing": 0.0, "alpha": 0.3},
    ],
    ids=["simpo", "simpo-cpo_alpha-smoothing", "alphapo"],
)
def test_simpo_loss_and_metrics_equal_trl_cpo(settings: dict[str, Any], folders: tuple[Path, Path], tmp_path: Path):
    trainer = cpo_trainer(folders[0], PAIRS, tmp_path)
    batch, trl_loss, trl_metrics = cpo_step(trainer, {"loss_type": "simpo", **settings})
    objective = SimPO(**settings)
    ours = harness(folders[0], objective)
    loss = objective.training_step(ours, concatenated_batch(batch))
    names = PAIR_METRICS | ({"nll_loss"} if settings["cpo_alpha"] else set())
    _check(f"simpo {settings}", trl_loss, trl_metrics, ours, loss, names)


@pytest.mark.parametrize("chunking", ["off", "on"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_loss_and_metrics_equal_trl(beta: float, chunking: str, folders: tuple[Path, Path], tmp_path: Path):
    """TRL's NLL covers the prompt tokens too; with the chunked LM head the segments run through chunks as well."""
    trainer = cpo_trainer(folders[0], PAIRS, tmp_path, orpo=True)
    batch, trl_loss, trl_metrics = cpo_step(trainer, {"beta": beta})
    objective = ORPO(beta=beta)
    ours = harness(folders[0], objective, loss_chunking=chunking, loss_chunk_tokens=7)
    loss = objective.training_step(ours, concatenated_batch(batch))
    names = PAIR_METRICS | {"nll_loss", "log_odds_ratio", "log_odds_chosen"}
    _check(f"orpo beta={beta} chunking={chunking}", trl_loss, trl_metrics, ours, loss, names)


@pytest.mark.parametrize(
    ("loss_type", "settings"),
    [
        ("kto", {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}),
        ("kto", {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.33}),
        ("apo_zero_unpaired", {"beta": 0.5, "desirable_weight": 1.2, "undesirable_weight": 1.0}),
    ],
)
def test_kto_loss_and_metrics_equal_trl(
    loss_type: str, settings: dict[str, Any], folders: tuple[Path, Path], tmp_path: Path
) -> None:
    """Five examples, three desirable: the KL rows are TRL's cycled completions."""
    trainer = kto_trainer(*folders, UNPAIRED, tmp_path, loss_type=loss_type)
    batch, trl_loss, trl_metrics = kto_step(trainer, settings)
    objective = KTO(ref_model=str(folders[1]), loss_type=loss_type, **settings)
    ours = harness(folders[0], objective)
    loss = objective.training_step(ours, unpaired_batch(batch))
    _check(f"kto {loss_type} {settings}", trl_loss, trl_metrics, ours, loss, KTO_METRICS)
