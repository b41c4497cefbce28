"""``gym plan --config``: the settings of the run a ``gym fit`` YAML launches, by the run description's flat names
(pure data, no Lightning: the YAML is read as plain data, ``class_path`` / ``init_args`` followed, registered names
looked up in ``gym_lightning.vocabulary``). What is read (docs/planner.md, "Planning the run you will launch"):

* ``model``: ``model``, ``config_overrides``, ``lora`` (``r``, ``target_modules``, ``target_parameters``),
  ``quantization`` (``quant_type``, ``skip_modules``), ``gradient_checkpointing``, ``attn_implementation``,
  ``optim``, ``mlp_tile_tokens``, ``loss_chunking``, ``loss_chunk_tokens``, ``objective`` (the stage, and a
  preference objective's ``precompute_ref_log_probs`` and ``ref_model``), ``compile`` / ``fused_ops`` (the kernels);
* ``data``: ``batch_size`` and ``max_seq_length`` (micro-batch and sequence);
* ``trainer``: ``precision``, ``devices``, ``num_nodes``, ``accumulate_grad_batches``, ``accelerator``, and
  ``strategy``: a registered name, or a class with its ``init_args`` (FSDP's ``sharding`` and ``cpu_offload``,
  ZeRO's ``stage``, offload, ``bucket_size``, ``leaf_decoder_layers`` and the DeepSpeed JSON of ``config``: its
  stage, offload devices, buckets, persistence thresholds and sub-group, :data:`JSON_KNOBS`; gym_ddp's
  ``gradient_compression`` and ``powersgd_rank``; every strategy's ``sequence_parallel_size``); ``gym_auto``:
  none, the plan picks.

A setting the YAML leaves out is the one the run gets (the module's and the data module's defaults); one the
planner cannot model is left out with a note; a value it cannot read is a problem, all of them in one error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gym_lightning.errors import GymUserError
from gym_lightning.planner.spec import STAGES
from gym_lightning.planner.spec_flags import field_default
from gym_lightning.planner.strategies import Strategy, planner_strategy
from gym_lightning.vocabulary import (
    AUTO_STRATEGY,
    STRATEGY_NAMES,
    STRATEGY_PRESET_BY_NAME,
    StrategyClass,
    strategy_class_of,
)

# The defaults a run gets when its YAML leaves a setting out: CausalLMModule's, GymDataModule's and LoRAArgs'
# (tests/planner/test_run_config.py checks them against those signatures; not imported: no torch here).
MODULE_DEFAULTS: dict[str, Any] = {"model": "tiny-llama", "optim": "adamw_torch_fused", "lora_r": 8}
DATA_DEFAULTS: dict[str, int] = {"batch_size": 8, "max_seq_length": 512}
# The module's optimizers by the planner's optimizer-state model: one fp32 state per parameter is SGD's momentum.
OPTIMIZERS: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "sgd": "sgd",
    "adafactor": "adafactor",
}
ONE_STATE_OPTIMIZERS = ("adagrad", "rmsprop")
PRECISIONS: dict[str, str] = {"32": "32-true", "32-true": "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}
# What each strategy class's memory depends on, as planner_strategy reads it; ZeRO1/2/3Strategy fix the stage.
MEMORY_ARGS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "fsdp": ("sharding", "cpu_offload"),
    "zero": ("stage", "offload_optimizer", "offload_parameters"),
}
FIXED_STAGES: dict[str, int] = {"ZeRO1Strategy": 1, "ZeRO2Strategy": 2, "ZeRO3Strategy": 3}
# Strategy arguments the planner reads into the spec's knobs (strategy argument -> leaf).
KNOB_ARGS: dict[str, str] = {
    "bucket_size": "bucket_size",
    "leaf_decoder_layers": "zero3_leaf_layers",
    "powersgd_rank": "powersgd_rank",
    "gradient_compression": "gradient_compression",
    "sequence_parallel_size": "sequence_parallel_size",
}
# A DeepSpeed JSON's zero_optimization keys the planner reads (key -> leaf); "auto" values are gym's rule's.
JSON_KNOBS: dict[str, str] = {
    "reduce_bucket_size": "bucket_size",
    "stage3_param_persistence_threshold": "zero3_param_persistence_threshold",
    "stage3_model_persistence_threshold": "zero3_model_persistence_threshold",
    "sub_group_size": "sub_group_size",
}
# A preference objective's settings that change what the run holds and runs (objective argument -> leaf); its
# others (beta, loss_type, ...) change neither memory nor time.
OBJECTIVE_SETTINGS: dict[str, str] = {"precompute_ref_log_probs": "precompute_ref_log_probs", "ref_model": "ref_model"}
# Strategy arguments that do not change what the planner models (no note when set).
NO_MEMORY_ARGS = frozenset(
    [
        "powersgd_start_iter",
        "static_graph",
        "find_unused_parameters",
        "process_group_backend",
        "timeout",
        "start_method",
        "save_distributed_checkpoint",
        "cpu_optimizer",
        "load_full_weights",
        "exclude_frozen_parameters",
        "logging_level",
        "nvme_path",
        "config",
        "layer_classes",
        "activation_checkpointing",
        *KNOB_ARGS,
    ]
)
# Module settings that do not change memory (no note when set); any other unmapped one gets a note.
NO_MEMORY_MODEL_KEYS = frozenset(
    [
        "tokenizer",
        "pretrained",
        "trust_remote_code",
        "special_tokens",
        "lr",
        "weight_decay",
        "betas",
        "eps",
        "scheduler",
        "warmup_steps",
        "warmup_ratio",
        "min_lr_ratio",
        "hf_scheduler",
        "scheduler_kwargs",
        "decay_rule",
        "generation",
        "val_exact_match",
    ]
)


@dataclass
class RunSettings:
    """What :func:`run_settings` read: ``plan(...)`` arguments, and a note per setting left out."""

    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def run_settings(config: Mapping[str, Any], source: str = "the run config") -> RunSettings:
    """The ``plan(...)`` arguments of the run ``config`` (a ``gym fit`` YAML, as plain data) describes.

    Args:
        config: The YAML's top-level mapping (``trainer``, ``model``, ``data``, ...).
        source: How the error names the file.

    Raises:
        GymUserError: One line listing every value that cannot be planned.
    """
    run = RunSettings()
    if not isinstance(config, Mapping):
        raise GymUserError(f"{source} must be a YAML mapping (trainer:, model:, data:), got {type(config).__name__}.")
    model = _section(config.get("model"), "model", run)
    _model_settings(model, run)
    _lora_settings(model.get("lora"), run)
    _quantization_settings(model.get("quantization"), run)
    data = _section(config.get("data"), "data", run)
    run.settings["micro_batch_size"] = data.get("batch_size", DATA_DEFAULTS["batch_size"])
    run.settings["seq_length"] = data.get("max_seq_length", DATA_DEFAULTS["max_seq_length"])
    trainer = _section(config.get("trainer"), "trainer", run)
    _trainer_settings(trainer, run)
    _strategy_settings(trainer.get("strategy"), run)
    if run.problems:
        raise GymUserError(f"Cannot plan {source}: " + "; ".join(run.problems) + ".")
    return run


def _section(value: Any, name: str, run: RunSettings) -> Mapping[str, Any]:
    """A section's settings: the mapping itself, or its ``init_args`` when it names a ``class_path``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        run.problems.append(f"{name} must be a mapping, got {value!r}")
        return {}
    return value.get("init_args") or {} if "class_path" in value else value


def _model_settings(model: Mapping[str, Any], run: RunSettings) -> None:
    s = run.settings
    s["model"] = model.get("model", MODULE_DEFAULTS["model"])
    if model.get("config_overrides"):
        s["config_overrides"] = dict(model["config_overrides"])
    s["activation_checkpointing"] = bool(model.get("gradient_checkpointing", False))
    attention = model.get("attn_implementation") or "sdpa"  # transformers' default
    if str(attention).startswith("flash_attention"):
        run.notes.append(f"model.attn_implementation {attention} planned as sdpa (the same memory: no stored scores)")
        attention = "sdpa"
    s["attention"] = attention
    optim = model.get("optim", MODULE_DEFAULTS["optim"])
    if optim in ONE_STATE_OPTIMIZERS:
        run.notes.append(f"model.optim {optim} planned as sgd (one fp32 state per parameter, as SGD's momentum)")
    s["optimizer"] = "sgd" if optim in ONE_STATE_OPTIMIZERS else OPTIMIZERS.get(optim, optim)
    for key in ("loss_chunking", "loss_chunk_tokens"):
        if key in model:
            s[key] = model[key]
    s["mlp_tile_tokens"] = model.get("mlp_tile_tokens") or 0
    _stage_and_kernels(model, run)
    mapped = {"model", "config_overrides", "gradient_checkpointing", "attn_implementation", "optim", "lora"}
    mapped |= {"quantization", "loss_chunking", "loss_chunk_tokens", "mlp_tile_tokens", "objective", "compile"}
    mapped |= {"fused_ops"}
    if ignored := sorted(set(model) - mapped - NO_MEMORY_MODEL_KEYS):
        run.notes.append(f"not planned: model.{', model.'.join(ignored)} (the planner does not model them)")


def _stage_and_kernels(model: Mapping[str, Any], run: RunSettings) -> None:
    """``model.objective`` as the stage (a name, ``{name: ...}`` or a class with ``init_args``) with the reference
    settings it holds (:data:`OBJECTIVE_SETTINGS`), and the kernel path ``model.compile`` / ``model.fused_ops``
    pick (the module's rule: fused ops follow compile unless given)."""
    objective, settings = model.get("objective") or "sft", {}
    if isinstance(objective, Mapping):
        settings = dict(objective.get("init_args") or {}) if "class_path" in objective else dict(objective)
        objective = objective.get("name") or str(objective.get("class_path", "")).rsplit(".", 1)[-1].lower()
    if objective not in STAGES:
        run.problems.append(f"model.objective {objective!r} is not planned: give one of {', '.join(STAGES)}")
    run.settings["stage"] = objective
    run.settings.update({leaf: settings[key] for key, leaf in OBJECTIVE_SETTINGS.items() if key in settings})
    fused = model.get("fused_ops")
    liger = isinstance(fused, Mapping) and fused.get("kernels") == "liger"
    if liger:
        run.settings["kernels"] = "liger"
    elif model.get("compile") or fused is True or isinstance(fused, Mapping):
        run.settings["kernels"] = "compiled"


def _lora_settings(lora: Any, run: RunSettings) -> None:
    if lora is None:
        run.settings["lora_r"] = 0
        return
    if not isinstance(lora, Mapping):
        run.problems.append(
            f"model.lora must be a mapping (r, alpha, dropout, target_modules, target_parameters), got {lora!r}"
        )
        return
    run.settings["lora_r"] = lora.get("r", MODULE_DEFAULTS["lora_r"])
    targets, parameters = lora.get("target_modules"), _target_parameters(lora.get("target_parameters"), run)
    if parameters:
        run.settings["lora_target_parameters"] = parameters
        if targets is None:  # the experts alone (lora.resolved_targets: peft's default targets are not added)
            run.settings["lora_targets"] = "none"
            return
    # None is peft's default for Llama/Qwen: q_proj and v_proj.
    if targets is None or sorted(targets) == ["q_proj", "v_proj"]:
        run.settings["lora_targets"] = "attention-qv"
        return
    if list(targets) != ["all-linear"]:
        run.notes.append(f"model.lora.target_modules {list(targets)} planned as all-linear (an upper bound)")
    run.settings["lora_targets"] = "all-linear"


def _target_parameters(value: Any, run: RunSettings) -> list[str]:
    """``model.lora.target_parameters`` as a list of names (one name alone as a list of it); anything else is a
    problem (the names themselves are checked by ``plan``, against the model)."""
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        run.problems.append(
            "model.lora.target_parameters must be a list of parameter names (e.g. [experts.gate_up_proj, "
            f"experts.down_proj]) or [all-experts], got {value!r}"
        )
        return []
    return [n.strip() for n in names]


def _quantization_settings(quantization: Any, run: RunSettings) -> None:
    if quantization is None:
        run.settings["quantization"] = "none"
        return
    quant_type = quantization.get("quant_type", "nf4") if isinstance(quantization, Mapping) else quantization
    if quant_type not in ("nf4", "fp4"):
        run.problems.append(f"model.quantization.quant_type must be nf4 or fp4, got {quant_type!r}")
        return
    if quant_type == "fp4":
        run.notes.append("model.quantization fp4 planned as nf4 (the same 4-bit storage)")
    run.settings["quantization"] = "nf4"
    skipped = quantization.get("skip_modules", ["lm_head"]) if isinstance(quantization, Mapping) else ["lm_head"]
    if not isinstance(skipped, list) or not all(isinstance(n, str) for n in skipped):
        run.problems.append(f"model.quantization.skip_modules must be a list of module names, got {skipped!r}")
        return
    run.settings["quantization_skip_modules"] = list(skipped)
    # Only the expert weights it names are planned (planner.experts.skipped_expert_weights): experts, down_proj, ...
    experts = {n for n in skipped if n.rsplit(".", 1)[-1] in ("experts", "gate_up_proj", "down_proj")}
    if others := [n for n in skipped if n not in experts and n != "lm_head"]:
        run.notes.append(f"model.quantization.skip_modules {others} not planned (those layers planned in NF4)")


def _trainer_settings(trainer: Mapping[str, Any], run: RunSettings) -> None:
    precision = str(trainer.get("precision", "32-true"))
    if precision in ("16", "16-mixed"):
        run.notes.append(f"trainer.precision {precision} planned as bf16-mixed (the same bytes)")
        precision = "bf16-mixed"
    if precision not in PRECISIONS:
        run.problems.append(f"trainer.precision {precision} is not planned (32-true, bf16-mixed or 16-mixed)")
    run.settings["precision"] = PRECISIONS.get(precision, precision)
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if str(devices).isdigit() and int(devices) > 0:
        run.settings["gpus_per_node"] = int(devices)
    elif str(devices) not in ("auto", "-1"):
        run.problems.append(f"trainer.devices must be a count, a list of devices or auto, got {devices!r}")
    else:
        default = field_default("gpus_per_node")
        run.notes.append(f"trainer.devices {devices}: planned for --gpus_per_node ({default} unless given)")
    run.settings["nodes"] = nodes
    run.settings["accumulate_grad_batches"] = trainer.get("accumulate_grad_batches", 1)
    if str(trainer.get("accelerator", "auto")) == "cpu":
        run.settings["accelerator"] = "cpu"


def _strategy_settings(strategy: Any, run: RunSettings) -> None:
    """The run's strategy as the planner's :class:`Strategy`, with its sequence-parallel size and checkpointing."""
    if strategy is None or strategy in ("auto", AUTO_STRATEGY):  # gym_auto: the plan's recommendation is the choice
        return
    if isinstance(strategy, str):
        if strategy not in STRATEGY_PRESET_BY_NAME:
            run.problems.append(
                f"trainer.strategy {strategy!r} is not planned: give one of {', '.join(STRATEGY_NAMES)}"
            )
        run.settings["strategy"] = strategy
        return
    class_path = strategy.get("class_path", "") if isinstance(strategy, Mapping) else ""
    family = strategy_class_of(class_path)
    if family is None and class_path.rsplit(".", 1)[-1] in FIXED_STAGES:
        family = "zero"
    if family is None:
        classes = "GymDDPStrategy, GymFSDPStrategy, ZeROStrategy (ZeRO1/2/3Strategy)"
        run.problems.append(f"trainer.strategy must be a name or a class_path of {classes}, got {strategy!r}")
        return
    init_args = dict(strategy.get("init_args") or {})
    if stage := FIXED_STAGES.get(class_path.rsplit(".", 1)[-1]):
        init_args["stage"] = stage
    run.settings["strategy"] = _class_strategy(family, init_args, run)
    run.settings.update({leaf: init_args[arg] for arg, leaf in KNOB_ARGS.items() if arg in init_args})
    if family == "zero" and init_args.get("config") is not None:
        run.settings.update(_json_knobs(init_args["config"], run))
    if init_args.get("activation_checkpointing"):
        run.settings["activation_checkpointing"] = True
    if ignored := sorted(set(init_args) - set(MEMORY_ARGS[family]) - NO_MEMORY_ARGS):
        run.notes.append(f"not planned: trainer.strategy.init_args {', '.join(ignored)} (not in the planner's model)")


def _class_strategy(family: StrategyClass, init_args: dict[str, Any], run: RunSettings) -> Strategy | None:
    """The planner's row for a strategy class and its arguments (ZeRO's stage and offload from its JSON if need be)."""
    if family == "zero" and init_args.get("stage") is None:
        init_args.update(_zero_json_layout(init_args.get("config"), run))
    memory = {key: init_args[key] for key in MEMORY_ARGS[family] if key in init_args}
    problems = _layout_problems(memory)
    if problems:
        run.problems += problems
        return None
    strategy = planner_strategy("run", "", family, memory)
    return replace(strategy, label=strategy.trainer_strategy)


def _zero_json_layout(config: Any, run: RunSettings) -> dict[str, Any]:
    """ZeRO's stage and offload devices from the DeepSpeed JSON of ``init_args.config`` (a path or a mapping)."""
    try:
        data = config if isinstance(config, Mapping) else json.loads(Path(str(config)).read_text())
        zero = data["zero_optimization"]
        return {
            "stage": zero["stage"],
            "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none"),
            "offload_parameters": (zero.get("offload_param") or {}).get("device", "none"),
        }
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        run.problems.append(f"trainer.strategy needs init_args.stage, or a DeepSpeed JSON config with one: {config!r}")
        return {}


def _json_knobs(config: Any, run: RunSettings) -> dict[str, Any]:
    """The spec's knobs a DeepSpeed JSON states (``JSON_KNOBS``; ``auto`` is gym's rule, left to it); a
    ``leaf_module`` of the user's own replaces gym's decoder-layer leaves (``leaf.mark_decoder_leaf_modules``)."""
    try:
        data = config if isinstance(config, Mapping) else json.loads(Path(str(config)).read_text())
        zero = dict(data.get("zero_optimization") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return {}  # an unreadable JSON is named by _zero_json_layout when its stage is needed
    knobs = {leaf: zero[key] for key, leaf in JSON_KNOBS.items() if key in zero and zero[key] != "auto"}
    if "leaf_module" in zero:
        knobs["zero3_leaf_layers"] = False
    for leaf, value in knobs.items():
        if leaf != "zero3_leaf_layers" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            run.problems.append(f"the DeepSpeed JSON's {leaf} must be a number of elements, got {value!r}")
    return {k: int(v) if isinstance(v, float) else v for k, v in knobs.items()}


def _layout_problems(memory: Mapping[str, Any]) -> list[str]:
    choices = {
        "stage": (0, 1, 2, 3),
        "offload_optimizer": ("none", "cpu", "nvme"),
        "offload_parameters": ("none", "cpu", "nvme"),
        "sharding": ("full", "grad_op", "hybrid", "none"),
        "cpu_offload": (True, False),
    }
    return [
        f"trainer.strategy.init_args.{key} must be one of {', '.join(map(str, choices[key]))}, got {value!r}"
        for key, value in memory.items()
        if value not in choices[key] or isinstance(value, bool) != isinstance(choices[key][0], bool)
    ]


__all__ = ["RunSettings", "run_settings"]
