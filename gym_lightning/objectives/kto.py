"""KTO (``kto``): TRL 1.16 ``KTOTrainer``'s loss over unpaired desirable and undesirable completions of an
``unpaired`` batch. https://huggingface.co/papers/2402.01306

Rows ``0..B-1`` hold each example's prompt and completion, rows ``B..2B-1`` the mismatched KL rows (prompt ``i``
with another example's completion; TRL rotates the completions by one: ``i-1 mod B``). The KL term is the
policy-minus-reference log-ratio of the KL rows, detached, averaged over the data-parallel ranks (TRL gathers it)
and clamped at 0: its forward runs without gradient and its all-reduce overlaps the policy's forward of the
completion rows. TRL's ``nonzero``/``index_select`` on the labels become masks here (no host sync).
Normalisation and metrics: ``objectives.preference``; the desirable and undesirable means pool the step's examples
over ranks (NaN for a step without desirable, or undesirable, examples, where TRL leaves the metric out). A
validation batch's KL term is its rank's own (no collective per validation batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from typing_extensions import override

from gym_lightning.errors import GymUserError
from gym_lightning.objectives.base import ValidationLoss, register_objective
from gym_lightning.objectives.preference import (
    KTO_LABELS_KEY,
    PendingSum,
    Precomputed,
    PreferenceObjective,
    ReferenceDType,
    ReferenceSettings,
    check_padded,
    count_of,
    log_validation_metrics,
    reference_dtype_problems,
    rows_of,
    with_router_loss,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

LOSS_TYPES = ("kto", "apo_zero_unpaired")
METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")


@register_objective
class KTO(PreferenceObjective):
    """KTO, TRL's ``KTOConfig`` fields (LLaMA-Factory's ``stage: kto`` in brackets).

    Args:
        beta: The deviation from the reference [``pref_beta``].
        loss_type: ``kto``, or ``apo_zero_unpaired`` (APO-zero's unpaired form, no KL term).
        desirable_weight: The weight of desirable examples' losses [``kto_chosen_weight``].
        undesirable_weight: The weight of undesirable examples' losses [``kto_rejected_weight``].
        precompute_ref_log_probs: Read the reference's log-probabilities of all ``2B`` rows from the batches
            (``reference_logps``) instead of running a reference.
        ref_model: The reference's folder or hub name; default: a frozen copy of the policy's source or, with LoRA,
            the policy with its adapters off [``ref_model``].
        reference_dtype: The parameters' dtype of a frozen reference (``bfloat16``: half an fp32 reference's
            memory); default: the policy's compute dtype as the strategy holds it. ZeRO-3 holds it in the engine's.
        disable_dropout: Set every dropout probability of the policy to 0 (TRL's default).
        router_aux_loss_coef: The weight of a mixture of experts' router loss when its forward returns one;
            ``None``: the model config's.
        sync_ref_model: TR-DPO's reference updates: refused unless false (the reference is frozen).
    """

    name: ClassVar[str] = "kto"
    batch_kind: ClassVar[str] = "unpaired"

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "kto",
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        precompute_ref_log_probs: bool = False,
        ref_model: str | None = None,
        reference_dtype: ReferenceDType | None = None,
        disable_dropout: bool = True,
        router_aux_loss_coef: float | None = None,
        sync_ref_model: bool = False,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.loss_type = loss_type
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight
        self.precompute_ref_log_probs = precompute_ref_log_probs
        self.ref_model = ref_model
        self.reference_dtype = reference_dtype
        self.disable_dropout = disable_dropout
        self.router_aux_loss_coef = router_aux_loss_coef
        self.sync_ref_model = sync_ref_model

    @override
    def problems(self) -> list[str]:
        found = []
        if self.loss_type not in LOSS_TYPES:
            found.append(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if not self.beta > 0:
            found.append(f"beta must be > 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                found.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            found.append(
                f"router_aux_loss_coef must be >= 0 or null (the model config's), got {self.router_aux_loss_coef}"
            )
        if self.sync_ref_model:
            found.append(
                "sync_ref_model (TR-DPO) mixes the policy into the reference during training; the reference here is "
                "frozen (or absent: LoRA, precompute_ref_log_probs): set it false"
            )
        return found + reference_dtype_problems(self.reference_dtype)

    @override
    def reference_settings(self) -> ReferenceSettings:
        return ReferenceSettings(self.precompute_ref_log_probs, self.ref_model, self.reference_dtype)

    @property
    def uses_kl(self) -> bool:
        """Whether the loss has the KL term (TRL's ``calculate_KL``)."""
        return self.loss_type == "kto"

    @override
    def training_step(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        loss, logged, values = self._loss(module, batch, training=True)
        module.log("train/loss", logged, on_step=True, on_epoch=False)
        means = self._metrics.update(module, values)
        for name, value in zip(METRICS, means.unbind(), strict=True):
            module.log(name, value, on_step=True, on_epoch=False)
        module.log("rewards/margins", means[1] - means[3], on_step=True, on_epoch=False)
        return loss

    @override
    def validation_loss(self, module: pl.LightningModule, batch: dict[str, Any]) -> ValidationLoss:
        _, logged, values = self._loss(module, batch, training=False)
        log_validation_metrics(module, values)
        return ValidationLoss(logged, count_of(batch["input_ids"].size(0) // 2, logged.device))

    def _reference_logps(self, module: pl.LightningModule, batch: dict[str, Any], examples: int) -> torch.Tensor:
        """The reference's log-probabilities of the rows the loss reads: all ``2B`` with the KL term, else the
        completion rows (a precomputed batch holds all of them)."""
        reference = self.reference(module)
        if self.uses_kl or isinstance(reference, Precomputed):
            return reference.logps(module, batch)
        return reference.logps(module, rows_of(batch, slice(0, examples)))

    def _start_kl(
        self, module: pl.LightningModule, batch: dict[str, Any], reference: torch.Tensor, training: bool
    ) -> PendingSum | None:
        """Start summing the KL rows' log-ratio and their count over ranks (``None`` without the KL term)."""
        if not self.uses_kl:
            return None
        examples = reference.numel() // 2
        with torch.no_grad():
            kl_logps = module.engine.sequence_logps(module.model, rows_of(batch, slice(examples, None))).logps
        local = torch.stack([(kl_logps - reference[examples:]).sum(), count_of(examples, kl_logps.device)])
        return PendingSum(local, module.trainer.world_size if training else 1)

    def _loss(
        self, module: pl.LightningModule, batch: dict[str, Any], training: bool
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The loss to back-propagate, this micro-batch's loss as TRL computes it (logged), and the metrics."""
        examples = check_padded(batch, "unpaired")
        if KTO_LABELS_KEY not in batch:
            raise GymUserError(f"A KTO batch needs '{KTO_LABELS_KEY}' (one bool per example: desirable or not).")
        desirable = batch[KTO_LABELS_KEY].to(dtype=torch.bool).reshape(-1)
        step_examples = self.start_pair_count(module, batch, examples) if training else None
        reference = self._reference_logps(module, batch, examples)
        kl_sums = self._start_kl(module, batch, reference, training)
        out = module.engine.sequence_logps(module.model, rows_of(batch, slice(0, examples)))
        logps = out.logps
        ratio = logps - reference[:examples]
        kl = torch.zeros((), device=logps.device)
        if kl_sums is not None:
            total, count = kl_sums.get()
            kl = (total / count.clamp(min=1.0)).clamp(min=0)
        beta = self.beta
        if self.uses_kl:
            chosen_losses, rejected_losses = (
                1 - torch.sigmoid(beta * (ratio - kl)),
                1 - torch.sigmoid(beta * (kl - ratio)),
            )
        else:  # APO-zero unpaired (https://huggingface.co/papers/2408.06266)
            chosen_losses, rejected_losses = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
        losses = torch.where(
            desirable, self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses
        )
        loss, logged = self.pair_mean(module, losses, step_examples), losses.mean()
        loss, logged = with_router_loss(module, loss, logged, out.router_aux, self.router_aux_loss_coef)
        rewards = beta * ratio.detach()
        num_desirable, num_undesirable = desirable.float().sum(), (~desirable).float().sum()
        values = {
            "kl": (kl.detach(), count_of(1, kl.device)),
            "rewards/chosen": (torch.where(desirable, rewards, 0.0).sum(), num_desirable),
            "logps/chosen": (torch.where(desirable, logps.detach(), 0.0).sum(), num_desirable),
            "rewards/rejected": (torch.where(desirable, 0.0, rewards).sum(), num_undesirable),
            "logps/rejected": (torch.where(desirable, 0.0, logps.detach()).sum(), num_undesirable),
        }
        return loss, logged.detach(), values


__all__ = ["KTO"]
