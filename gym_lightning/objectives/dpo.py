"""Direct preference optimisation (``dpo``): TRL 1.16 ``DPOTrainer``'s losses, over the policy's and the reference's
summed completion log-probabilities (``LMEngine.sequence_logps``) of a ``pairs`` batch, chosen and rejected rows in
one forward. https://huggingface.co/papers/2305.18290; the other loss types cite their papers where defined.

Every loss type of TRL's ``DPOConfig.loss_type`` that is a formula over those sums (and the completions' lengths) is
here, combined with ``loss_weights`` as TRL combines them, and so are ``f_divergence_type`` and ``discopop_tau``. What
needs more than the sums is refused by ``problems()``: ``ld_alpha`` and ``use_weighting`` (per-token values),
``aot``/``aot_unpaired`` (sort within a micro-batch: the loss would depend on how ranks split the batch),
``sync_ref_model`` (the reference is frozen). Reference, normalisation and metrics: ``objectives.preference``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from typing_extensions import override

from gym_lightning.objectives.base import ValidationLoss, register_objective
from gym_lightning.objectives.preference import (
    PreferenceObjective,
    ReferenceDType,
    ReferenceSettings,
    SftAverage,
    check_padded,
    completion_tokens,
    count_of,
    log_validation_metrics,
    pair_metrics,
    reference_dtype_problems,
    start_token_count,
    token_mean_scale,
    with_router_loss,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
    "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
REFUSED_LOSS_TYPES = {
    "aot": "loss_type 'aot' sorts the log-ratios within a micro-batch, so its loss depends on how ranks and gradient "
    "accumulation split the batch; choose another loss type (sigmoid, ipo, ...)",
    "aot_unpaired": "loss_type 'aot_unpaired' sorts the log-ratios within a micro-batch, so its loss depends on how "
    "ranks and gradient accumulation split the batch; choose another loss type (sigmoid, ipo, ...)",
}
# The loss types built on the chosen-rejected score difference, the only ones with an f-divergence form (TRL's list).
F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


class PairLogps(NamedTuple):
    """One micro-batch's per-pair sums: the policy's and the reference's, and the completions' lengths (TRL's
    ``completion_mask.sum(1)``), ``[B]`` each."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def f_scores(logratios: torch.Tensor, divergence: str, alpha: float) -> torch.Tensor:
    """f'(policy / reference) of the f-DPO paper (https://huggingface.co/papers/2309.16240), as TRL computes it."""
    if divergence == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-logratios)
    if divergence == "js_divergence":  # f'(t) = log 2 + logsigmoid(log t)
        return math.log(2) + F.logsigmoid(logratios)
    if divergence == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:  # (t^(a-1) - 1) / (a-1), exp clamped
        return (torch.exp(((alpha - 1.0) * logratios).clamp(max=80.0)) - 1.0) / (alpha - 1.0)
    return logratios  # reverse KL: standard DPO (and alpha -> 1)


def pair_losses(logps: PairLogps, loss_type: str, objective: DPO) -> torch.Tensor:
    """``[B]`` losses of ``loss_type`` (anything but ``sft``), TRL 1.16 ``DPOTrainer._compute_loss``'s formulas."""
    beta, smoothing = objective.beta, objective.label_smoothing
    chosen_ratio, rejected_ratio = logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected
    chosen_score = f_scores(chosen_ratio, objective.f_divergence_type, objective.f_alpha_divergence_coef)
    rejected_score = f_scores(rejected_ratio, objective.f_divergence_type, objective.f_alpha_divergence_coef)
    delta = chosen_score - rejected_score
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):  # per-token scores (IPO: the authors' length-normalised form)
        norm = chosen_score / logps.chosen_tokens.clamp(min=1) - rejected_score / logps.rejected_tokens.clamp(min=1)
        return (norm - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * norm)
    if loss_type == "exo_pair":  # https://huggingface.co/papers/2402.00856, Eq. 16
        log_pw, log_pl = math.log1p(-smoothing), math.log(smoothing)
        qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
        return qw * (F.logsigmoid(beta * delta) - log_pw) + ql * (F.logsigmoid(-beta * delta) - log_pl)
    if loss_type == "nca_pair":
        chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
        return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    if loss_type == "robust":  # https://huggingface.co/papers/2403.00409
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if loss_type == "sppo_hard":  # https://huggingface.co/papers/2405.00675, hard probabilities
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type == "apo_zero":  # https://huggingface.co/papers/2408.06266, Eq. 7
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if loss_type == "apo_down":  # Eq. 8
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss_type == "discopop":  # https://huggingface.co/papers/2406.08414, Eq. 5
        logits = beta * delta
        mix = torch.sigmoid(logits / objective.discopop_tau)
        return -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
    raise ValueError(f"unknown DPO loss type {loss_type!r}")


@register_objective
class DPO(PreferenceObjective):
    """Direct preference optimisation, TRL's ``DPOConfig`` fields (LLaMA-Factory's in brackets).

    Args:
        beta: The deviation from the reference (IPO's tau) [``pref_beta``].
        loss_type: One loss type or a list, summed with ``loss_weights`` (TRL's MPO form): ``sigmoid`` (DPO),
            ``hinge``, ``ipo``, ``robust`` (with ``label_smoothing``), ``exo_pair``, ``nca_pair``, ``bco_pair``,
            ``sppo_hard``, ``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm``, and ``sft``: the chosen
            completions' NLL [``pref_loss``: sigmoid, hinge, ipo].
        loss_weights: One weight per loss type (default all 1). An SFT term: ``loss_type: [sigmoid, sft]``,
            ``loss_weights: [1.0, w]`` [``pref_ftx: w``, with ``sft_average: sequence``].
        label_smoothing: The flip probability of ``robust``, in [0, 0.5); EXO's epsilon [``dpo_label_smoothing``].
        sft_average: How the ``sft`` term averages: ``token``: TRL's, the mean NLL over the chosen completions'
            tokens of the micro-batch; ``sequence``: LLaMA-Factory's ``pref_ftx``, each chosen completion's token
            mean, averaged over pairs.
        f_divergence_type: ``reverse_kl`` (DPO), ``forward_kl``, ``js_divergence``, ``alpha_divergence`` (f-DPO).
        f_alpha_divergence_coef: The alpha of ``alpha_divergence``.
        discopop_tau: The temperature of ``discopop`` (> 0).
        precompute_ref_log_probs: Read the reference's log-probabilities from the batches (``reference_logps``,
            computed in one pass before training) instead of running a reference.
        ref_model: The reference's folder or hub name; default: the policy's source (full finetune: a frozen copy)
            or, with LoRA, the policy with its adapters off [``ref_model``].
        reference_dtype: The parameters' dtype of a frozen reference (``bfloat16``: half an fp32 reference's
            memory); default: the policy's compute dtype as the strategy holds it. ZeRO-3 holds it in the engine's.
        disable_dropout: Set every dropout probability of the policy to 0 (TRL's default).
        router_aux_loss_coef: The weight of a mixture of experts' router loss when its forward returns one
            (``output_router_logits``); ``None``: the model config's.
        ld_alpha: LD-DPO: refused unless ``None`` (needs per-token log-probabilities).
        use_weighting: WPO: refused unless false (needs per-token log-probabilities).
        sync_ref_model: TR-DPO: refused unless false (the reference is frozen).
    """

    name: ClassVar[str] = "dpo"

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str | list[str] = "sigmoid",
        loss_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        sft_average: SftAverage = "token",
        f_divergence_type: str = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        discopop_tau: float = 0.05,
        precompute_ref_log_probs: bool = False,
        ref_model: str | None = None,
        reference_dtype: ReferenceDType | None = None,
        disable_dropout: bool = True,
        router_aux_loss_coef: float | None = None,
        ld_alpha: float | None = None,
        use_weighting: bool = False,
        sync_ref_model: bool = False,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.loss_type = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        self.loss_weights = None if loss_weights is None else [float(w) for w in loss_weights]
        self.label_smoothing = label_smoothing
        self.sft_average = sft_average
        self.f_divergence_type = f_divergence_type
        self.f_alpha_divergence_coef = f_alpha_divergence_coef
        self.discopop_tau = discopop_tau
        self.precompute_ref_log_probs = precompute_ref_log_probs
        self.ref_model = ref_model
        self.reference_dtype = reference_dtype
        self.disable_dropout = disable_dropout
        self.router_aux_loss_coef = router_aux_loss_coef
        self.ld_alpha = ld_alpha
        self.use_weighting = use_weighting
        self.sync_ref_model = sync_ref_model

    @override
    def problems(self) -> list[str]:
        found = [REFUSED_LOSS_TYPES[t] for t in self.loss_type if t in REFUSED_LOSS_TYPES]
        if unknown := [t for t in self.loss_type if t not in LOSS_TYPES and t not in REFUSED_LOSS_TYPES]:
            found.append(f"loss_type {unknown} is not a DPO loss type; choose from {', '.join(LOSS_TYPES)}")
        if not self.loss_type:
            found.append("loss_type is empty; name at least one loss type (sigmoid is DPO's)")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            found.append(
                f"loss_weights has {len(self.loss_weights)} weight(s) for {len(self.loss_type)} loss type(s) "
                f"{self.loss_type}; give one weight per loss type, or none (all 1)"
            )
        if not self.beta > 0:
            found.append(f"beta must be > 0, got {self.beta}")
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            found.append(f"label_smoothing must be in [0, 0.5) for the robust loss, got {self.label_smoothing}")
        if "exo_pair" in self.loss_type and not 0.0 < self.label_smoothing < 1.0:
            found.append(
                f"label_smoothing must be in (0, 1) for exo_pair (EXO suggests 1e-3), got {self.label_smoothing}"
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            found.append(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.sft_average not in ("token", "sequence"):
            found.append(f"sft_average must be 'token' (TRL) or 'sequence' (LLaMA-Factory), got {self.sft_average!r}")
        if self.f_divergence_type not in F_DIVERGENCES:
            found.append(f"f_divergence_type must be one of {', '.join(F_DIVERGENCES)}, got {self.f_divergence_type!r}")
        elif self.f_divergence_type != "reverse_kl" and not set(self.loss_type) <= F_DIVERGENCE_LOSSES:
            found.append(
                f"f_divergence_type {self.f_divergence_type!r} applies to the loss types "
                f"{', '.join(sorted(F_DIVERGENCE_LOSSES))} only, got {self.loss_type}; use reverse_kl with these"
            )
        if "discopop" in self.loss_type and not self.discopop_tau > 0:
            found.append(f"discopop_tau must be > 0, got {self.discopop_tau}")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            found.append(
                f"router_aux_loss_coef must be >= 0 or null (the model config's), got {self.router_aux_loss_coef}"
            )
        return found + self._refused() + reference_dtype_problems(self.reference_dtype)

    def _refused(self) -> list[str]:
        found = []
        if self.ld_alpha is not None:
            found.append(
                "ld_alpha (LD-DPO) weights each completion's tokens beyond the shorter completion's length, which "
                "needs per-token log-probabilities; the engine returns per-sequence sums: leave ld_alpha unset"
            )
        if self.use_weighting:
            found.append(
                "use_weighting (WPO) weights pairs by per-token probabilities the engine does not return: set it false"
            )
        if self.sync_ref_model:
            found.append(
                "sync_ref_model (TR-DPO) mixes the policy into the reference during training; the reference here is "
                "frozen (or absent: LoRA, precompute_ref_log_probs): set it false"
            )
        return found

    @override
    def reference_settings(self) -> ReferenceSettings:
        return ReferenceSettings(self.precompute_ref_log_probs, self.ref_model, self.reference_dtype)

    def weights(self) -> list[tuple[str, float]]:
        """``(loss type, weight)`` pairs, in order."""
        weights = self.loss_weights if self.loss_weights is not None else [1.0] * len(self.loss_type)
        return list(zip(self.loss_type, weights, strict=True))

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
        token_sft = any(t == "sft" for t, _ in self.weights()) and self.sft_average == "token"
        tokens = start_token_count(module, batch["labels"][:pairs], training) if token_sft else None
        reference = self.reference(module).logps(module, batch)  # first: no policy activations are held yet
        out = module.engine.sequence_logps(module.model, batch)
        chosen_tokens, rejected_tokens = completion_tokens(batch["labels"]).chunk(2)
        logps = PairLogps(*out.logps.chunk(2), *reference.chunk(2), chosen_tokens, rejected_tokens)
        per_pair = torch.zeros_like(logps.chosen)
        loss_sft = torch.zeros((), device=logps.chosen.device)
        for loss_type, weight in self.weights():
            if loss_type != "sft":
                per_pair = per_pair + weight * pair_losses(logps, loss_type, self)
            elif self.sft_average == "sequence":  # LLaMA-Factory's pref_ftx: -(each chosen completion's token mean)
                per_pair = per_pair - weight * logps.chosen / out.tokens[:pairs].clamp(min=1)
            else:
                loss_sft = loss_sft - weight * logps.chosen.sum()
        loss = self.pair_mean(module, per_pair, step_pairs)
        logged = per_pair.mean()
        if tokens is not None:
            loss = loss + loss_sft * token_mean_scale(module, tokens, training)
            logged = logged + loss_sft / out.tokens[:pairs].sum().clamp(min=1)
        loss, logged = with_router_loss(module, loss, logged, out.router_aux, self.router_aux_loss_coef)
        values = pair_metrics(
            self.beta * (logps.chosen - logps.ref_chosen).detach(),
            self.beta * (logps.rejected - logps.ref_rejected).detach(),
            logps.chosen,
            logps.rejected,
        )
        return loss, logged.detach(), values


__all__ = ["DPO", "LOSS_TYPES", "PairLogps", "f_scores", "pair_losses"]
