"""docs/gym-train.md's tables, written from ``gym train``'s own tables: the stages, the launchers, and every field of
every source with how it is read (mapped, accepted, refused) and the counts per config.

``python -m gym_lightning.commands.train.docs`` rewrites the part of the file between ``BEGIN`` and ``END`` (the text
around it is written by hand); ``--check`` exits 1 when the file differs from the tables (a test runs it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from gym_lightning.commands.train import hf, llama_factory_table, trl
from gym_lightning.commands.train.launchers import LAUNCHERS
from gym_lightning.commands.train.parser import GYM
from gym_lightning.commands.train.peft_script import PEFT_SCRIPT
from gym_lightning.commands.train.preference import STAGE_KEYS
from gym_lightning.commands.train.rows import KINDS, Row, counts
from gym_lightning.commands.train.stages import STAGES

DOC = Path(__file__).resolve().parents[3] / "docs" / "gym-train.md"
BEGIN = "<!-- BEGIN TABLES: written by `python -m gym_lightning.commands.train.docs`, do not edit by hand -->"
END = "<!-- END TABLES -->"


def preference_key_rows() -> dict[str, Row]:
    """``STAGE_KEYS`` as one table: ``stage: key`` -> its row."""
    return {f"{stage}: {key}": row for stage, rows in STAGE_KEYS.items() for key, row in rows.items()}


def source_tables() -> dict[str, tuple[str, Mapping[str, Row]]]:
    """Every field table of the manual: its heading -> (what it covers, the table)."""
    lf = llama_factory_table
    return {
        "HF `TrainingArguments`": (
            "every field (TRL's configs and LLaMA-Factory's inherit them)",
            hf.TRAINING_ARGUMENTS,
        ),
        "HF `run_clm.py`": ("the model and data flags of the causal-LM example", hf.RUN_CLM),
        "TRL `ScriptArguments`, `DatasetMixtureConfig`": ("the data (`trl sft`, `trl dpo`, ...)", trl.SCRIPT_ARGUMENTS),
        "TRL `ModelConfig`": ("the model, LoRA and the 4-bit base", trl.MODEL_CONFIG),
        "TRL `SFTConfig`": ("the fields beyond `TrainingArguments` (stages sft and pt)", trl.SFT_CONFIG),
        "TRL `DPOConfig`": ("the fields beyond `TrainingArguments` (stage dpo)", trl.DPO_CONFIG),
        "TRL `KTOConfig`": ("the fields beyond `TrainingArguments` (stage kto)", trl.KTO_CONFIG),
        "TRL `ORPOConfig` (`trl.experimental.orpo`)": (
            "the fields beyond `TrainingArguments` (stage orpo)",
            trl.ORPO_CONFIG,
        ),
        "TRL `CPOConfig` (`trl.experimental.cpo`)": (
            "the fields beyond `TrainingArguments` (stage simpo: its `loss_type simpo`)",
            trl.CPO_CONFIG,
        ),
        "The preference stages' other keys": (
            "what each preference stage makes of LLaMA-Factory's keys and gym's flags that are no field of its TRL "
            "config (a stage not listed for a key refuses it unless at LLaMA-Factory's default)",
            preference_key_rows(),
        ),
        "PEFT `examples/sft/train.py`": (
            "its model and data arguments (its training arguments: SFTConfig)",
            PEFT_SCRIPT,
        ),
        "LLaMA-Factory `ModelArguments`": ("every field", lf.MODEL),
        "LLaMA-Factory `DataArguments`": ("every field", lf.DATA),
        "LLaMA-Factory `FinetuningArguments`": ("every field", lf.FINETUNING),
        "LLaMA-Factory `TrainingArguments`": (
            "the fields beyond transformers' `TrainingArguments` (with `Seq2SeqTrainingArguments`')",
            lf.TRAINING,
        ),
        "gym train's own flags": ("what no source has", GYM),
    }


def coverage() -> dict[str, dict[str, int]]:
    """Fields mapped / accepted / refused per config (TRL's configs: with the ``TrainingArguments`` they inherit)."""
    result = {"TrainingArguments": counts(hf.TRAINING_ARGUMENTS, hf.TRAINING_ARGUMENTS)}
    for name, table in trl.TRL_CONFIGS.items():
        both = hf.TRAINING_ARGUMENTS | table
        result[name] = counts(both, both)
    for name, table in llama_factory_table.TABLES.items():
        result[f"LLaMA-Factory {name}"] = counts(table, table)
    result["PEFT's script"] = counts(PEFT_SCRIPT, PEFT_SCRIPT)
    return result


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _stage_lines() -> list[str]:
    lines = [
        "### Stages",
        "",
        "| stage | trains | objective | TRL config | elsewhere | status |",
        "|---|---|---|---|---|---|",
    ]
    for stage in STAGES.values():
        objective = f"`{stage.objective}`" if stage.objective else "-"
        status = "runs" if stage.refusal is None else f"refused: {stage.refusal}"
        lines.append(
            f"| `{stage.name}` | {stage.summary} | {objective} | `{stage.trl}` | {_cell(stage.elsewhere)} | "
            f"{_cell(status)} |"
        )
    return lines


def _coverage_lines() -> list[str]:
    lines = ["### Coverage", "", "| config | fields | " + " | ".join(KINDS) + " |", "|---|---|---|---|---|"]
    for name, found in coverage().items():
        lines.append(f"| {name} | {sum(found.values())} | " + " | ".join(str(found[kind]) for kind in KINDS) + " |")
    return lines


def _table_lines(heading: str, covers: str, table: Mapping[str, Row]) -> list[str]:
    lines = [
        f"### {heading}",
        "",
        f"{covers[0].upper()}{covers[1:]}.",
        "",
        "| field | read as | how |",
        "|---|---|---|",
    ]
    for name, row in table.items():
        field = f"`{name}` (`--{row.flag}`)" if row.flag else f"`{name}`"
        allowed = f" Taken: {', '.join(map(repr, row.allowed))} besides the default." if row.allowed else ""
        lines.append(f"| {field} | {row.kind} | {_cell(row.note)}.{_cell(allowed)} |")
    return lines


def render() -> str:
    """The generated part of docs/gym-train.md (between ``BEGIN`` and ``END``)."""
    lines = [BEGIN, "", *_stage_lines(), "", "### Launchers", "", "| launcher | what gym train reads |", "|---|---|"]
    lines += [f"| {name} | {_cell(text)} |" for name, text in LAUNCHERS.items()]
    lines += ["", *_coverage_lines()]
    for heading, (covers, table) in source_tables().items():
        lines += ["", *_table_lines(heading, covers, table)]
    return "\n".join([*lines, "", END])


def updated(text: str) -> str:
    """``text`` (the manual) with its generated part written anew."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        raise ValueError(f"{DOC} lacks the markers {BEGIN!r} ... {END!r}")
    return head + render() + tail


def main(argv: list[str] | None = None) -> int:
    """Rewrite the tables of docs/gym-train.md, or with ``--check`` say whether they are current (exit 1 if not)."""
    args = sys.argv[1:] if argv is None else argv
    text = DOC.read_text(encoding="utf-8")
    if "--check" in args:
        current = updated(text) == text
        print(f"{DOC}: {'current' if current else 'stale: run python -m gym_lightning.commands.train.docs'}")
        return 0 if current else 1
    DOC.write_text(updated(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["BEGIN", "DOC", "END", "coverage", "main", "render", "source_tables", "updated"]
