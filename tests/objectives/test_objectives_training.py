"""The preference objectives in training: a Lightning fit with validation logs TRL's metric names and saves no
reference, a quiet step makes no host sync, the step metrics pool an optimizer step's micro-batches, and
``step_pairs`` normalises over the step's pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from objective_harness import harness, save_folder, tokenized_pairs, tokenized_unpaired

from benchmarks.common.host_syncs import HostSyncCounter, counting_host_syncs
from gym_lightning import CausalLMModule
from gym_lightning.objectives import DPO, KTO, ORPO, SimPO
from gym_lightning.objectives.base import Objective

PAIR_NAMES = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected"]  # fmt: skip
KTO_NAMES = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("training")
    return save_folder(root / "policy", seed=0), save_folder(root / "reference", seed=1)


def batches_of(objective: Objective, folder: Path) -> list[dict[str, torch.Tensor]]:
    return [tokenized_unpaired(folder) if objective.batch_kind == "unpaired" else tokenized_pairs(folder)] * 2


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_a_fit_logs_trl_s_metrics_and_saves_no_reference(kind: str, folders: tuple[Path, Path], tmp_path: Path):
    objective = DPO(loss_type=["sigmoid", "sft"], ref_model=str(folders[1])) if kind == "dpo" else KTO()
    module = CausalLMModule(str(folders[0]), objective=objective, lr=1e-3, scheduler="constant")
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(max_steps=2, accumulate_grad_batches=2, log_every_n_steps=1, accelerator="cpu",
                         limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0, **quiet)  # fmt: skip
    loader = torch.utils.data.DataLoader(batches_of(objective, folders[0]) * 2, batch_size=None)
    trainer.fit(module, loader, torch.utils.data.DataLoader(batches_of(objective, folders[0])[:1], batch_size=None))
    names = PAIR_NAMES if kind == "dpo" else KTO_NAMES
    logged = trainer.logged_metrics
    assert {*names, "train/loss", "val/loss"} <= logged.keys(), sorted(logged)
    assert {f"val/{n}" for n in names if n != "rewards/margins" or kind == "dpo"} <= logged.keys(), sorted(logged)
    assert all(torch.isfinite(logged[name]) for name in names)
    assert float(logged["rewards/margins"]) != 0  # the policy moved away from its reference
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert set(checkpoint["state_dict"]) == {f"model.{k}" for k in module.model.state_dict()}
    assert checkpoint["hyper_parameters"]["objective"] == objective
    restored = CausalLMModule.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert restored.objective == objective  # its settings; a frozen copy is built again, at the next fit's start
    assert getattr(restored.objective._reference, "model", None) is None


def quiet_step_syncs(objective: Objective, folder: Path, **extra: torch.Tensor) -> list[str]:
    """Host syncs of a training step at a step that does not log, outside the model's forward (transformers' own
    padding-mask check, one per forward, which a plain loop makes too)."""
    ours = harness(folder, objective)
    ours.trainer.log_every_n_steps = 10  # global step 0 is no logging step
    batch = {**batches_of(objective, folder)[0], **extra}
    objective.training_step(ours, batch)  # first call: builds what is built once
    counter = HostSyncCounter(counting=True)
    with counting_host_syncs(counter):
        objective.training_step(ours, batch).backward()
    return [f"{e.op} @ {' <- '.join(e.chain[-4:])}" for e in counter.events if "transformers/" not in "".join(e.chain)]


@pytest.mark.parametrize(
    "make",
    [
        lambda ref: DPO(loss_type=["sigmoid", "sft", "ipo"], ref_model=ref),
        lambda ref: DPO(precompute_ref_log_probs=True),
        lambda ref: KTO(ref_model=ref),
        lambda ref: ORPO(),
        lambda ref: SimPO(cpo_alpha=1.0),
    ],
    ids=["dpo", "dpo-precomputed", "kto", "orpo", "simpo"],
)
def test_a_quiet_step_makes_no_host_sync(make: Any, folders: tuple[Path, Path]) -> None:
    objective = make(str(folders[1]))
    extra = {"reference_logps": torch.zeros(8), "step_pairs": torch.tensor(4)} if objective.name == "dpo" else {}
    assert quiet_step_syncs(objective, folders[0], **extra) == []


def test_step_metrics_pool_an_optimizer_step_s_micro_batches(folders: tuple[Path, Path]) -> None:
    objective = DPO(beta=0.5, ref_model=str(folders[1]))
    ours = harness(folders[0], objective)
    batch = tokenized_pairs(folders[0])
    first = {k: v[[0, 1, 4, 5]] for k, v in batch.items()}  # pairs 0-1
    second = {k: v[[2, 3, 6, 7]] for k, v in batch.items()}  # pairs 2-3
    means = []
    for part in (first, second, batch):
        objective.training_step(ours, part)
        means.append(ours.values(*PAIR_NAMES))
    # the whole batch is the third micro-batch of the same step: its mean is the mean of all three micro-batches
    for name in PAIR_NAMES:
        assert means[1][name] == pytest.approx(means[2][name], abs=1e-5), name
    ours.trainer.global_step = 1  # a new optimizer step starts a new mean
    objective.training_step(ours, first)
    assert ours.values(*PAIR_NAMES) == pytest.approx(means[0], abs=1e-6)


def test_step_pairs_normalise_over_the_step_s_pairs(folders: tuple[Path, Path]) -> None:
    """With ``step_pairs`` the pair losses are summed and divided by the step's pairs, Lightning's division by the
    accumulation count undone: 2 micro-batches of 4 pairs each give 2 x sum / 8 = the micro-batch mean."""
    objective = DPO(beta=0.5, ref_model=str(folders[1]))
    ours = harness(folders[0], objective)
    ours.trainer.accumulate_grad_batches = 2
    batch = tokenized_pairs(folders[0])
    plain = objective.training_step(ours, batch)
    step = objective.training_step(ours, {**batch, "step_pairs": torch.tensor(8)})
    torch.testing.assert_close(step, plain * 2 * 4 / 8)
    uneven = objective.training_step(ours, {**batch, "step_pairs": torch.tensor(5)})  # a short last micro-batch
    torch.testing.assert_close(uneven, plain * 2 * 4 / 5)
