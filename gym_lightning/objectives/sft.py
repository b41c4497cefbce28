"""Supervised finetuning (``sft``) and continued pretraining (``pt``): the token-mean language-model loss.

The loss of an optimizer step is the sum of target-token cross-entropies divided by the number of target tokens in
the whole step, over all gradient-accumulation micro-batches and all data-parallel ranks (``gym_lightning.loss``).
Continued pretraining is the same objective over other data (raw text, packed, every token a target): the stage's
data settings are what differ (``data_settings``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from typing_extensions import override

from gym_lightning._compat import rank_zero_warn
from gym_lightning.engine import base_model_of
from gym_lightning.loss import count_target_tokens, start_rank_sum, step_loss_scale
from gym_lightning.objectives.base import Objective, ValidationLoss, register_objective
from gym_lightning.protocols import STEP_TOKENS_KEY


@register_objective
class SFT(Objective):
    """Supervised finetuning: the summed next-token cross-entropy of the targets over the step's target tokens.

    Batches carry ``step_target_tokens`` (``data.StepTokenDataLoader``), this rank's target tokens of the whole
    optimizer step, summed over ranks here; without it each micro-batch is normalised on its own (a warning says so).
    A mixture of experts whose config sets ``output_router_logits`` adds its router load-balancing loss.
    """

    name: ClassVar[str] = "sft"
    perplexity: ClassVar[bool] = True

    def __init__(self) -> None:
        self._warned_no_step_tokens = False

    @override
    def training_step(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        step_tokens, undo_accumulation, pending = self._start_step_token_count(module, batch)
        loss_sum, count, router_aux = module.engine.token_loss(module.model, batch)
        # The local micro-batch's token mean, logged as a tensor (no host sync here). Not through a torchmetrics
        # metric called as a module: under ZeRO-3 any module call joins DeepSpeed's trace (strategies/zero/trace.py).
        # Not prog_bar: Lightning would .item() it (a host sync on CUDA) at every batch end; GymProgressBar reads it
        # at the logging steps (callbacks/progress.py, tests/test_host_syncs.py).
        module.log("train/loss", loss_sum.detach() / count.clamp(min=1), on_step=True, on_epoch=False)
        if pending is not None:
            pending.wait()
        world = module.trainer.world_size
        loss = loss_sum * step_loss_scale(step_tokens[0], world, undo_accumulation)
        if router_aux is None:
            return loss
        # transformers' own forward adds router_aux_loss_coef times each micro-batch's value: Lightning's division
        # by the accumulation count and the ranks' gradient average make it the mean over the step's micro-batches.
        module.log("train/router_aux_loss", router_aux.detach(), on_step=True, on_epoch=False)
        return loss + base_model_of(module.model).config.router_aux_loss_coef * router_aux

    @override
    def validation_loss(self, module: pl.LightningModule, batch: dict[str, Any]) -> ValidationLoss:
        loss_sum, count, _ = module.engine.token_loss(module.model, batch)  # the language-model loss only
        return ValidationLoss(loss_sum / count.clamp(min=1), count)

    def _start_step_token_count(
        self, module: pl.LightningModule, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, int, Any]:
        """Start summing this optimizer step's target tokens over ranks; returns the (in-flight) sum, the
        accumulation factor to undo, and the pending collective (``None`` on one rank).

        The count does not depend on the forward pass, so the all-reduce is launched before it and waited for after:
        it overlaps the forward instead of adding a point mid-step where every rank waits for the slowest.
        """
        trainer = module.trainer
        if STEP_TOKENS_KEY in batch:
            local, undo = batch[STEP_TOKENS_KEY], trainer.accumulate_grad_batches
        else:
            # Without the window count (a user's own DataLoader) each micro-batch is normalised on its own and
            # Lightning's division by the accumulation count stays: the usual, length-biased mean.
            if not self._warned_no_step_tokens:
                rank_zero_warn(
                    "Batches carry no 'step_target_tokens': gradient accumulation weights micro-batches equally. "
                    "Use gym_lightning.data.StepTokenDataLoader (CausalLMDataModule does) for exact token weighting."
                )
                self._warned_no_step_tokens = True
            local, undo = count_target_tokens(batch["labels"]), 1
        tokens = local.to(module.device, torch.float32).reshape(1).clone()
        return tokens, undo, start_rank_sum(tokens, trainer.world_size)


@register_objective
class ContinuedPretraining(SFT):
    """Continued pretraining (LLaMA-Factory's ``stage: pt``, TRL's plain-text SFT): the SFT loss over raw text,
    packed, every token a target. Its data settings are ``data_settings``: ``gym train --stage pt`` applies them."""

    name: ClassVar[str] = "pt"
    data_settings: ClassVar[dict[str, Any]] = {"format": "text", "packing": True, "mask_prompt": False}


__all__ = ["SFT", "ContinuedPretraining"]
