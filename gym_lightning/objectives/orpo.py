"""ORPO (``orpo``), reference-free: TRL 1.16's ``ORPOTrainer``, the chosen rows' NLL plus ``beta`` times the odds
ratio loss of the length-normalised completion log-probabilities of a ``pairs`` batch.
https://huggingface.co/papers/2403.07691

TRL's NLL covers the chosen rows' prompt tokens too (its labels are every attended token): one forward gives the
prompt's and the completion's sums of each row apart (``preference.prompt_segments``), so the odds ratio reads the
completions and the NLL the whole rows. LLaMA-Factory's ``pref_loss: orpo`` takes each chosen completion's mean NLL
instead (``sft_average: sequence``). Normalisation and metrics: ``objectives.preference``.
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
    full_row_labels,
    log_validation_metrics,
    pair_metrics,
    prompt_segments,
    start_token_count,
    token_mean_scale,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

LOG_HALF = -0.6931471805599453


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, branching at ``-log 2`` against cancellation (TRL's, Maechler 2012)."""
    return torch.where(x < LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register_objective
class ORPO(PreferenceObjective):
    """ORPO, TRL's ``ORPOConfig`` fields (LLaMA-Factory's ``stage: dpo``, ``pref_loss: orpo`` in brackets).

    Args:
        beta: The weight of the odds ratio loss (the paper's lambda) [``pref_beta``].
        sft_average: The NLL term: ``token``: TRL's, the mean over every token of the micro-batch's chosen rows,
            prompt included; ``sequence``: LLaMA-Factory's, each chosen completion's mean NLL, over pairs.
        disable_dropout: Set every dropout probability of the policy to 0 (TRL's default).
    """

    name: ClassVar[str] = "orpo"

    def __init__(self, beta: float = 0.1, sft_average: SftAverage = "token", disable_dropout: bool = True) -> None:
        super().__init__()
        self.beta = beta
        self.sft_average = sft_average
        self.disable_dropout = disable_dropout

    @override
    def problems(self) -> list[str]:
        found = []
        if not self.beta > 0:
            found.append(f"beta must be > 0 (ORPO's lambda), got {self.beta}")
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

    def _loss(
        self, module: pl.LightningModule, batch: dict[str, Any], training: bool
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The loss to back-propagate, this micro-batch's loss as TRL computes it (logged), and the metrics."""
        pairs = check_padded(batch, "pairs")
        step_pairs = self.start_pair_count(module, batch, pairs) if training else None
        if self.sft_average == "token":
            rows = {**batch, "labels": full_row_labels(batch), "cu_seq_lens": prompt_segments(batch["labels"])}
            tokens = start_token_count(module, rows["labels"][:pairs], training)
            out = module.engine.sequence_logps(module.model, rows)
            sums, counts = out.logps[1::2], out.tokens[1::2]  # documents 2r: row r's prompt, 2r + 1: the rest
            nll_sum = -out.logps[: 2 * pairs].sum()  # the chosen rows, prompt and completion
            nll_tokens = out.tokens[: 2 * pairs].sum().float()
            nll = nll_sum / nll_tokens.clamp(min=1)
        else:
            out = module.engine.sequence_logps(module.model, batch)
            sums, counts = out.logps, out.tokens
        chosen, rejected = (sums / counts.clamp(min=1)).chunk(2)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        per_pair = -self.beta * ratio
        values = pair_metrics(self.beta * chosen.detach(), self.beta * rejected.detach(), chosen, rejected)
        values["log_odds_ratio"] = (ratio.detach().sum(), count_of(pairs, ratio.device))
        values["log_odds_chosen"] = (log_odds.detach().sum(), count_of(pairs, ratio.device))
        if self.sft_average == "sequence":
            per_pair = per_pair - chosen
            values["nll_loss"] = (-chosen.detach().sum(), count_of(pairs, chosen.device))
        loss, logged = self.pair_mean(module, per_pair, step_pairs), per_pair.mean()
        if self.sft_average == "token":
            loss = loss + nll_sum * token_mean_scale(module, tokens, training)
            logged = logged + nll
            values["nll_loss"] = (nll_sum.detach(), nll_tokens)  # a token mean over every rank, as the loss
        return loss, logged.detach(), values


__all__ = ["ORPO", "log1mexp"]
