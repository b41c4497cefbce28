"""The preference objectives' settings: selected by name or mapping as ``model.objective``, every bad setting named
in one error (with what cannot be honoured refused and why), and LLaMA-Factory's per-sequence SFT term
(``pref_ftx``, ``sft_average: sequence``) as LLaMA-Factory defines it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from objective_harness import harness, row_logps, save_folder, tokenized_pairs

from gym_lightning import CausalLMModule
from gym_lightning.errors import GymUserError
from gym_lightning.objectives import DPO, KTO, OBJECTIVES, ORPO, SimPO, objective_from_value


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("settings")
    return save_folder(root / "policy", seed=0), save_folder(root / "reference", seed=1)


def test_the_preference_objectives_are_registered_with_their_batches() -> None:
    assert {name: OBJECTIVES[name].batch_kind for name in ("dpo", "kto", "orpo", "simpo")} == {
        "dpo": "pairs", "kto": "unpaired", "orpo": "pairs", "simpo": "pairs"}  # fmt: skip
    value = {"name": "dpo", "beta": 0.2, "loss_type": ["sigmoid", "sft"], "loss_weights": [1, 0.5]}
    assert objective_from_value(value) == DPO(beta=0.2, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    assert objective_from_value({"class_path": "gym_lightning.objectives.kto.KTO", "init_args": {"beta": 0.3}}) == KTO(
        beta=0.3
    )
    assert objective_from_value("simpo") == SimPO() and objective_from_value("orpo") == ORPO()
    assert DPO(loss_type="ipo").settings()["loss_type"] == ["ipo"]  # TRL's DPOConfig turns a string into a list


BAD_SETTINGS = [
    (
        DPO(beta=0, loss_type=["sigmoid", "aot", "nope", "exo_pair"], loss_weights=[1.0], ld_alpha=0.5,
            use_weighting=True, sync_ref_model=True, f_divergence_type="forward_kl", sft_average="mean"),
        ["beta must be > 0", "'aot' sorts the log-ratios", "['nope'] is not a DPO loss type",
         "loss_weights has 1 weight(s) for 4 loss type(s)", "label_smoothing must be in (0, 1) for exo_pair",
         "ld_alpha (LD-DPO)", "use_weighting (WPO)", "sync_ref_model (TR-DPO)",
         "f_divergence_type 'forward_kl' applies to the loss types", "sft_average must be 'token'"],
    ),
    (DPO(loss_type="robust", label_smoothing=0.5), ["label_smoothing must be in [0, 0.5) for the robust loss"]),
    (DPO(f_divergence_type="chi2"), ["f_divergence_type must be one of reverse_kl"]),
    (
        KTO(beta=-1, loss_type="bco", desirable_weight=0, sync_ref_model=True),
        ["loss_type must be one of kto, apo_zero_unpaired", "beta must be > 0", "desirable_weight must be > 0",
         "sync_ref_model (TR-DPO)"],
    ),
    (SimPO(beta=0, cpo_alpha=-1, label_smoothing=0.5), ["beta must be > 0", "cpo_alpha must be >= 0",
                                                        "label_smoothing must be in [0, 0.5)"]),
    (ORPO(beta=0, sft_average="x"), ["beta must be > 0 (ORPO's lambda)", "sft_average must be 'token'"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("objective", "messages"), BAD_SETTINGS, ids=["dpo-all", "dpo-robust", "dpo-divergence", "kto", "simpo", "orpo"]
)
def test_every_bad_setting_is_named_in_one_error(objective: object, messages: list[str]) -> None:
    with pytest.raises(GymUserError) as error:
        CausalLMModule(objective=objective)
    text = str(error.value)
    assert f"({len(messages)} problem(s))" in text, text
    for message in messages:
        assert message in text, f"{message!r} not in {text}"


def test_good_settings_have_no_problems() -> None:
    for objective in (DPO(), DPO(loss_type=["sigmoid", "sft"], loss_weights=[1, 0.1], sft_average="sequence"),
                      DPO(loss_type="exo_pair", label_smoothing=1e-3), KTO(loss_type="apo_zero_unpaired"),
                      SimPO(cpo_alpha=1.0), ORPO(sft_average="sequence")):  # fmt: skip
        assert objective.problems() == [], objective


def test_dpo_pref_ftx_is_llamafactory_s_per_sequence_sft_term(folders: tuple[Path, Path]) -> None:
    """LLaMA-Factory's ``pref_ftx``: the DPO loss plus ``pref_ftx`` times the mean over pairs of each chosen
    completion's mean token NLL (``sft_loss = -chosen_logps / chosen_length``, ``losses += ftx * sft_loss``)."""
    batch = tokenized_pairs(folders[0])
    objective = DPO(beta=0.3, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.7], sft_average="sequence",
                    ref_model=str(folders[1]))  # fmt: skip
    ours = harness(folders[0], objective)
    loss = objective.training_step(ours, batch)
    (policy, count), (reference, _) = row_logps(ours.model, batch), row_logps(objective._reference.model, batch)
    (chosen, rejected), (ref_chosen, ref_rejected) = policy.chunk(2), reference.chunk(2)
    dpo = -F.logsigmoid(0.3 * ((chosen - ref_chosen) - (rejected - ref_rejected)))
    expected = (dpo + 0.7 * -(chosen / count.chunk(2)[0])).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_reference_free_pref_ftx_is_llamafactory_s(name: str, folders: tuple[Path, Path]) -> None:
    """LLaMA-Factory's ORPO (``sft_loss + beta * odds_ratio_loss``) and SimPO plus ``pref_ftx``, both over each
    completion's mean token log-probability, their SFT term each chosen completion's mean NLL."""
    batch = tokenized_pairs(folders[0])
    if name == "orpo":
        objective = ORPO(beta=0.4, sft_average="sequence")
    else:
        objective = SimPO(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.7, sft_average="sequence")
    ours = harness(folders[0], objective)
    loss = objective.training_step(ours, batch)
    policy, count = row_logps(ours.model, batch)
    chosen, rejected = (policy / count).chunk(2)
    if name == "orpo":
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        expected = (-chosen + 0.4 * -F.logsigmoid(log_odds)).mean()
    else:
        expected = (-F.logsigmoid(2.0 * (chosen - rejected - 0.5 / 2.0)) + 0.7 * -chosen).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
