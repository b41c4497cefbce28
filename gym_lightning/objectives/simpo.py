"""SimPO (``simpo``), reference-free: TRL 1.16's ``CPOTrainer`` with ``loss_type="simpo"``, over the policy's
length-normalised completion log-probabilities of a ``pairs`` batch. https://huggingface.co/papers/2405.14734

The reward of a completion is ``beta`` times its mean token log-probability; the loss asks the chosen reward to beat
the rejected one by the margin ``simpo_gamma``. CPO's behaviour-cloning term (``cpo_alpha``: the chosen completions'
NLL) and AlphaPO's reward shape (``alpha``) are formulas over the same sums, so both are here too. Normalisation and
metrics: ``objectives.preference``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from typing_extensions import override

from gym_lightning.objectives.base import ValidationLoss, register_objective
from gym_lightning.objectives.preference import (
    PreferenceObjective,
    SftAverage,
    check_padded,
    count_of,
    log_validation_metrics,
    pair_metrics,
    start_token_count,
    token_mean_scale,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl


@register_objective
class SimPO(PreferenceObjective):
    """SimPO, TRL's ``CPOConfig`` fields (LLaMA-Factory's ``stage: dpo``, ``pref_loss: simpo`` in brackets).

    Args:
        beta: The reward scale [``pref_beta``].
        simpo_gamma: The target reward margin [``simpo_gamma``].
        cpo_alpha: The weight of the chosen completions' NLL (CPO's behaviour cloning; 0: SimPO) [``pref_ftx``,
            with ``sft_average: sequence``].
        label_smoothing: The conservative (label-smoothed) form's flip probability, in [0, 0.5).
        alpha: AlphaPO's reward shape: the reward ``(1 - p^-alpha) / alpha`` of the mean token probability ``p``
            (0: the log-probability, SimPO).
        sft_average: How the NLL averages: ``token``: TRL's, the mean over the chosen completions' tokens of the
            micro-batch; ``sequence``: LLaMA-Factory's ``pref_ftx``, each chosen completion's mean, over pairs.
        disable_dropout: Set every dropout probability of the policy to 0 (TRL's default).
    """

    name: ClassVar[str] = "simpo"

    def __init__(
        self,
        beta: float = 0.1,
        simpo_gamma: float = 0.5,
        cpo_alpha: float = 0.0,
        label_smoothing: float = 0.0,
        alpha: float = 0.0,
        sft_average: SftAverage = "token",
        disable_dropout: bool = True,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.simpo_gamma = simpo_gamma
        self.cpo_alpha = cpo_alpha
        self.label_smoothing = label_smoothing
        self.alpha = alpha
        self.sft_average = sft_average
        self.disable_dropout = disable_dropout

    @override
    def problems(self) -> list[str]:
        found = []
        if not self.beta > 0:
            found.append(f"beta must be > 0, got {self.beta}")
        if self.cpo_alpha < 0:
            found.append(f"cpo_alpha must be >= 0 (0: SimPO without the NLL term), got {self.cpo_alpha}")
        if not 0.0 <= self.label_smoothing < 0.5:
            found.append(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.sft_average not in ("token", "sequence"):
            found.append(f"sft_average must be 'token' (TRL) or 'sequence' (LLaMA-Factory), got {self.sft_average!r}")
        return found

    @override
    def training_step(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        loss, logged, values = self._loss(module, batch, training=True)
        self.log_training(module, logged, values)
        return loss

    @override
    def validation_loss(self, module: pl.LightningModule, batch: dict[str, Any]) -> ValidationLoss:
        _, logged, values = self._loss(module, batch, training=False)
        log_validation_metrics(module, values)
        return ValidationLoss(logged, count_of(batch["input_ids"].size(0) // 2, logged.device))

    def rewards(self, mean_logps: torch.Tensor) -> torch.Tensor:
        """Each completion's reward before ``beta``: its mean token log-probability, or AlphaPO's shape of it."""
        if self.alpha == 0.0:
            return mean_logps
        return (1 - torch.exp(mean_logps).pow(-self.alpha)) / self.alpha

    def _loss(
        self, module: pl.LightningModule, batch: dict[str, Any], training: bool
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The loss to back-propagate, this micro-batch's loss as TRL computes it (logged), and the metrics."""
        pairs = check_padded(batch, "pairs")
        step_pairs = self.start_pair_count(module, batch, pairs) if training else None
        nll_tokens = self.cpo_alpha != 0 and self.sft_average == "token"
        tokens = start_token_count(module, batch["labels"][:pairs], training) if nll_tokens else None
        out = module.engine.sequence_logps(module.model, batch)
        mean = out.logps / out.tokens.clamp(min=1)  # CPO's average_log_prob: over the shifted targets
        chosen, rejected = mean.chunk(2)
        chosen_reward, rejected_reward = self.rewards(chosen), self.rewards(rejected)
        logits = chosen_reward - rejected_reward - self.simpo_gamma / self.beta
        smoothing = self.label_smoothing
        per_pair = -F.logsigmoid(self.beta * logits) * (1 - smoothing) - F.logsigmoid(-self.beta * logits) * smoothing
        values = pair_metrics(
            self.beta * chosen_reward.detach(), self.beta * rejected_reward.detach(), chosen, rejected
        )
        if self.cpo_alpha != 0 and not nll_tokens:  # LLaMA-Factory's pref_ftx: each chosen completion's mean NLL
            per_pair = per_pair - self.cpo_alpha * chosen
            values["nll_loss"] = (-chosen.detach().sum(), count_of(pairs, chosen.device))
        loss, logged = self.pair_mean(module, per_pair, step_pairs), per_pair.mean()
        if tokens is not None:
            nll_sum, nll_tokens = -out.logps[:pairs].sum(), out.tokens[:pairs].sum().float()
            nll = nll_sum / nll_tokens.clamp(min=1)
            loss = loss + self.cpo_alpha * nll_sum * token_mean_scale(module, tokens, training)
            logged = logged + self.cpo_alpha * nll
            values["nll_loss"] = (nll_sum.detach(), nll_tokens)  # a token mean over every rank, as the loss
        return loss, logged.detach(), values


__all__ = ["SimPO"]
