"""What one preference training step runs (issue 57, item 7): counted with hooks through a real ``Trainer.fit``.

A DPO step is the policy's forward and backward over the concatenated batch (chosen and rejected rows, ``[2B, T]``,
in one forward) plus one reference forward without gradient, and nothing else: no second policy pass, no separate
chosen / rejected forwards. The hooks record each decoder forward (whose model, how many rows, whether gradients
are on, whether LoRA adapters are switched off) and each backward through the policy (a trainable parameter's
post-accumulate-grad hook fires once per backward), per training step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from objective_harness import save_folder, tokenized_pairs, tokenized_unpaired

from gym_lightning import CausalLMModule
from gym_lightning.engine import base_model_of
from gym_lightning.lora import LoRAArgs
from gym_lightning.objectives import DPO, KTO, ORPO, SimPO
from gym_lightning.objectives.base import Objective
from gym_lightning.objectives.preference import REFERENCE_LOGPS_KEY, FrozenCopy


class Pass(NamedTuple):
    """One decoder forward: ``model`` (policy / reference), its rows, gradients on, adapters switched off."""

    model: str
    rows: int
    grad: bool
    adapters_off: bool = False


def _adapters_off(model: torch.nn.Module) -> bool:
    """Whether peft's ``disable_adapter`` is in effect on ``model``'s LoRA layers (False without LoRA)."""
    flags = [m.disable_adapters for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "disable_adapters")]
    return bool(flags) and all(flags)


class PassCounter(pl.Callback):
    """Per training step, the decoder forwards of the policy and of a frozen reference copy, and the backwards."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[Pass], int]] = []
        self._passes: list[Pass] = []
        self._backwards = 0

    def _hook(self, name: str, root: torch.nn.Module) -> Any:
        def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = kwargs.get("input_ids")
            rows = (ids if ids is not None else kwargs["inputs_embeds"]).size(0)
            self._passes.append(Pass(name, rows, torch.is_grad_enabled(), _adapters_off(root)))

        return record

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        decoder = base_model_of(pl_module.model).model  # LlamaModel: once per pass through the policy
        decoder.register_forward_pre_hook(self._hook("policy", pl_module.model), with_kwargs=True)
        reference = pl_module.objective._reference
        if isinstance(reference, FrozenCopy) and reference.model is not None:
            reference.model.model.register_forward_pre_hook(self._hook("reference", reference.model), with_kwargs=True)
        trainable = next(p for p in pl_module.model.parameters() if p.requires_grad)
        trainable.register_post_accumulate_grad_hook(lambda _: self._count_backward())

    def _count_backward(self) -> None:
        self._backwards += 1

    def on_train_batch_start(self, *args: Any) -> None:
        self._passes, self._backwards = [], 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append((self._passes, self._backwards))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("passes")
    return save_folder(root / "policy", seed=0), save_folder(root / "reference", seed=1)


def passes_per_step(objective: Objective, folder: Path, **module_args: Any) -> list[tuple[list[Pass], int]]:
    """A 2-step fit of ``objective`` on one process; each step's passes and backwards."""
    batch = tokenized_unpaired(folder) if objective.batch_kind == "unpaired" else tokenized_pairs(folder)
    if getattr(objective, "precompute_ref_log_probs", False):  # the stored values a prepared data set carries
        batch[REFERENCE_LOGPS_KEY] = torch.zeros(batch["input_ids"].size(0))
    module = CausalLMModule(str(folder), objective=objective, lr=1e-3, scheduler="constant", **module_args)
    counter = PassCounter()
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", limit_val_batches=0, callbacks=[counter], **quiet)
    trainer.fit(module, torch.utils.data.DataLoader([batch] * 2, batch_size=None))
    assert len(counter.steps) == 2
    return counter.steps


def test_a_dpo_step_is_one_policy_pass_over_both_rows_and_one_reference_forward(folders: tuple[Path, Path]) -> None:
    rows = tokenized_pairs(folders[0])["input_ids"].size(0)  # 2B: B chosen rows, then B rejected rows
    for passes, backwards in passes_per_step(DPO(ref_model=str(folders[1])), folders[0]):
        assert passes == [Pass("reference", rows, grad=False), Pass("policy", rows, grad=True)]
        assert backwards == 1


def test_a_lora_dpo_step_runs_its_reference_as_the_base_with_adapters_off(folders: tuple[Path, Path]) -> None:
    rows = tokenized_pairs(folders[0])["input_ids"].size(0)
    for passes, backwards in passes_per_step(DPO(), folders[0], lora=LoRAArgs(r=2)):
        assert passes == [Pass("policy", rows, False, adapters_off=True), Pass("policy", rows, True)]
        assert backwards == 1


@pytest.mark.parametrize(
    "objective", [DPO(precompute_ref_log_probs=True), ORPO(), SimPO()], ids=["dpo-precomputed", "orpo", "simpo"]
)
def test_without_a_reference_forward_a_step_is_one_policy_pass(objective: Objective, folders: tuple[Path, Path]):
    rows = tokenized_pairs(folders[0])["input_ids"].size(0)
    for passes, backwards in passes_per_step(objective, folders[0]):
        assert passes == [Pass("policy", rows, grad=True)] and backwards == 1


def test_a_kto_step_trains_the_completions_and_runs_the_kl_rows_without_gradient(folders: tuple[Path, Path]):
    rows = tokenized_unpaired(folders[0])["input_ids"].size(0)  # B completion rows, then B KL rows
    for passes, backwards in passes_per_step(KTO(ref_model=str(folders[1])), folders[0]):
        expected = [Pass("reference", rows, False), Pass("policy", rows // 2, False), Pass("policy", rows // 2, True)]
        assert passes == expected and backwards == 1
