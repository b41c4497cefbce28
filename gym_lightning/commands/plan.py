"""``gym plan`` / ``python -m gym_lightning plan``: what fits before anyone rents GPUs.

    python -m gym_lightning plan --model llama-3-70b --gpus_per_node 8 --gpu_memory 24GB --activation_checkpointing

prints one row per strategy (GiB per GPU of parameters, gradients, optimizer state, activations, logits and
buffers; host and NVMe per node; whether it fits; the largest micro-batch that fits), the peak per rank of each
phase (load, training step, checkpoint save, export), the predicted speed of each strategy on the ``--gpu`` and the
fastest that fits. ``--json`` prints the same as JSON. Bad flags end with one line on stderr and exit status 2.

The run's flags are the leaves of the planner's run description (``planner.spec.RunSpec``: each flag's help is its
field's, its choices its type's, its default written there once): model and module (``--attention``,
``--activation_checkpointing``, ``--kernels``, ...), stage and batch (``--stage``: sft, pt, or the preference
stages dpo, kto, orpo, simpo with ``--precompute_ref_log_probs``, ``--ref_model``, ``--reference_dtype``;
``--micro_batch_size``, ``--seq_length``, ...), adapters (``--lora_r``, ``--quantization nf4`` or
``--load_in_4bit``, ``--lora_target_parameters``), parallelism (``--gpus_per_node``, ``--nodes``,
``--sequence_parallel_size``, ``--strategy``), the strategy's knobs (``--bucket_size``,
``--zero3_param_persistence_threshold``, ...) and the hardware (``--gpu``, ``--interconnect``, ``--gpu_memory``,
explicit figures). ``--tokens`` (or ``--rows`` x ``--epochs`` x ``--seq_length``, x 2 for preference pairs) and
``--price_per_gpu_hour`` add hours, GPU-hours and dollars; ``--longest_sequence`` adds the longest sequence that
fits each strategy.

``--config run.yaml`` plans the run a ``gym fit --config run.yaml`` launches (``planner.run_config`` lists what is
read, a DeepSpeed JSON's buckets and persistence thresholds included). Flags given beside it override the file; what
the planner cannot model is left out with a note on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from gym_lightning.commands import CommandParser
from gym_lightning.errors import GymUserError
from gym_lightning.planner.auto import choice_line, is_auto
from gym_lightning.planner.report import plan
from gym_lightning.planner.run_config import run_settings
from gym_lightning.planner.spec import STAGES
from gym_lightning.planner.spec_flags import choices, field_default, flag_fields
from gym_lightning.vocabulary import AUTO_STRATEGY

# Flags that are not run settings: what to print and what the training costs.
PRESENTATION = ("config", "json", "longest_sequence", "tokens", "rows", "epochs", "price_per_gpu_hour")


def build_parser() -> argparse.ArgumentParser:
    """``gym plan``'s parser: one flag per leaf of the run description, then the presentation and budget flags."""
    parser = CommandParser(prog="gym plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a gym fit YAML: plan that run (the other flags given override it)")
    for name, leaf in flag_fields():
        _add_leaf(parser, name, leaf)
    # The Hugging Face / TRL spelling of --quantization nf4 (gym train takes it too).
    parser.add_argument(
        "--load_in_4bit", dest="quantization", action="store_const", const="nf4", default=argparse.SUPPRESS
    )
    parser.add_argument("--longest_sequence", action="store_true", help="add the longest sequence that fits")
    parser.add_argument("--tokens", type=float, help="tokens to train on: hours, GPU-hours and cost per strategy")
    parser.add_argument(
        "--rows", type=int, help="examples of the data set (tokens = rows x epochs x seq_length x sequences)"
    )
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs over --rows (or that --tokens make)")
    parser.add_argument("--price_per_gpu_hour", type=float, help="dollars per GPU-hour: the cost column")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _add_leaf(parser: argparse.ArgumentParser, name: str, leaf: Any) -> None:
    """One flag for a leaf: booleans as switches (``--no_x`` for one on by default), names as lists, a
    ``Literal``'s values as choices, numbers typed, sizes and the rest as text the spec reads."""
    default, help_text = field_default(leaf.name), leaf.metadata["help"]
    kind = str(leaf.type)
    if kind == "bool":
        if default:
            parser.add_argument(f"--no_{name}", dest=name, action="store_false", help=f"off: {help_text}")
        else:
            parser.add_argument(f"--{name}", action="store_true", help=help_text)
        return
    options: dict[str, Any] = {"default": default, "help": help_text}
    if found := choices(leaf.name):
        options["choices"] = found
    elif kind.startswith("tuple"):
        options.update(nargs="+", metavar="NAME")
    elif leaf.metadata.get("parse") is None and kind.replace(" | None", "") in ("int", "float"):
        options["type"] = int if kind.startswith("int") else float
    parser.add_argument(f"--{name}", **options)


def _settings(args: dict[str, Any]) -> dict[str, Any]:
    """``plan()``'s arguments from the parsed flags: the budget's tokens (``--rows`` x ``--epochs`` x
    ``--seq_length`` x the stage's sequences per example: a preference pair's chosen and rejected rows), the rest
    by the leaves' names."""
    rows = args.pop("rows", None)
    if rows is not None:
        if args.get("tokens") is not None:
            raise GymUserError("--tokens and --rows both say how much to train on: pass one.")
        stage = STAGES.get(args.get("stage") or field_default("stage"), STAGES["sft"])
        args["tokens"] = rows * args.get("epochs", 1.0) * args.get("seq_length", field_default("seq_length"))
        args["tokens"] *= stage.sequences
    return {k: v for k, v in args.items() if v is not None or k in PRESENTATION}


def plan_arguments(argv: list[str] | None = None) -> dict[str, Any]:
    """``plan(...)``'s arguments from the command line: the flags, over ``--config``'s run where one is given."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    config = args.pop("config")
    if config is None:
        if args["model"] is None:
            parser.error("the following arguments are required: --model (or --config)")
        return _settings(args)
    # Parsed again with every default suppressed: what remains was given on the command line.
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    explicit = vars(parser.parse_args(argv))
    explicit.pop("config")
    document = _read_yaml(config)
    run = run_settings(document, source=config)
    for note in run.notes:
        print(f"gym plan: {config}: {note}.", file=sys.stderr)
    trainer = document.get("trainer") if isinstance(document, dict) else None
    auto = "strategy" not in explicit and is_auto(
        (trainer or {}).get("strategy") if isinstance(trainer, dict) else None
    )
    return {**_settings({**args, **run.settings, **explicit}), "auto": auto}


def _read_yaml(path: str) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise GymUserError(f"Cannot read --config {path}: {err.strerror or err}.") from None
    except yaml.YAMLError as err:
        raise GymUserError(f"--config {path} is not YAML: {' '.join(str(err).split())}.") from None


def main(argv: list[str] | None = None) -> None:
    """Entry point (``COMMANDS["plan"]`` in ``gym_lightning.cli``); ValueErrors become one line, exit 2, there."""
    args = plan_arguments(argv)
    as_json, auto = args.pop("json"), args.pop("auto", False)
    report = plan(**args)
    if as_json:
        print(json.dumps({**report.to_dict(), **({"auto": choice_line(report)} if auto else {})}, indent=2))
        return
    print(report.table())
    if auto:  # the run's strategy is gym_auto: the recommendation is what it will train with
        print(f"Your run (strategy: {AUTO_STRATEGY}): {choice_line(report)}")


if __name__ == "__main__":
    from gym_lightning.cli import main as gym_main

    gym_main(["plan", *sys.argv[1:]])
