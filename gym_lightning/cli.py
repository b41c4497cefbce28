"""Command line: ``gym COMMAND ...`` (also ``python -m gym_lightning COMMAND ...``); ``gym --help`` lists them.

``fit``/``validate``/``test``/``predict`` are a LightningCLI over ``CausalLMModule`` and ``CausalLMDataModule``.
The other commands (``gym train``, ``gym plan``, ``gym export``) live in ``gym_lightning.commands``, imported
only when used.

One way to fail: a mistake in the user's input raises ``gym_lightning.errors.GymUserError`` wherever it is found
(a setting, a flag, a data file, a checkpoint), and argument-parsing errors raise jsonargparse's/argparse's
``ArgumentError``; the CLI prints either as one line and exits with status 2. A collective that failed because
another rank stopped answering or died carries the strategy's one-line diagnosis (``strategies.rank_failure``):
printed alone, exit status 1. Every other exception is a bug (or an environment failure) and keeps its traceback.
``GYM_DEBUG=1`` shows the traceback of these errors too.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import json
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from gym_lightning._compat import rank_zero_info, run_exit_handlers, stop_threads_as_at_exit
from gym_lightning.callbacks import CurvesCallback, GymProgressBar, HFExport, NonFiniteGuard
from gym_lightning.checkpointing.loader_state import ResumeLoaderPositions
from gym_lightning.checkpointing.manifest import damaged_checkpoint_error, file_problems
from gym_lightning.checkpointing.safe_load import load_lightning_checkpoint
from gym_lightning.commands import COMMANDS
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.pairs import batch_kind_problem
from gym_lightning.errors import EveryRankError, GymUserError
from gym_lightning.metrics.hardware import gpu_for_device_name
from gym_lightning.models.presets import resolve_tokenizer_source
from gym_lightning.module import CausalLMModule
from gym_lightning.objectives import OBJECTIVES, Objective
from gym_lightning.patches import apply_patches
from gym_lightning.planner.auto import AutoChoice, choose_strategy, is_auto
from gym_lightning.planner.machines import DEFAULT_GPU
from gym_lightning.precision import clipping_precision
from gym_lightning.prediction_writer import JsonlPredictionWriter
from gym_lightning.quiet import quiet_console
from gym_lightning.strategies import ZeROStrategy, strategy_name_problem
from gym_lightning.strategies.rank_failure import NOTE_PREFIX, exit_within, rank_failure_line
from gym_lightning.strategies.zero.config import load_deepspeed_json
from gym_lightning.strategies.zero.hf_auto import adopted_accumulation
from gym_lightning.vocabulary import AUTO_STRATEGY

# LightningCLI's subcommands, with the one line ``gym --help`` shows for each.
LIGHTNING_COMMANDS: dict[str, str] = {
    "fit": "train (and validate) from a YAML config: gym fit --config configs/quickstart.yaml",
    "validate": "run the validation loop once and print its metrics",
    "test": "run the test loop once and print its metrics",
    "predict": "generate completions for the prediction prompts (written to predictions.jsonl)",
}
# ``fit --ckpt_path`` values that are not paths (Lightning resolves them itself).
CKPT_KEYWORDS: tuple[str, ...] = ("last", "best", "hpc", "registry")
DEBUG_ENV_VAR = "GYM_DEBUG"
# Where a run whose config names no trainer.default_root_dir writes (Lightning's default, the current directory,
# received config.yaml, curves.png and the JSON reports loose beside the user's own files when there was no logger).
DEFAULT_ROOT_DIR = "outputs/run"
RANK_FAILURE_EXIT_SECONDS = 10.0  # after a failed collective, the longest the interpreter's own exit may take


class GymCLI(LightningCLI):
    """LightningCLI over ``CausalLMModule``/``CausalLMDataModule`` that:

    - links the data module's tokenizer to the model's (one source of truth);
    - adds the ``export:`` (``HFExport``) and ``nonfinite:`` (``NonFiniteGuard``) sections as callbacks;
    - resolves ``trainer.strategy: gym_auto`` to the fastest strategy that fits, with one line saying which and why
      (``resolve_auto_strategy``), before anything else reads the strategy;
    - finds user errors before anything is built (an unknown strategy name, an unreadable ``--ckpt_path``);
    - adopts a DeepSpeed JSON's ``gradient_accumulation_steps`` into ``trainer.accumulate_grad_batches`` before the
      Trainer exists (the strategy only checks that the two agree);
    - gives every run TensorBoard + CSV logs, a progress bar without ``v_num``, the learning rate and ``curves.png``
      (``cli_trainer_defaults``);
    - clips gradients under ``bf16-mixed``/``16-mixed`` with fused optimizers too, on every strategy
      (``precision.GymMixedPrecision``);
    - writes nothing outside ``trainer.default_root_dir``: without one, the run's folder is ``DEFAULT_ROOT_DIR``
      (``outputs/run``), and the run says so.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One source of truth: the data module cannot be given a tokenizer that differs from the model's.
        parser.link_arguments(("model.model", "model.tokenizer"), "data.tokenizer", compute_fn=resolve_tokenizer_source)
        parser.link_arguments("model.trust_remote_code", "data.trust_remote_code")
        parser.link_arguments("model.special_tokens", "data.special_tokens")
        parser.add_lightning_class_args(HFExport, "export")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:
            # jsonargparse's own words for this one are a dump of its union types; say what works instead.
            argv = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict | Namespace) else []
            if (line := named_strategy_with_init_args(argv)) is None:
                raise
            raise GymUserError(line) from err
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_ckpt_path(self.config[subcommand].get("ckpt_path"))

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config["trainer"]
        if is_auto(trainer.get("strategy")):  # first: the name check and the accumulation adoption read the choice
            trainer["strategy"] = resolve_auto_strategy(config)
        strategy = trainer.get("strategy")
        if isinstance(strategy, str) and (problem := strategy_name_problem(strategy)):
            raise GymUserError(f"--trainer.strategy {strategy!r}: {problem}")
        # The DeepSpeed JSON's gradient_accumulation_steps and trainer.accumulate_grad_batches are one setting: adopt
        # the JSON's before the Trainer (and the data loader, the step count) exist; the strategy only checks.
        trainer["accumulate_grad_batches"] = accumulation_from_strategy_config(
            strategy, trainer["accumulate_grad_batches"]
        )
        if trainer.get("default_root_dir") is None:
            trainer["default_root_dir"] = DEFAULT_ROOT_DIR
            rank_zero_info(
                f"gym_lightning: trainer.default_root_dir is not set: this run's files (config.yaml, logs, reports, "
                f"curves.png, checkpoints) go to {Path(DEFAULT_ROOT_DIR).resolve()}; set it to choose the folder."
            )

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # Not trainer_defaults: LightningCLI adds those callbacks unconditionally, which breaks
        # enable_progress_bar=false (a progress bar callback is refused) and logger=false (LearningRateMonitor is).
        section = self.config_init[self.subcommand] if self.subcommand else self.config_init
        configured = {**section.get("trainer", {}), **kwargs}
        trainer = super().instantiate_trainer(**{**kwargs, **cli_trainer_defaults(configured)})
        # bf16-mixed + gradient_clip_val with the module's fused AdamW on any strategy (gym_lightning's strategies do
        # this themselves; one device and Lightning's DDP get it here): precision.GymMixedPrecision.
        trainer.strategy.precision_plugin = clipping_precision(trainer.strategy.precision_plugin)
        return trainer

    def before_fit(self) -> None:  # LightningCLI calls ``before_<subcommand>`` hooks by name
        """The objective and the data agree on the batches before anything is prepared or built."""
        if problem := objective_data_problem(self.model, self.datamodule):
            raise GymUserError(problem)

    def before_validate(self) -> None:
        self.before_fit()

    def before_predict(self) -> None:  # LightningCLI calls ``before_<subcommand>`` hooks by name
        """``predict`` from the command line writes its completions to a file unless a writer is configured."""
        if not any(isinstance(callback, JsonlPredictionWriter) for callback in self.trainer.callbacks):
            self.trainer.callbacks.append(JsonlPredictionWriter())


def objective_data_problem(model: object, datamodule: object) -> str | None:
    """One line when the module's objective reads other batches than the data module gives (an SFT run on preference
    data, DPO on chat data); ``None`` when they agree or either does not say (a user's own classes)."""
    objective, kind = getattr(model, "objective", None), getattr(datamodule, "batch_kind", None)
    if not isinstance(objective, Objective) or not isinstance(kind, str):
        return None
    fits = sorted(name for name, cls in OBJECTIVES.items() if cls.batch_kind == kind)
    return batch_kind_problem(objective.name, objective.batch_kind, kind, fits)


def named_strategy_with_init_args(argv: list[str]) -> str | None:
    """The one line for a registered strategy name given init args (``--trainer.strategy zero_infinity
    --trainer.strategy.nvme_path /scratch``), which jsonargparse refuses (a name is a string, not a class): the
    class-path form that works, the name's own init args included; ``None`` when ``argv`` is not that case.

    The name is the last ``--trainer.strategy`` of ``argv``, else the one of a ``--config`` file it names.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    given = dict(_dotted_values(argv, "--trainer.strategy."))
    name = next((value for key, value in reversed(_dotted_values(argv, "--trainer.strategy")) if not key), None)
    name = name if name is not None else _config_strategy(argv)
    if not given or not isinstance(name, str) or name not in StrategyRegistry:
        return None
    entry = StrategyRegistry[name]
    init_args = {**entry["init_params"], **given}
    form = f"--trainer.strategy {_class_path(entry['strategy'])}"
    form += "".join(f" --trainer.strategy.{key} {_cli_value(value)}" for key, value in init_args.items())
    flags = ", ".join(f"--trainer.strategy.{key}" for key in given)
    return (
        f"--trainer.strategy {name} is a registered name, which takes no init args ({flags}); give its class with "
        f"them: {form} (in YAML: strategy: {{class_path: ..., init_args: {{...}}}})."
    )


def _dotted_values(argv: list[str], prefix: str) -> list[tuple[str, str]]:
    """``(key after prefix, value)`` of every ``--prefix...`` argument of ``argv`` (``--k v`` and ``--k=v``)."""
    found = []
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag.startswith(prefix) and (equals or index + 1 < len(argv)):
            found.append((flag[len(prefix) :], value if equals else argv[index + 1]))
    return found


def _config_strategy(argv: list[str]) -> Any:
    """``trainer.strategy`` of the last ``--config`` file of ``argv`` that sets it (``None`` if none does)."""
    strategy = None
    for _, path in [(key, value) for key, value in _dotted_values(argv, "--config") if not key]:
        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse reports a config it cannot read
        trainer = config.get("trainer") if isinstance(config, dict) else None
        strategy = trainer.get("strategy", strategy) if isinstance(trainer, dict) else strategy
    return strategy


def _class_path(cls: type) -> str:
    """The shortest import path of ``cls`` below its top package (``gym_lightning.strategies.ZeROStrategy``, as the
    shipped configs write it, not its defining module)."""
    parts = cls.__module__.split(".")
    for end in range(min(2, len(parts)), len(parts) + 1):
        module = ".".join(parts[:end])
        if getattr(importlib.import_module(module), cls.__qualname__, None) is cls:
            return f"{module}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _cli_value(value: Any) -> str:
    """A value as a command-line word jsonargparse reads back (JSON for anything but plain strings)."""
    return shlex.quote(value) if isinstance(value, str) else shlex.quote(json.dumps(value))


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Fail early, in one line, on a ``--ckpt_path`` that is missing or not a readable, safe checkpoint file.

    Lightning's CLI reads the file's hyper-parameters before anything else, and a broken file would end there in a
    torch traceback. A file with a manifest is checked against it first (``checkpointing.manifest``; the strategy
    does not hash it again in this process); then it is memory-mapped, so only the pickled metadata is read.
    Folders (sharded FSDP and DeepSpeed checkpoints) are checked by their strategy when they are loaded.
    """
    if not ckpt_path or ckpt_path in CKPT_KEYWORDS:
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise GymUserError(
            f"--ckpt_path {ckpt_path!r} does not exist; pass a checkpoint file or folder, or 'last' to resume from the "
            "newest checkpoint of this run."
        )
    if path.is_file():
        if problems := file_problems(path):  # before the file is read: a damaged one is named, with what to do
            raise damaged_checkpoint_error(path, problems)
        load_lightning_checkpoint(path, required=("state_dict", "pytorch-lightning_version"))


# ---------------------------------------------------------------------------------------- trainer.strategy gym_auto
@dataclass(frozen=True)
class DetectedHardware:
    """The hardware a ``gym_auto`` run plans for (``detect_hardware``).

    Args:
        accelerator: ``"gpu"`` (CUDA) or ``"cpu"``.
        gpu: The catalog GPU's key (``metrics.hardware``), ``None`` on CPU or for a GPU the catalog does not list.
        gpu_memory: Bytes of device 0 as the driver reports them; ``None`` on CPU.
        devices: Ranks per node that ``trainer.devices: auto`` gives (every visible GPU; one CPU process).
        host_memory: Bytes of physical RAM of this node; ``None`` where ``os.sysconf`` cannot tell.
        device_name: CUDA's name of device 0 (``torch.cuda.get_device_name``); ``None`` on CPU.
    """

    accelerator: str
    gpu: str | None
    gpu_memory: int | None
    devices: int
    host_memory: int | None
    device_name: str | None = None


def detect_hardware(trainer: Mapping[str, Any]) -> DetectedHardware:
    """The hardware the run's ``trainer`` section (plain data) will train on, as ``gym_auto`` plans for it.

    CUDA when ``trainer.accelerator`` is not ``cpu`` and a GPU is visible (what Lightning's ``auto`` picks too);
    else CPU ranks, which have no step-time figures: the planner's list order decides there.

    Args:
        trainer: The ``trainer`` section (``accelerator`` is read).
    """
    host_memory = physical_memory()
    if str(trainer.get("accelerator") or "auto") != "cpu" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        catalog = gpu_for_device_name(name)
        memory = torch.cuda.get_device_properties(0).total_memory
        count = torch.cuda.device_count()
        return DetectedHardware("gpu", catalog.key if catalog else None, memory, count, host_memory, name)
    # Lightning's CPUAccelerator.auto_device_count() is 1: devices auto is one process.
    return DetectedHardware("cpu", None, None, 1, host_memory)


def physical_memory() -> int | None:
    """Bytes of physical RAM of this node (``SC_PAGE_SIZE`` x ``SC_PHYS_PAGES``), ``None`` where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX (os.sysconf missing) or the names are not supported
        return None


def resolve_auto_strategy(config: Any) -> str | Namespace:
    """The ``trainer.strategy`` value ``gym_auto`` stands for in the parsed ``config`` (the subcommand's namespace):
    the planner's fastest strategy that fits this model, batch and hardware (``planner.auto.choose_strategy``).

    Every rank calls this with the same config on the same kind of node (the launcher starts them alike), so every
    rank reaches the same choice without a collective (there is no process group yet). The line saying which and
    why is printed once, by rank zero.

    Args:
        config: The parsed configuration (``trainer``, ``model``, ``data``), a jsonargparse ``Namespace``.

    Raises:
        GymUserError: when the planner cannot read the config, or no strategy fits (the CLI exits with status 2).
    """
    plain = {name: _without_none(_field(config, name)) for name in ("trainer", "model", "data")}
    hardware = detect_hardware(plain["trainer"])
    if hardware.accelerator == "cpu":  # accelerator auto without a GPU is CPU ranks: plan host memory, not a GPU's
        plain["trainer"]["accelerator"] = "cpu"
    choice = _choose(plain, hardware)
    rank_zero_info(choice.line)
    if hardware.accelerator == "gpu" and hardware.gpu is None:  # ranked with another chip's speeds: say so
        rank_zero_info(
            f"{AUTO_STRATEGY}: {hardware.device_name!r} is not in gym_lightning's GPU catalog "
            f"(gym_lightning/assets/hardware.yaml): the speeds are {DEFAULT_GPU}'s, the memory is this GPU's own."
        )
    if isinstance(choice.strategy, str):
        return choice.strategy
    # jsonargparse instantiates a class given as class_path + init_args namespaces; omitted arguments keep defaults.
    return Namespace(class_path=choice.strategy["class_path"], init_args=Namespace(**choice.strategy["init_args"]))


def _choose(config: dict[str, Any], hardware: DetectedHardware) -> AutoChoice:
    """``choose_strategy`` for the run's plain ``config`` on ``hardware``; a config the planner cannot read is named
    as gym_auto's problem (the user did not ask for a plan otherwise).

    Args:
        config: The run's ``trainer``, ``model`` and ``data`` sections as plain data.
        hardware: What ``detect_hardware`` found.
    """
    try:
        return choose_strategy(
            config,
            gpu=hardware.gpu,
            gpu_memory=hardware.gpu_memory,
            host_memory=hardware.host_memory,
            gpus_per_node=hardware.devices,
            source="this run",
        )
    except GymUserError as err:
        if str(err).startswith(f"strategy {AUTO_STRATEGY}"):  # nothing fits: the message already says gym_auto
            raise
        raise GymUserError(
            f"trainer.strategy {AUTO_STRATEGY} plans the run before it starts: {err} Change that setting, or name the "
            "strategy instead of gym_auto."
        ) from None


def _without_none(section: Any) -> dict[str, Any]:
    """A parsed section as plain data without its ``None`` values: a setting left at ``None`` is the default the
    run gets (``trainer.precision: null`` is 32-true), which the planner reads as a key left out."""
    if section is None:
        return {}
    data = section.as_dict() if isinstance(section, Namespace) else dict(section)
    return {key: value for key, value in data.items() if value is not None}


# --------------------------------------------------------------------------------- DeepSpeed JSON -> the Trainer
def accumulation_from_strategy_config(strategy: Any, accumulate_grad_batches: int) -> int:
    """``trainer.accumulate_grad_batches`` of a parsed Trainer configuration, with a ZeRO JSON's number adopted.

    ``strategy`` is ``trainer.strategy`` as the config parser holds it: a name (``"zero3"``, no JSON) or
    ``{"class_path": ..., "init_args": {"config": path or dict}}`` (a dict or a namespace) naming ``ZeROStrategy`` or
    a subclass. When it holds a JSON with an explicit ``gradient_accumulation_steps`` and ``accumulate_grad_batches``
    is at its default 1, the JSON's number is returned (``strategies.zero.hf_auto``: one setting, never two); else
    ``accumulate_grad_batches``. Called before the Trainer is built: the data loader and the step count read the
    Trainer's value, and the strategy, which only sees the Trainer afterwards, reports a disagreement.
    """
    config = zero_strategy_json(strategy)
    return accumulate_grad_batches if config is None else adopted_accumulation(config, accumulate_grad_batches)


def zero_strategy_json(strategy: Any) -> dict[str, Any] | None:
    """The DeepSpeed JSON of a ``ZeROStrategy`` (or subclass) given as ``class_path`` + ``init_args.config``, else
    ``None``. The class is imported and checked, not matched by name, so a user's own subclass counts too."""
    class_path = _field(strategy, "class_path")
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # LightningCLI reports a class path that does not resolve
    if not (isinstance(cls, type) and issubclass(cls, ZeROStrategy)):
        return None
    config = _field(_field(strategy, "init_args"), "config")
    return None if config is None else load_deepspeed_json(config)


def _field(node: Any, key: str) -> Any:
    # Parsed configs are dicts, or (LightningCLI) jsonargparse namespaces, which are read by attribute.
    if node is None or isinstance(node, str):
        return None
    return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)


# -------------------------------------------------------------------------------------- the CLI's Trainer defaults
def default_loggers(save_dir: str) -> list[Any]:
    """TensorBoard and CSV logs in the same ``<save_dir>/lightning_logs/version_N`` folder.

    TensorBoard is what ``logger: true`` gives now that tensorboard is a dependency; the CSV log is kept beside it
    because the notebooks and tests read ``metrics.csv``. The TensorBoard logger is given the CSV logger's version,
    so a new run never splits into two version folders.
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not tensorboard_available():  # an environment built before tensorboard was declared: CSV as before
        return [CSVLogger(save_dir=save_dir)]
    csv = CSVLogger(save_dir=save_dir)
    # CSV first: Lightning creates the loggers' folders in list order, and a CSVLogger that finds its folder already
    # holding TensorBoard's event file warns "exists and is not empty ... will be deleted" on every run.
    return [csv, TensorBoardLogger(save_dir=save_dir, version=csv.version)]


def tensorboard_available() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def cli_trainer_defaults(trainer_config: Mapping[str, Any]) -> dict[str, Any]:
    """Trainer arguments ``gym fit`` adds to the configured ones (``trainer_config``: the instantiated ``trainer``
    section): the returned ``callbacks`` are the configured ones plus the defaults below; ``logger`` is returned only
    when the config leaves it at its default.

    Defaults: ``checkpointing.ResumeLoaderPositions`` (always), ``GymProgressBar`` (unless
    ``enable_progress_bar: false`` or the config has a progress bar),
    ``LearningRateMonitor(logging_interval="step")`` (when there is a logger: it refuses to run without one),
    ``CurvesCallback`` (``curves.png`` at the end of fit), and TensorBoard + CSV logs in the run folder
    (``default_loggers``). A callback type the config already lists is not added twice. ``barebones`` runs get
    nothing (Lightning refuses loggers and progress bars there).
    """
    from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar

    configured = trainer_config.get("callbacks") or []
    configured = list(configured) if isinstance(configured, list | tuple) else [configured]
    # The mid-epoch loader position (checkpointing.loader_state): every run, barebones too.
    resume = [] if _has(configured, ResumeLoaderPositions) else [ResumeLoaderPositions()]
    if trainer_config.get("barebones"):
        return {"callbacks": [*configured, *resume]}
    logger = trainer_config.get("logger")
    added: list[Any] = []
    if trainer_config.get("enable_progress_bar") is not False and not _has(configured, ProgressBar):
        added.append(GymProgressBar())
    if logger is not False and not _has(configured, LearningRateMonitor):
        added.append(LearningRateMonitor(logging_interval="step"))
    if not _has(configured, CurvesCallback):
        added.append(CurvesCallback())
    defaults: dict[str, Any] = {"callbacks": [*configured, *resume, *added]}
    if logger in (None, True):
        defaults["logger"] = default_loggers(str(trainer_config.get("default_root_dir") or os.getcwd()))
    return defaults


def _has(callbacks: list[Any], kind: type) -> bool:
    return any(isinstance(callback, kind) for callback in callbacks)


def run_lightning_cli(args: list[str] | None) -> None:
    """Run ``GymCLI``; ``args=None`` parses ``sys.argv`` (passing both makes LightningCLI warn)."""
    subcommands = {name: {"exit_on_error": False} for name in LIGHTNING_COMMANDS}
    apply_patches()  # explicit, once per process: gym_lightning.patches says what and why
    GymCLI(
        CausalLMModule,
        CausalLMDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False, **subcommands},
    )


def usage() -> str:
    """The text of ``gym --help``: every command with one line."""
    width = max(map(len, [*LIGHTNING_COMMANDS, *COMMANDS]))
    lines = ["usage: gym COMMAND [options]   (or: python -m gym_lightning COMMAND [options])", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in LIGHTNING_COMMANDS.items()]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Run `gym COMMAND --help` for the options of a command."]
    return "\n".join(lines)


def _unknown_command(name: str) -> GymUserError:
    names = [*LIGHTNING_COMMANDS, *COMMANDS]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return GymUserError(f"unknown command {name!r}; {hint}the commands are {', '.join(names)} (see gym --help).")


def _dispatch(args: list[str], from_sys_argv: bool) -> None:
    command = args[0]
    if command in COMMANDS:
        module_name, function = COMMANDS[command][0].split(":")
        getattr(importlib.import_module(module_name), function)(args[1:])
    elif command in LIGHTNING_COMMANDS:
        run_lightning_cli(None if from_sys_argv else args)
    else:
        raise _unknown_command(command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``gym`` and ``python -m gym_lightning``. Run as the process's command (``argv=None``), a
    command that finished (or refused the user's input) ends the process through :func:`end_process`."""
    quiet_console()  # before deepspeed is first imported: gym_lightning.quiet says what it silences and why
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)
    try:
        _dispatch(args, from_sys_argv=argv is None)
    except (GymUserError, argparse.ArgumentError) as err:
        if os.environ.get(DEBUG_ENV_VAR):
            raise
        if not isinstance(err, EveryRankError) or global_rank() == 0:  # the same error on N ranks: shown once
            print(f"gym_lightning: error: {one_line(err)}", file=sys.stderr)
        if argv is None:
            end_process(2)
        raise SystemExit(2) from None
    except Exception as err:
        if (line := rank_failure_line(err)) is None or os.environ.get(DEBUG_ENV_VAR):
            raise
        # A rank stopped answering or died (strategies.rank_failure): one line, not a bug's traceback, and an exit
        # that a process group whose peer vanished cannot block.
        if line.startswith(NOTE_PREFIX):
            print(f"gym_lightning: error: {one_line(line.removeprefix(NOTE_PREFIX))}", file=sys.stderr)
        exit_within(RANK_FAILURE_EXIT_SECONDS, 1)
        raise SystemExit(1) from None
    if argv is None:
        end_process(0)


def end_process(status: int) -> None:
    """End a process whose command is done with ``status``, without the interpreter's finalisation, when it has
    started a process group; otherwise return (the caller exits as usual).

    gloo's C++ threads can outlive the process group, destroyed or not (``strategies._common.
    destroy_process_group_at_exit``), and need the GIL while the interpreter finalises: a run that had finished
    then exited -6 ("terminate called without an active exception"; pytorch #179291, #190489), now and then, so a
    job scheduler saw a failure. Everything Python's own exit does before finalising is done here, in its order:
    threading's exit callbacks run and non-daemon threads are joined (``_compat.stop_threads_as_at_exit``), the
    ``atexit`` handlers run (the process group's destruction, ``logging``'s and
    the loggers' flushes) and the standard streams are flushed; then ``os._exit`` skips the finalisation itself.
    Objects that only finalisation would collect get no ``__del__``: a file must be closed or flushed by its
    owner (Lightning's loggers are, in ``teardown``), as anywhere a process can be killed.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    stop_threads_as_at_exit()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream must not turn success into a failure
            stream.flush()
    os._exit(status)


def global_rank() -> int:
    """This process's rank in the job's process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its whitespace, newlines included, collapsed)."""
    return " ".join(str(err).split()) or type(err).__name__
