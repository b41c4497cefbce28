"""The ``trainer.*`` settings of the HF Trainer's flags: precision, steps, validation, logging, checkpoints, strategy.

Where Lightning and the HF Trainer count differently, HF's meaning is kept: ``--eval_steps`` counts optimizer steps
(Lightning's ``val_check_interval`` counts micro-batches), logging/eval/save steps below 1 are ratios of
``--max_steps`` (rounded up), a fraction of an epoch trains ``ceil(fraction x steps per epoch)`` steps
(``callbacks.EpochFraction``), and ``--save_total_limit`` keeps every checkpoint unless given.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

from gym_lightning.commands.train.hf import HF_DDP_TIMEOUT
from gym_lightning.errors import GymUserError

# --report_to -> (Lightning logger class, the package it needs).
LOGGERS = {
    "csv": ("lightning.pytorch.loggers.CSVLogger", None),
    "tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", "tensorboard"),
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
}


def report_to(value: str | list[str] | None) -> list[str]:
    """HF's --report_to as a list of integrations; "all" is every installed one, "none" (HF's default) none."""
    names = [value] if isinstance(value, str) else list(value or [])
    if "all" in names:
        return [name for name, (_, package) in LOGGERS.items() if package is None or importlib.util.find_spec(package)]
    return [name for name in names if name != "none"]


def steps(value: float, max_steps: int) -> int:
    """HF's logging/eval/save steps: a count, or below 1 a ratio of the total steps rounded up."""
    return math.ceil(value * max_steps) if 0 < value < 1 else int(value)


def eval_strategy(args: argparse.Namespace) -> str:
    """HF's evaluation strategy: as given, else ``steps`` with ``--eval_steps``, ``epoch`` with ``--do_eval``."""
    given = str(args.eval_strategy) if str(args.eval_strategy) != "no" else None
    return given or ("steps" if args.eval_steps else "epoch" if args.do_eval else "no")


def trainer_values(args: argparse.Namespace, accumulation: int, clip: float) -> dict[str, Any]:
    """Every ``trainer.*`` setting of the flags (``accumulation`` and ``clip`` already reconciled with a DeepSpeed
    JSON's numbers)."""
    values: dict[str, Any] = {
        "trainer.accelerator": "cpu" if args.use_cpu else args.accelerator,
        "trainer.precision": "bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else "32-true",
        "trainer.accumulate_grad_batches": accumulation,
        "trainer.gradient_clip_val": clip,
        "trainer.log_every_n_steps": steps(args.logging_steps, args.max_steps),
        "trainer.default_root_dir": args.output_dir or "trainer_output",
    }
    if args.disable_tqdm:
        values["trainer.enable_progress_bar"] = False
    values |= _strategy_values(args)
    if loggers := report_to(args.report_to):
        values["trainer.logger"] = [
            _logger(name, values["trainer.default_root_dir"], args.run_name) for name in loggers
        ]
    if args.max_steps > 0:
        values |= {"trainer.max_steps": args.max_steps, "trainer.max_epochs": -1}
    else:
        values |= {"trainer.max_epochs": math.ceil(args.num_train_epochs)}
    return values | _eval_values(args, accumulation) | _callback_values(args)


def _strategy_values(args: argparse.Namespace) -> dict[str, Any]:
    """``trainer.strategy`` of --deepspeed or --strategy, with --ddp_timeout and --sequence_parallel_size added."""
    strategy: str | dict[str, Any] | None = None
    if args.deepspeed:
        init_args = {"config": args.deepspeed if isinstance(args.deepspeed, dict) else str(args.deepspeed)}
        strategy = {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": init_args}
    elif args.strategy:
        strategy = args.strategy
    if args.ddp_timeout != HF_DDP_TIMEOUT:
        strategy = with_init_args(strategy, "--ddp_timeout", {"timeout": str(timedelta(seconds=args.ddp_timeout))})
    if args.sequence_parallel_size != 1:
        size = {"sequence_parallel_size": args.sequence_parallel_size}
        strategy = with_init_args(strategy, "--sequence_parallel_size", size)
    return {} if strategy is None else {"trainer.strategy": strategy}


def with_init_args(strategy: str | dict[str, Any] | None, flag: str, init_args: dict[str, Any]) -> dict[str, Any]:
    """``strategy`` (a registered name, a class dict, or ``None`` for auto, which becomes ``gym_ddp``) as a class
    dict with ``init_args`` added: what ``flag`` (``--ddp_timeout``, ``--sequence_parallel_size``) sets."""
    from lightning.pytorch.strategies import StrategyRegistry

    import gym_lightning.strategies  # noqa: F401 - registers gym_lightning's names

    if isinstance(strategy, dict):
        return {**strategy, "init_args": {**strategy.get("init_args", {}), **init_args}}
    name = "gym_ddp" if strategy in (None, "auto") else strategy
    if name not in StrategyRegistry:
        raise GymUserError(f"--strategy {name!r} is not a registered strategy name; see gym fit --help.")
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    if missing := [key for key in init_args if key not in inspect.signature(cls).parameters]:
        raise GymUserError(f"{flag}: strategy {name!r} ({cls.__name__}) has no {missing[0]} argument; drop it.")
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {**entry["init_params"], **init_args}}


def _eval_values(args: argparse.Namespace, accumulation: int) -> dict[str, Any]:
    strategy = eval_strategy(args)
    if strategy == "no":
        return {"trainer.limit_val_batches": 0, "trainer.num_sanity_val_steps": 0}
    if strategy == "epoch":
        return {"trainer.check_val_every_n_epoch": 1, "trainer.val_check_interval": None}
    # Lightning's interval counts micro-batches; HF's eval_steps counts optimizer steps (default: logging_steps).
    every = steps(args.eval_steps or args.logging_steps, args.max_steps)
    return {"trainer.check_val_every_n_epoch": None, "trainer.val_check_interval": every * accumulation}


def _logger(name: str, output_dir: str, run_name: str | None) -> dict[str, Any]:
    class_path = LOGGERS[name][0]
    init_args: dict[str, Any] = {"save_dir": output_dir}
    if name in ("csv", "tensorboard"):
        init_args |= {"name": "logs"} | ({"version": run_name} if run_name else {})
    elif run_name:
        init_args["name" if name == "wandb" else "run_name"] = run_name
    return {"class_path": class_path, "init_args": init_args}


def _callback_values(args: argparse.Namespace) -> dict[str, Any]:
    output_dir = args.output_dir or "trainer_output"
    # trainer_state.json (log_history) and curves.png in output_dir, where HF users look (a CurvesCallback).
    state: list[dict[str, Any]] = [
        {"class_path": "gym_lightning.callbacks.TrainerStateCallback", "init_args": {"output_dir": output_dir}}
    ]
    if args.max_steps <= 0 and args.num_train_epochs != int(args.num_train_epochs):
        # HF: ceil(epochs x steps per epoch) steps; the steps per epoch are known once the DataLoader exists.
        fraction = {"epochs": args.num_train_epochs}
        state.append({"class_path": "gym_lightning.callbacks.EpochFraction", "init_args": fraction})
    if not args.skip_memory_metrics:
        # HF's switch for its memory metrics (default on: skipped); here the per-rank report beside gym plan's.
        state.append({"class_path": "gym_lightning.callbacks.MemoryCallback"})
    save_strategy = str(args.save_strategy)
    if save_strategy == "no":
        return {"trainer.enable_checkpointing": False, "trainer.callbacks": state}
    keep = -1 if args.save_total_limit is None else args.save_total_limit
    dirpath = str(Path(output_dir) / "checkpoints")
    if save_strategy == "steps":
        init_args = {"dirpath": dirpath, "every_n_steps": steps(args.save_steps, args.max_steps), "keep_last": keep}
        checkpoint = {"class_path": "gym_lightning.checkpointing.StepCheckpoint", "init_args": init_args}
    else:
        init_args = {"dirpath": dirpath, "every_n_epochs": 1, "save_top_k": keep, "monitor": "step", "mode": "max"}
        checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": init_args}
    return {"trainer.enable_checkpointing": True, "trainer.callbacks": [checkpoint, *state]}


__all__ = ["LOGGERS", "eval_strategy", "report_to", "steps", "trainer_values", "with_init_args"]
