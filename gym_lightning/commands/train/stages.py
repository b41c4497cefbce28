"""The stage table: what ``gym train --stage NAME`` (LLaMA-Factory's ``stage:``, TRL's ``trl sft|dpo|...``) trains.

A stage is a row here plus an objective (``gym_lightning.objectives``): the row names the registered objective that
``model.objective`` selects, the TRL config whose fields the stage reads (``trl.TRL_CONFIGS``: a field's meaning
depends on it, as ``loss_type``'s does; ``preference.STAGE_KEYS`` adds the LLaMA-Factory keys it reads), and how the
objective's settings come from the flags (``settings``: the init_args of ``model.objective``; ``problems``: the
combinations that cannot run). The objective's data defaults are the stage's: its ``data_settings`` (``pt`` reads raw
text, packed, every token a target), else the record format of the batches it reads (``preference`` for DPO's pairs,
``kto`` for KTO's). A field of another stage's config is refused unless at TRL's default (``foreign_rows``). A stage
that does not run carries the one line that refuses it (``refusal``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gym_lightning.commands.train import preference
from gym_lightning.commands.train.rows import Row, refused
from gym_lightning.commands.train.trl import FIELD_DEFAULTS, TRL_CONFIGS

_RUNS = "gym train runs the stages sft, pt, dpo, kto, orpo and simpo (docs/gym-train.md, Stages)"


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
        problems: The combinations of flags the stage cannot run, each with its fix (``None``: none).
    """

    name: str
    summary: str
    objective: str | None
    trl: str
    elsewhere: str
    refusal: str | None = None
    settings: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    problems: Callable[[argparse.Namespace], list[str]] | None = None

    @property
    def fields(self) -> dict[str, Row]:
        """The rows the stage reads its flags with: its TRL config's, then the LLaMA-Factory keys it reads."""
        return TRL_CONFIGS[self.trl] | preference.STAGE_KEYS.get(self.name, {})


def _checks(name: str) -> Callable[[argparse.Namespace], list[str]]:
    """A preference stage's problems: the flags' combinations, then (those right) its objective's ``problems()``
    over the settings the flags give, one line each, before anything runs."""

    def problems(args: argparse.Namespace) -> list[str]:
        found = preference.preference_problems(args, name)
        stage = STAGES[name]
        if found or stage.settings is None or stage.objective is None:
            return found
        from gym_lightning.objectives import OBJECTIVES

        objective = OBJECTIVES[stage.objective](**stage.settings(args))
        return [f"--stage {name}: {problem}." for problem in objective.problems()]

    return problems


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
            "direct preference optimisation (sigmoid, hinge, IPO, robust, an SFT term, ...)",
            "dpo",
            "DPOConfig",
            "trl dpo; LLaMA-Factory stage: dpo (pref_loss sigmoid, hinge, ipo)",
            settings=preference.dpo_settings,
            problems=_checks("dpo"),
        ),
        Stage(
            "kto",
            "Kahneman-Tversky optimisation (unpaired desirable and undesirable examples)",
            "kto",
            "KTOConfig",
            "trl kto; LLaMA-Factory stage: kto",
            settings=preference.kto_settings,
            problems=_checks("kto"),
        ),
        Stage(
            "orpo",
            "odds-ratio preference optimisation (no reference model)",
            "orpo",
            "ORPOConfig",
            "TRL's experimental ORPOTrainer; LLaMA-Factory stage: dpo with pref_loss: orpo",
            settings=preference.orpo_settings,
            problems=_checks("orpo"),
        ),
        Stage(
            "simpo",
            "simple preference optimisation (length-normalised, no reference model)",
            "simpo",
            "CPOConfig",
            "TRL's experimental CPOTrainer with loss_type simpo; LLaMA-Factory stage: dpo with pref_loss: simpo",
            settings=preference.simpo_settings,
            problems=_checks("simpo"),
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
            "(offline DPO: --stage dpo)",
        ),
    )
}


def stage_of(args: argparse.Namespace) -> Stage:
    """The stage the flags ask for (``--stage``, ``sft`` by default; LLaMA-Factory's ``stage: dpo`` with ``pref_loss:
    orpo|simpo`` is that stage; an unknown name, which a config file can give and the choice check reports, reads the
    flags as sft does)."""
    name = preference.llama_factory_stage(str(args.stage), getattr(args, "pref_loss", None))
    return STAGES.get(name, STAGES["sft"])


def data_settings(stage: Stage) -> dict[str, Any]:
    """The data defaults of the stage's objective: its ``data_settings`` (``format``, ``packing``, ``mask_prompt``),
    else the record format of the batches it reads (``preference`` for pairs, ``kto`` for unpaired); empty for sft."""
    if stage.objective is None:
        return {}
    from gym_lightning.data.pairs import KIND_OF_FORMAT
    from gym_lightning.objectives import OBJECTIVES

    cls = OBJECTIVES[stage.objective]
    if hasattr(cls, "data_settings"):
        return dict(cls.data_settings)
    formats = {kind: name for name, kind in KIND_OF_FORMAT.items()}
    return {"format": formats[cls.batch_kind]} if cls.batch_kind in formats else {}


def foreign_rows(stage: Stage) -> dict[str, Row]:
    """A refusal row per flag that another stage reads and ``stage`` does not (a field of another TRL config, a
    preference key): taken at TRL's (LLaMA-Factory's) default, which changes nothing here, refused otherwise."""
    readers: dict[str, list[Stage]] = {}
    for other in STAGES.values():
        if other.refusal is None and other is not stage:
            for name in other.fields:
                readers.setdefault(name, []).append(other)
    defaults = FIELD_DEFAULTS | preference.KEY_DEFAULTS
    rows = {}
    for name, others in readers.items():
        if name in stage.fields:
            continue
        configs = list(dict.fromkeys(other.trl for other in others if name in TRL_CONFIGS[other.trl]))
        where = f"--stage {', '.join(other.name for other in others)}"
        if configs:
            note = f"a field of {_joined(configs)} ({where}), not of --stage {stage.name}'s {stage.trl}: drop it"
        else:
            note = f"read by {where}, not by --stage {stage.name}: drop it"
        rows[name] = refused(note, *defaults.get(name, ()))
    return rows


def _joined(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def stage_problems(args: argparse.Namespace) -> list[str]:
    """The stage refused, flags that contradict its data settings, and its settings' problems (each with its fix)."""
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
    return problems + (stage.problems(args) if stage.problems is not None else [])


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


__all__ = [
    "STAGES",
    "Stage",
    "data_settings",
    "foreign_rows",
    "objective_value",
    "resolved_data",
    "stage_of",
    "stage_problems",
]
