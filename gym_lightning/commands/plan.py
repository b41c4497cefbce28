"""``gym plan`` / ``python -m gym_lightning plan``: what fits before anyone rents GPUs.

    python -m gym_lightning plan --model llama-3-70b --gpus_per_node 8 --gpu_memory 24GB --activation_checkpointing

prints one row per strategy (GiB per GPU of parameters, gradients, optimizer state, activations, logits and
buffers; host and NVMe per node; whether it fits; the largest micro-batch that fits), the peak per rank of each
phase (load, training step, checkpoint save, export; host and GPU) and the fastest strategy that fits. ``--json``
prints the same as JSON. ``--quantization nf4`` (or ``--load_in_4bit``) with ``--lora_r`` plans QLoRA: a frozen
4-bit NF4 base, a mixture of experts' fused expert weights included. ``--lora_target_parameters all-experts`` (or
peft names, ``experts.gate_up_proj experts.down_proj``) adds LoRA adapters to every routed expert, as ``gym train``'s
flag of that name; ``--lora_targets none`` leaves the linear layers without adapters. Long sequences:
``--sequence_parallel_size N`` (Ulysses: N GPUs share each sequence) and ``--mlp_tile_tokens T`` (tiled MLP);
``--longest_sequence`` adds a column with the longest sequence that fits each strategy at micro-batch 1 (always in
``--json``). Bad flags end with one line on stderr and exit status 2.

``--gpu h200 --interconnect ib-ndr400 --tokens 2e9 --price_per_gpu_hour 3.5`` adds the speed table: per strategy the
predicted step time, tokens/s per GPU, MFU, scaling against one GPU, the rank among those that fit, and the hours,
GPU-hours and dollars of the tokens (``--rows N --epochs E``: N x E x ``--seq_length`` tokens); the recommendation
is the fastest that fits (``planner.timing``, ``planner.budget``; docs/planner.md, "Step time"). The GPU, its node's
link and the fabric come from the hardware catalog (``gym_lightning/assets/hardware.yaml``); ``--peak_tflops``,
``--compute_efficiency``, ``--memory_bandwidth``, ``--intra_node_bandwidth``, ``--inter_node_bandwidth`` and
``--host_bandwidth`` override its figures.

``--config run.yaml`` plans the run a ``gym fit --config run.yaml`` launches: its model, strategy (a line of its
own under the table), micro-batch, sequence length, precision, LoRA, quantisation, sequence parallelism, GPUs
(``planner.run_config`` lists what is read). Flags given beside it override the file; what the planner cannot
model is left out with a note on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, get_args

import yaml

from gym_lightning.commands import CommandParser
from gym_lightning.errors import GymUserError
from gym_lightning.metrics.hardware import FABRICS, GPUS, LINKS
from gym_lightning.planner.auto import choice_line, is_auto
from gym_lightning.planner.catalog import BUNDLED
from gym_lightning.planner.estimate import (
    Accelerator,
    Attention,
    GradientCompression,
    LoraTargets,
    LossChunking,
    Optimizer,
    Precision,
    Quantization,
)
from gym_lightning.planner.machines import DEFAULT_FABRIC, DEFAULT_GPU, Figures
from gym_lightning.planner.report import plan
from gym_lightning.planner.run_config import run_settings
from gym_lightning.vocabulary import AUTO_STRATEGY, STRATEGY_NAMES

# Explicit hardware figures (flag -> what it overrides); each is a Figures field of the same name, or FIGURE_FIELDS'.
FIGURE_FLAGS: dict[str, str] = {
    "peak_tflops": "dense TFLOP/s of one GPU in the compute dtype",
    "compute_efficiency": "fraction of the peak a training loop reaches (calibrated: 0.315)",
    "memory_bandwidth": "GPU memory GB/s",
    "intra_node_bandwidth": "all-reduce bus bandwidth within a node, GB/s (nccl-tests busbw)",
    "inter_node_bandwidth": "all-reduce bus bandwidth across nodes, GB/s (nccl-tests busbw)",
    "host_bandwidth": "pinned host <-> GPU copy GB/s (offload)",
}
FIGURE_FIELDS: dict[str, str] = {
    "memory_bandwidth": "memory_bandwidth_gbs",
    "intra_node_bandwidth": "intra_node_bandwidth_gbs",
    "inter_node_bandwidth": "inter_node_bandwidth_gbs",
    "host_bandwidth": "host_bandwidth_gbs",
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="gym plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a gym fit YAML: plan that run (the other flags given override it)")
    parser.add_argument("--model", help=f"bundled name ({', '.join(BUNDLED)}), preset or config.json")
    parser.add_argument("--strategy", help=f"the run's strategy, on a line of its own: {', '.join(STRATEGY_NAMES)}")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpu", help=f"the GPU (hardware catalog): {', '.join(GPUS)}; default {DEFAULT_GPU}")
    parser.add_argument(
        "--interconnect",
        help=f"fabric between nodes ({', '.join(FABRICS)}), a node's link ({', '.join(LINKS)}), or link,fabric; "
        f"default: the GPU's link, {DEFAULT_FABRIC} across nodes",
    )
    parser.add_argument("--gpu_memory", help="memory per GPU, e.g. 24GB, 80GB (binary units); default: the --gpu's")
    parser.add_argument("--host_memory", default="1TB", help="CPU RAM per node, e.g. 512GB")
    parser.add_argument("--precision", choices=get_args(Precision), default="bf16-mixed")
    parser.add_argument("--micro_batch_size", type=int, default=1)
    parser.add_argument("--seq_length", type=int, default=2048)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 = full finetune")
    parser.add_argument(
        "--lora_targets",
        choices=get_args(LoraTargets),
        default="all-linear",
        help="linear layers with adapters; none: only the experts of --lora_target_parameters",
    )
    parser.add_argument(
        "--lora_target_parameters",
        nargs="+",
        metavar="NAME",
        help="expert weights with adapters (a mixture of experts): all-experts, or peft names such as "
        "experts.gate_up_proj experts.down_proj (spaces or commas between them)",
    )
    parser.add_argument("--optimizer", choices=get_args(Optimizer), default="adamw")
    parser.add_argument("--attention", choices=get_args(Attention), default="sdpa")
    parser.add_argument("--accelerator", choices=get_args(Accelerator), default="gpu")
    parser.add_argument("--checkpoint_file_size", default="5GB", help="largest safetensors file of the checkpoint")
    parser.add_argument("--loss_chunking", choices=get_args(LossChunking), default="auto")
    parser.add_argument("--loss_chunk_tokens", type=int, default=1024)
    parser.add_argument(
        "--quantization",
        choices=get_args(Quantization),
        default="none",
        help="nf4: QLoRA's 4-bit base (needs --lora_r)",
    )
    # The Hugging Face / TRL spelling of the same choice (gym train takes it too).
    parser.add_argument(
        "--load_in_4bit", dest="quantization", action="store_const", const="nf4", default=argparse.SUPPRESS
    )
    parser.add_argument(
        "--sequence_parallel_size",
        type=int,
        default=1,
        help="GPUs that share one sequence (Ulysses); divides the GPUs and the attention heads",
    )
    parser.add_argument("--mlp_tile_tokens", type=int, default=0, help="tokens per tiled-MLP step; 0 = not tiled")
    parser.add_argument(
        "--longest_sequence",
        action="store_true",
        help="add a column: the longest sequence that fits each strategy at micro-batch 1",
    )
    _speed_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _speed_arguments(parser: argparse.ArgumentParser) -> None:
    """The step time's and the budget's flags: accumulation, compression, tokens, price, explicit hardware figures."""
    parser.add_argument("--accumulate_grad_batches", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--gradient_compression", choices=get_args(GradientCompression), default="none")
    parser.add_argument("--tokens", type=float, help="tokens to train on: hours, GPU-hours and cost per strategy")
    parser.add_argument("--rows", type=int, help="rows of the data set (tokens = rows x epochs x seq_length)")
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs over --rows")
    parser.add_argument("--price_per_gpu_hour", type=float, help="dollars per GPU-hour: the cost column")
    for name, unit in FIGURE_FLAGS.items():
        parser.add_argument(f"--{name}", type=float, help=f"override the catalog: {unit}")


def _speed_settings(args: dict[str, Any]) -> dict[str, Any]:
    """``plan()``'s figures and tokens from the flags (``--rows`` x ``--epochs`` x ``--seq_length`` tokens), and
    ``--lora_target_parameters``' names split at commas too (``all-experts`` or ``a,b`` as ``a b``)."""
    names = args.get("lora_target_parameters")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        args["lora_target_parameters"] = [part.strip() for n in names for part in n.split(",") if part.strip()]
    figures = {name: args.pop(name, None) for name in FIGURE_FLAGS}
    args["figures"] = Figures(**{FIGURE_FIELDS.get(k, k): v for k, v in figures.items()})
    rows, epochs = args.pop("rows", None), args.pop("epochs", 1.0)
    if rows is not None:
        if args.get("tokens") is not None:
            raise GymUserError("--tokens and --rows both say how much to train on: pass one.")
        args["tokens"] = rows * epochs * args.get("seq_length", 2048)
    return args


def plan_arguments(argv: list[str] | None = None) -> dict[str, Any]:
    """``plan(...)``'s arguments from the command line: the flags, over ``--config``'s run where one is given."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    config = args.pop("config")
    if config is None:
        if args["model"] is None:
            parser.error("the following arguments are required: --model (or --config)")
        return _speed_settings(args)
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
    return {**_speed_settings({**args, **run.settings, **explicit}), "auto": auto}


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
