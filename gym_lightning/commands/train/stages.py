"""The stage table: what ``gym train --stage NAME`` (LLaMA-Factory's ``stage:``, TRL's ``trl sft|dpo|...``) trains.

A stage is a row here plus an objective (``gym_lightning.objectives``): the row names the registered objective that
``model.objective`` selects, the TRL config whose fields the stage reads (``trl.TRL_CONFIGS``: a field's meaning
depends on it, as ``loss_type``'s does), and how the objective's settings come from the flags (``settings``: the
init_args of ``model.objective``). The objective's ``data_settings`` (a class attribute) are the stage's data
defaults: ``pt`` reads raw text, packed, every token a target. A stage that does not run yet carries the one line
that refuses it (``refusal``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gym_lightning.commands.train.rows import PREFERENCE_STAGE, Row
from gym_lightning.commands.train.trl import TRL_CONFIGS

_RUNS = "gym train runs the sft and pt stages (docs/gym-train.md, Stages)"


@dataclass(frozen=True)
class Stage:
    """One row of the stage table.

    Args:
        name: ``--stage``'s value (LLaMA-Factory's ``stage`` names where it has one).
        summary: What the stage trains, in a few words.
        objective: The registered objective (``model.objective``) the stage trains with; ``None`` while refused.
        trl: TRL's config of the stage, whose field table reads the flags (``trl.TRL_CONFIGS``).
        elsewhere: How TRL and LLaMA-Factory users start it.
        refusal: Why the stage does not run, where it does not.
        settings: The objective's init_args from the parsed flags (``None``: the objective takes none).
    """

    name: str
    summary: str
    objective: str | None
    trl: str
    elsewhere: str
    refusal: str | None = None
    settings: Callable[[argparse.Namespace], dict[str, Any]] | None = None

    @property
    def fields(self) -> dict[str, Row]:
        """The TRL field table the stage reads its flags with."""
        return TRL_CONFIGS[self.trl]


def _preference(summary: str) -> str:
    return f"{summary} {PREFERENCE_STAGE}"


STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        Stage("sft", "supervised finetuning", "sft", "SFTConfig", "trl sft; LLaMA-Factory stage: sft"),
        Stage(
            "pt",
            "continued pretraining: raw text, packed, every token a target",
            "pt",
            "SFTConfig",
            "trl sft on plain text (dataset_text_field, packing); LLaMA-Factory stage: pt",
        ),
        Stage(
            "dpo",
            "direct preference optimisation",
            None,
            "DPOConfig",
            "trl dpo; LLaMA-Factory stage: dpo",
            _preference("DPO"),
        ),
        Stage(
            "kto",
            "Kahneman-Tversky optimisation",
            None,
            "KTOConfig",
            "trl kto; LLaMA-Factory stage: kto",
            _preference("KTO"),
        ),
        Stage(
            "orpo",
            "odds-ratio preference optimisation (no reference model)",
            None,
            "DPOConfig",
            "TRL's ORPOTrainer; LLaMA-Factory stage: dpo with pref_loss: orpo",
            _preference("ORPO"),
        ),
        Stage(
            "simpo",
            "simple preference optimisation (length-normalised, no reference model)",
            None,
            "DPOConfig",
            "TRL's CPOTrainer with loss_type simpo; LLaMA-Factory stage: dpo with pref_loss: simpo",
            _preference("SimPO"),
        ),
        Stage(
            "rm",
            "reward modelling",
            None,
            "SFTConfig",
            "trl reward; LLaMA-Factory stage: rm",
            "a reward model is a sequence classifier (a scalar head, AutoModelForSequenceClassification); gym train "
            "trains causal LMs",
        ),
        Stage(
            "ppo",
            "proximal policy optimisation",
            None,
            "SFTConfig",
            "TRL's PPOTrainer; LLaMA-Factory stage: ppo",
            "online RL: each step generates completions and scores them with a reward model and a value model; "
            "gym train trains on fixed data",
        ),
        Stage(
            "grpo",
            "group relative policy optimisation",
            None,
            "SFTConfig",
            "trl grpo",
            "online RL: each step samples completions per prompt and scores them with reward functions; gym train "
            "trains on fixed data",
        ),
        Stage(
            "online_dpo",
            "online DPO",
            None,
            "SFTConfig",
            "TRL's OnlineDPOTrainer",
            "completions are generated and judged during training (online RL); gym train trains on fixed data "
            "(offline DPO arrives with the preference stage)",
        ),
    )
}


def stage_of(args: argparse.Namespace) -> Stage:
    """The stage the flags ask for (``--stage``, ``sft`` by default; an unknown name, which a config file can give
    and the choice check reports, reads the flags as sft does)."""
    return STAGES.get(str(args.stage), STAGES["sft"])


def data_settings(stage: Stage) -> dict[str, Any]:
    """The data defaults of the stage's objective (``format``, ``packing``, ``mask_prompt``; empty for sft)."""
    if stage.objective is None:
        return {}
    from gym_lightning.objectives import OBJECTIVES

    return dict(getattr(OBJECTIVES[stage.objective], "data_settings", {}))


def stage_problems(args: argparse.Namespace) -> list[str]:
    """The stage refused, or flags that contradict its data settings (each with its fix)."""
    stage = stage_of(args)
    if stage.refusal is not None:
        return [f"--stage {stage.name} ({stage.summary}): {stage.refusal}; {_RUNS}."]
    settings, problems = data_settings(stage), []
    wanted = settings.get("format")
    if wanted is not None and args.data_format not in ("auto", wanted):
        problems.append(f"--stage {stage.name} reads {wanted} records: drop --data_format {args.data_format}.")
    if settings.get("mask_prompt") is False and _masking_flags(args):
        flags = " and ".join(_masking_flags(args))
        problems.append(f"--stage {stage.name} trains on every token: drop {flags} (or train --stage sft).")
    return problems


def _masking_flags(args: argparse.Namespace) -> list[str]:
    return [f"--{name}" for name in ("completion_only_loss", "assistant_only_loss") if getattr(args, name)]


def objective_value(args: argparse.Namespace) -> str | dict[str, Any] | None:
    """``model.objective`` of the stage: ``None`` for sft (the module's default), the registered name, or the
    class with its ``init_args`` where the stage has settings."""
    stage = stage_of(args)
    if stage.objective is None or stage.objective == "sft":
        return None
    if stage.settings is None:
        return stage.objective
    from gym_lightning.objectives import OBJECTIVES

    cls = OBJECTIVES[stage.objective]
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": stage.settings(args)}


def resolved_data(args: argparse.Namespace) -> dict[str, Any]:
    """``data.format``/``data.packing``/``data.mask_prompt`` of the flags over the stage's data defaults: a flag
    given wins (``--packing False`` in stage pt, as LLaMA-Factory's ``packing: false``)."""
    settings = data_settings(stage_of(args))
    data_format = args.data_format if args.data_format != "auto" else settings.get("format", "auto")
    packing = bool(args.neat_packing) or (
        bool(args.packing) if args.packing is not None else bool(settings.get("packing", False))
    )
    chosen = [value for value in (args.completion_only_loss, args.assistant_only_loss) if value is not None]
    mask_prompt = bool(chosen[0]) if chosen else not args.train_on_prompt
    if settings.get("mask_prompt") is False:
        mask_prompt = False
    return {"format": data_format, "packing": packing, "mask_prompt": mask_prompt}


__all__ = ["STAGES", "Stage", "data_settings", "objective_value", "resolved_data", "stage_of", "stage_problems"]
