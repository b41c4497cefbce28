"""The preference stages' settings: TRL's and LLaMA-Factory's flags as the init_args of ``model.objective``.

``--stage dpo`` trains ``objectives.DPO`` (TRL's ``DPOConfig``), ``kto`` ``KTO`` (``KTOConfig``), ``orpo`` ``ORPO``
(``ORPOConfig``) and ``simpo`` ``SimPO`` (``CPOConfig`` with ``loss_type simpo``). The objectives take TRL's field
names, so TRL's flags pass through as they are. LLaMA-Factory's ``stage: dpo`` picks its loss with ``pref_loss``:
``sigmoid``, ``hinge``, ``ipo`` are DPO's loss types (its IPO is per token, as TRL 1.16's), ``orpo`` and ``simpo``
the stages of those names (``llama_factory_stage``). Its SFT term ``pref_ftx`` averages each chosen completion's
tokens, then the pairs (the objectives' ``sft_average: sequence``; TRL's ``sft`` and CPO's NLL average the
micro-batch's tokens), and so do its ORPO and SimPO. Its ``dpo_label_smoothing`` ``e`` is cDPO, TRL < 1's smoothed
sigmoid ``(1-e) S(x) + e S(-x)`` with ``S(x) = -log sigmoid(beta x)``: no TRL 1.16 loss type, but the sum
``2(1-e) sigmoid - (1-2e) robust`` with ``label_smoothing e`` is that loss (``robust`` is
``((1-e) S(x) - e S(-x)) / (1-2e)``). ``kto_pair`` is refused: its KL terms are means over a micro-batch's pairs,
which no objective computes (``--stage kto`` unpairs the pairs instead, as TRL).

``STAGE_KEYS``: what each stage makes of the flags that are no field of its TRL config (LLaMA-Factory's ``pref_*``,
``ref_model``, ``max_prompt_length``); a stage not listed for a key refuses it unless at ``KEY_DEFAULTS``.
"""

from __future__ import annotations

import argparse
from typing import Any

from gym_lightning.commands.train.rows import Row, mapped, refused

DPO_LOSSES = ("sigmoid", "hinge", "ipo")  # LLaMA-Factory's pref_loss values that are DPO loss types
SIMPO_LOSSES = ("simpo", "alphapo")  # CPOConfig's loss types that --stage simpo trains
REFERENCE_ARGS = ("precompute_ref_log_probs", "ref_model", "router_aux_loss_coef")
KTO_PAIR = (
    "--pref_loss kto_pair: LLaMA-Factory's pairwise KTO is no TRL 1.16 loss type, and its KL terms are means over a "
    "micro-batch's pairs, which no objective computes; train stage kto on the same data (its pairs become a "
    "desirable and an undesirable example, as TRL's unpair_preference_dataset) or choose pref_loss sigmoid, hinge "
    "or ipo."
)

_REF = mapped(
    "model.objective's ref_model: the reference's folder or hub name; default: the policy's source (a frozen copy), "
    "or with LoRA the base with the adapters off"
)
_PROMPT = mapped("data.max_prompt_length: keep at most the last N prompt tokens (older TRL's), before max_length")
_NO_FTX = "{} (LLaMA-Factory's pref_ftx with {}) is not a setting of the {} objective; leave pref_ftx at 0"
STAGE_KEYS: dict[str, dict[str, Row]] = {
    "dpo": {
        "ref_model": _REF,
        "max_prompt_length": _PROMPT,
        "pref_loss": mapped("model.objective's loss_type: sigmoid, hinge, ipo (orpo, simpo: those stages)"),
        "pref_ftx": mapped("model.objective's loss_type gets sft at this weight, with sft_average sequence"),
        "dpo_label_smoothing": mapped("model.objective's loss_type [sigmoid, robust], the same loss as cDPO's"),
    },
    "kto": {
        "ref_model": _REF,
        "max_prompt_length": _PROMPT,
        "pref_ftx": refused(_NO_FTX.format("an NLL term on the desirable completions", "stage kto", "kto"), 0, 0.0),
    },
    "orpo": {
        "max_prompt_length": _PROMPT,
        "pref_loss": mapped("orpo (LLaMA-Factory's): model.objective's sft_average sequence"),
        "pref_ftx": refused(_NO_FTX.format("a second NLL term beside ORPO's own", "pref_loss orpo", "orpo"), 0, 0.0),
    },
    "simpo": {
        "max_prompt_length": _PROMPT,
        "pref_loss": mapped("simpo (LLaMA-Factory's): its NLL term, if any, with sft_average sequence"),
        "pref_ftx": mapped("model.objective's cpo_alpha, with sft_average sequence"),
    },
}
# LLaMA-Factory's (and gym's) defaults of those keys: a stage that does not read one takes it at these values.
KEY_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "ref_model": (None,),
    "max_prompt_length": (None,),
    "pref_loss": ("sigmoid",),
    "pref_ftx": (0, 0.0),
    "dpo_label_smoothing": (0, 0.0),
}


def llama_factory_stage(stage: str, pref_loss: str | None) -> str:
    """The stage that runs LLaMA-Factory's ``stage: dpo`` with ``pref_loss: orpo|simpo`` (reference-free there too);
    else ``stage``."""
    return pref_loss if stage == "dpo" and pref_loss in ("orpo", "simpo") else stage


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags given (not ``None``), and ``disable_dropout`` where turned off (on is every objective's default)."""
    values = {name: value for name in names if (value := getattr(args, name)) is not None}
    return values | ({} if args.disable_dropout else {"disable_dropout": False})


def _ftx(args: argparse.Namespace) -> float:
    return float(args.pref_ftx or 0.0)


def _smoothing(args: argparse.Namespace) -> float:
    return float(args.dpo_label_smoothing or 0.0)


def _plain_sigmoid(args: argparse.Namespace) -> bool:
    """Whether the DPO loss is the sigmoid alone (cDPO's smoothing applies to it only)."""
    losses = args.loss_type or [args.pref_loss or "sigmoid"]
    return list(losses) == ["sigmoid"] and args.loss_weights is None


def dpo_losses(args: argparse.Namespace) -> dict[str, Any]:
    """``loss_type`` (always), ``loss_weights``, ``label_smoothing`` and ``sft_average`` of TRL's loss flags or
    LLaMA-Factory's ``pref_loss``, ``dpo_label_smoothing`` and ``pref_ftx`` (module docstring)."""
    losses = list(args.loss_type or [args.pref_loss if args.pref_loss in DPO_LOSSES else "sigmoid"])
    weights = None if args.loss_weights is None else [float(weight) for weight in args.loss_weights]
    values: dict[str, Any] = {}
    smoothing = _smoothing(args)
    if 0.0 < smoothing < 0.5 and _plain_sigmoid(args):
        losses, weights = ["sigmoid", "robust"], [2 * (1 - smoothing), -(1 - 2 * smoothing)]
        values["label_smoothing"] = smoothing
    if _ftx(args) > 0:
        losses, weights = [*losses, "sft"], [*(weights or [1.0] * len(losses)), _ftx(args)]
        values["sft_average"] = "sequence"
    values["loss_type"] = losses
    if weights is not None:
        values["loss_weights"] = weights
    return values


def dpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``objectives.DPO``'s init_args."""
    values = _given(args, "beta", "label_smoothing", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau")
    return values | _given(args, *REFERENCE_ARGS) | dpo_losses(args)


def kto_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``objectives.KTO``'s init_args (KTOConfig's ``loss_type`` is one name)."""
    values = _given(args, "beta", "desirable_weight", "undesirable_weight", *REFERENCE_ARGS)
    if args.loss_type:
        values["loss_type"] = args.loss_type[0]
    return values


def orpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``objectives.ORPO``'s init_args: TRL's NLL over every token of the chosen rows, LLaMA-Factory's per pair."""
    values = _given(args, "beta")
    return values | ({"sft_average": "sequence"} if args.pref_loss == "orpo" else {})


def simpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``objectives.SimPO``'s init_args: ``alphapo`` sets ``cpo_alpha`` 0 (TRL's CPOConfig does); LLaMA-Factory's
    ``pref_ftx`` is the NLL weight, each chosen completion's mean over pairs."""
    values = _given(args, "beta", "simpo_gamma", "cpo_alpha", "label_smoothing", "alpha")
    if args.loss_type and args.loss_type[0] == "alphapo":
        values["cpo_alpha"] = 0.0
    if args.pref_loss == "simpo" and _ftx(args) > 0:
        values |= {"cpo_alpha": _ftx(args), "sft_average": "sequence"}
    return values


def preference_problems(args: argparse.Namespace, stage: str) -> list[str]:
    """The combinations of preference flags that cannot run in ``stage`` (the objective checks the values)."""
    problems = [KTO_PAIR] if args.pref_loss == "kto_pair" else []
    if args.pref_loss is not None and args.loss_type and stage in ("dpo", "simpo"):
        problems.append("--pref_loss and --loss_type both choose the loss; pass one (LLaMA-Factory's or TRL's).")
    if args.pref_loss is not None and stage in ("orpo", "simpo") and args.pref_loss != stage:
        problems.append(f"--pref_loss {args.pref_loss} contradicts --stage {stage}; drop pref_loss.")
    smoothing = _smoothing(args)
    if not 0.0 <= smoothing < 0.5:
        problems.append(f"--dpo_label_smoothing {smoothing:g}: give a value in [0, 0.5).")
    elif smoothing > 0 and stage == "dpo" and not _plain_sigmoid(args):
        problems.append(
            "--dpo_label_smoothing smooths the sigmoid loss alone (LLaMA-Factory refuses it with the others); drop it, "
            "or use TRL's --loss_type robust --label_smoothing."
        )
    if _ftx(args) < 0:
        problems.append(f"--pref_ftx {_ftx(args):g}: give a weight >= 0.")
    elif _ftx(args) > 0 and stage == "dpo" and "sft" in (args.loss_type or []):
        problems.append("--pref_ftx and --loss_type sft both add the SFT term; pass one.")
    if stage == "kto" and len(args.loss_type or []) > 1:
        problems.append(f"--loss_type {' '.join(args.loss_type)}: KTOConfig's loss_type is one name (kto, ...).")
    if stage == "simpo" and args.loss_type and (len(args.loss_type) > 1 or args.loss_type[0] not in SIMPO_LOSSES):
        problems.append(
            f"--loss_type {' '.join(args.loss_type)} is not supported in --stage simpo: CPO's own sigmoid, hinge and "
            "ipo losses are not wired in; --stage simpo trains SimPO (--loss_type simpo, or alphapo with --alpha)."
        )
    return problems


__all__ = [
    "DPO_LOSSES",
    "KEY_DEFAULTS",
    "STAGE_KEYS",
    "dpo_losses",
    "dpo_settings",
    "kto_settings",
    "llama_factory_stage",
    "orpo_settings",
    "preference_problems",
    "simpo_settings",
]
