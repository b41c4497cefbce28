"""The LM engine apart from the objective: per-sequence log-probability sums for padded and packed batches (with
and without the chunked LM head), and a new objective added from outside, with no edit to the engine or module."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch

from gym_lightning import CausalLMModule
from gym_lightning.data.collate import packed_batch
from gym_lightning.data.formats import TokenizedSample
from gym_lightning.loss import IGNORE_INDEX, sequence_ids
from gym_lightning.objectives import OBJECTIVES, Objective, ValidationLoss, objective_from_value, register_objective

SHAPE = {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}


def _module(chunking: str, **kwargs: Any) -> CausalLMModule:
    torch.manual_seed(3)
    module = CausalLMModule(
        "tiny-qwen3", config_overrides=SHAPE, attn_implementation="eager", loss_chunking=chunking,
        loss_chunk_tokens=5, **kwargs,
    )  # fmt: skip
    module.configure_model()
    return module


def _padded_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 4096, (3, 11), generator=generator)
    labels[0, :4] = IGNORE_INDEX  # a masked prompt
    labels[2, -3:] = IGNORE_INDEX  # right padding
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[2, -3:] = 0
    return {"input_ids": labels.clamp(min=0), "attention_mask": mask, "labels": labels}


def _reference_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the summed log-probability of every next-token target, as TRL's ``selective_log_softmax`` sums it."""
    logps = torch.log_softmax(logits[:, :-1].float(), -1)
    targets = labels[:, 1:]
    picked = logps.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (picked * (targets != IGNORE_INDEX)).sum(-1)


@pytest.mark.parametrize("chunking", ["off", "on"])
def test_sequence_logps_are_each_row_s_target_log_probabilities(chunking: str) -> None:
    module, batch = _module(chunking), _padded_batch()
    out = module.engine.sequence_logps(module.model, batch)
    with torch.no_grad():
        logits = module.model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits
    torch.testing.assert_close(out.logps.detach(), _reference_logps(logits, batch["labels"]), rtol=1e-5, atol=1e-5)
    assert out.tokens.tolist() == (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1).tolist()
    summed, count, _ = module.engine.token_loss(module.model, batch)  # the same numbers, summed
    torch.testing.assert_close(-out.logps.sum(), summed, rtol=1e-5, atol=1e-4)
    assert int(count) == int(out.tokens.sum())


def test_chunking_changes_no_gradient_of_the_sequence_logps() -> None:
    grads = []
    for chunking in ("off", "on"):
        module = _module(chunking)
        out = module.engine.sequence_logps(module.model, _padded_batch())
        (out.logps * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
        grads.append({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_documents_get_the_log_probabilities_they_get_alone() -> None:
    """Padding-free packed rows (``cu_seq_lens``): each document's sum equals its own padded row's; the padding
    segment at the end of the shorter row is a sequence with no targets."""
    module = _module("on")
    docs = [[5, 9, 12, 7], [3, 8, 8], [100, 4, 6, 2, 1], [7, 7]]
    samples = [TokenizedSample(d, d) for d in docs]
    rows = [TokenizedSample(docs[0] + docs[1], [IGNORE_INDEX, *docs[0][1:], IGNORE_INDEX, *docs[1][1:]]),
            TokenizedSample(docs[2] + docs[3], [IGNORE_INDEX, *docs[2][1:], IGNORE_INDEX, *docs[3][1:]])]  # fmt: skip
    packed = packed_batch(rows, [[4, 3], [5, 2]], pad_token_id=0)
    ids, count = sequence_ids(packed)
    assert count == 4 and ids.tolist() == [[0, 0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, 3, 3]]
    out = module.engine.sequence_logps(module.model, packed)
    alone = [module.engine.sequence_logps(module.model, {"input_ids": torch.tensor([s.input_ids]),
             "labels": torch.tensor([[IGNORE_INDEX, *s.labels[1:]]])}).logps[0] for s in samples]  # fmt: skip
    torch.testing.assert_close(out.logps.detach(), torch.stack(alone).detach(), rtol=1e-5, atol=1e-5)
    assert out.tokens.tolist() == [len(d) - 1 for d in docs]


@register_objective
class MeanLogLikelihood(Objective):
    """A test objective from outside the package: minus the mean per-sequence log-likelihood, times ``weight``."""

    name: ClassVar[str] = "test-mean-loglik"

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    def problems(self) -> list[str]:
        return [] if self.weight > 0 else [f"weight must be > 0, got {self.weight}"]

    def training_step(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        out = module.engine.sequence_logps(module.model, batch)
        loss = -self.weight * (out.logps / out.tokens.clamp(min=1)).mean()
        module.log("train/loss", loss.detach())
        return loss

    def validation_loss(self, module: pl.LightningModule, batch: dict[str, Any]) -> ValidationLoss:
        out = module.engine.sequence_logps(module.model, batch)
        return ValidationLoss(-(out.logps / out.tokens.clamp(min=1)).mean(), torch.tensor(out.logps.numel()))


def test_a_new_objective_is_a_class_and_a_registration() -> None:
    assert OBJECTIVES["test-mean-loglik"] is MeanLogLikelihood
    for value in ("test-mean-loglik", {"name": "test-mean-loglik", "weight": 2.0},
                  {"class_path": f"{__name__}.MeanLogLikelihood", "init_args": {"weight": 2.0}}):  # fmt: skip
        assert isinstance(objective_from_value(value), MeanLogLikelihood)
    assert objective_from_value({"name": "test-mean-loglik", "weight": 2.0}) == MeanLogLikelihood(2.0)
    module = _module("off", objective=MeanLogLikelihood(2.0), lr=1e-2)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")  # fmt: skip
    batches = [_padded_batch()] * 2
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    with pytest.raises(ValueError, match="weight must be > 0"):
        CausalLMModule(objective=MeanLogLikelihood(-1.0))


def test_unknown_objectives_are_refused_naming_the_registered_ones() -> None:
    for value, match in [("dpo-typo", "not an objective; choose one of"), ({"weight": 1}, "names no objective"),
                         ({"class_path": "os.system"}, "not a registered objective")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            objective_from_value(value)
