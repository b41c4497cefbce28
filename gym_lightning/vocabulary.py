"""The names a run's settings go by, held once as plain data (no torch, no Lightning: the planner reads them too).

- :data:`STRATEGY_PRESETS`: every strategy name gym_lightning registers with Lightning (``Trainer(strategy="zero3")``),
  with its class and the init args it stands for. The strategies register from it
  (``register_strategies``), ``gym_lightning.strategies.STRATEGY_NAMES`` is its names, the planner's strategy list
  (``planner.estimate.STRATEGIES``) is built from it, and tests check the table in ``gym_lightning.strategies``'
  docstring against it.
- :data:`HF_SETTINGS`: the ``gym fit`` settings that Hugging Face users know by another name, with the ``gym train``
  flag (HF ``TrainingArguments``) and the DeepSpeed JSON keys that mean the same thing. ``strategies.zero.hf_auto``
  names the settings behind a DeepSpeed key from it (:data:`DEEPSPEED_SETTINGS`), ``commands.train`` the flags
  behind a setting (:data:`SETTING_FLAGS`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

StrategyClass = Literal["ddp", "fsdp", "zero"]

# Swap folder of the registered "zero_infinity" name. For a fast local disk, pass the strategy as a class with
# ``nvme_path`` instead (YAML: ``class_path: gym_lightning.strategies.ZeROStrategy`` + ``init_args.nvme_path``).
DEFAULT_NVME_PATH = os.path.join(tempfile.gettempdir(), "gym_lightning_nvme")

# A tensor of at most this many x hidden_size elements stays whole on every rank under ZeRO-3 (the Hugging Face
# integration's ``"auto"`` rule, 10 x hidden): every norm weight, bias and per-head norm of a decoder layer (hidden or
# fewer elements), never a projection matrix (at least hidden x head_dim >= 64 x hidden elements). A persisted tensor
# is never gathered (no all-gather, no wait); it costs its whole size on every rank (DeepSpeed keeps it whole next to
# its partition: ``partition_parameters.py``, ``ds_persist``), which for vectors is under 0.01 % of the model. Here
# because ``strategies.zero.rule`` sets it and the planner, a layer below the strategies, models it.
ZERO3_PERSIST_WIDTHS = 10
# The class of each strategy family, by the key the presets use: its public path and the name it is shown by.
STRATEGY_CLASSES: dict[StrategyClass, str] = {
    "ddp": "gym_lightning.strategies.GymDDPStrategy",
    "fsdp": "gym_lightning.strategies.GymFSDPStrategy",
    "zero": "gym_lightning.strategies.ZeROStrategy",
}


@dataclass(frozen=True)
class StrategyPreset:
    """One registered strategy name.

    Args:
        name: The name ``Trainer(strategy=...)`` and YAML's ``trainer.strategy`` take.
        strategy_class: The family (a key of :data:`STRATEGY_CLASSES`).
        description: One line, as Lightning's ``StrategyRegistry`` lists it.
        init_args: The constructor arguments the name stands for (the rest at their defaults).
    """

    name: str
    strategy_class: StrategyClass
    description: str
    init_args: Mapping[str, Any] = field(default_factory=dict)


STRATEGY_PRESETS: tuple[StrategyPreset, ...] = (
    StrategyPreset("gym_ddp", "ddp", "gym_lightning DDP (CPU and CUDA, optional gradient compression)"),
    StrategyPreset("gym_fsdp", "fsdp", "gym_lightning FSDP2, one shard unit per decoder layer"),
    StrategyPreset("zero1", "zero", "ZeRO-1: shard optimizer state", {"stage": 1}),
    StrategyPreset("zero2", "zero", "ZeRO-2: shard optimizer state and gradients", {"stage": 2}),
    StrategyPreset("zero3", "zero", "ZeRO-3: shard optimizer state, gradients and parameters", {"stage": 3}),
    StrategyPreset(
        "zero2_offload", "zero", "ZeRO-2 with optimizer offload to CPU", {"stage": 2, "offload_optimizer": "cpu"}
    ),
    StrategyPreset(
        "zero3_offload",
        "zero",
        "ZeRO-3 with optimizer and parameter offload to CPU",
        {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"},
    ),
    StrategyPreset(
        "zero_infinity",
        "zero",
        f"ZeRO-3 with optimizer and parameter offload to NVMe under {DEFAULT_NVME_PATH}",
        {"stage": 3, "offload_optimizer": "nvme", "offload_parameters": "nvme", "nvme_path": DEFAULT_NVME_PATH},
    ),
)
STRATEGY_NAMES: tuple[str, ...] = tuple(preset.name for preset in STRATEGY_PRESETS)
# ``trainer.strategy: gym_auto`` (YAML, ``gym train --strategy``): the planner picks the fastest of the names above
# that fits the run's model, batch and hardware (``planner.auto``), before the Trainer exists. Not Lightning's "auto",
# which stays the Trainer's own default.
AUTO_STRATEGY = "gym_auto"
STRATEGY_PRESET_BY_NAME: dict[str, StrategyPreset] = {preset.name: preset for preset in STRATEGY_PRESETS}


def register_presets(register: Callable[..., Any], cls: type, strategy_class: StrategyClass) -> None:
    """Register every preset of ``strategy_class`` as ``cls`` through ``register`` (``StrategyRegistry.register``)."""
    for preset in STRATEGY_PRESETS:
        if preset.strategy_class == strategy_class:
            register(preset.name, cls, description=preset.description, override=True, **preset.init_args)


def strategy_class_of(class_path: str) -> StrategyClass | None:
    """The family of a YAML ``class_path`` (the public path, a module path or the bare class name), else ``None``."""
    last = class_path.rsplit(".", 1)[-1]
    for key, path in STRATEGY_CLASSES.items():
        if last == path.rsplit(".", 1)[-1]:
            return key
    return None


@dataclass(frozen=True)
class HFSetting:
    """One ``gym fit`` setting by its other names.

    Args:
        setting: The ``gym fit`` name (``data.batch_size``), as messages name it.
        flag: The ``gym train`` flag(s) that set it (HF ``TrainingArguments``), as messages name them.
        deepspeed_keys: The DeepSpeed JSON keys whose ``"auto"`` it resolves (``strategies.zero.hf_auto``).
    """

    setting: str
    flag: str
    deepspeed_keys: tuple[str, ...] = ()


HF_SETTINGS: tuple[HFSetting, ...] = (
    HFSetting("data.batch_size", "--per_device_train_batch_size", ("train_micro_batch_size_per_gpu",)),
    HFSetting("trainer.accumulate_grad_batches", "--gradient_accumulation_steps", ("gradient_accumulation_steps",)),
    HFSetting("trainer.gradient_clip_val", "--max_grad_norm", ("gradient_clipping",)),
    HFSetting("trainer.precision", "--bf16/--fp16", ("fp16.enabled", "bf16.enabled")),
    HFSetting("trainer.max_steps", "--max_steps"),
    HFSetting("trainer.max_epochs", "--num_train_epochs"),
    HFSetting("trainer.devices", "--devices"),
    HFSetting("trainer.num_nodes", "--num_nodes"),
    HFSetting("model.lr", "--learning_rate", ("optimizer.params.lr", "scheduler.params.warmup_max_lr")),
    HFSetting("model.betas", "--adam_beta1/--adam_beta2", ("optimizer.params.betas",)),
    HFSetting("model.eps", "--adam_epsilon", ("optimizer.params.eps",)),
    HFSetting("model.weight_decay", "--weight_decay", ("optimizer.params.weight_decay",)),
    HFSetting("model.warmup_steps", "--warmup_steps"),
    HFSetting("model.warmup_ratio", "--warmup_steps"),
    HFSetting("model.optim", "--optim"),
    HFSetting("model.hf_scheduler", "--lr_scheduler_type"),
    HFSetting("model.scheduler_kwargs", "--lr_scheduler_kwargs"),
)
# The `gym fit` settings that errors name -> the `gym train` flags that set them.
SETTING_FLAGS: dict[str, str] = {row.setting: row.flag for row in HF_SETTINGS}
# DeepSpeed JSON key -> the settings it mirrors, as messages name them (`gym train` adds its flags to these names):
# one setting each, or a phrase made of several where the key is derived from them.
DEEPSPEED_SETTINGS: dict[str, str] = {
    **{key: row.setting for row in HF_SETTINGS for key in row.deepspeed_keys},
    "train_batch_size": "world size (trainer.devices x trainer.num_nodes) x data.batch_size x "
    "trainer.accumulate_grad_batches",
    "scheduler.params.warmup_num_steps": "model.warmup_steps/model.warmup_ratio",
    "scheduler.params.total_num_steps": "the Trainer's optimizer steps (trainer.max_steps, or trainer.max_epochs x "
    "batches / accumulation)",
}

__all__ = [
    "DEEPSPEED_SETTINGS",
    "DEFAULT_NVME_PATH",
    "HF_SETTINGS",
    "SETTING_FLAGS",
    "STRATEGY_CLASSES",
    "STRATEGY_NAMES",
    "STRATEGY_PRESETS",
    "STRATEGY_PRESET_BY_NAME",
    "ZERO3_PERSIST_WIDTHS",
    "HFSetting",
    "StrategyClass",
    "StrategyPreset",
    "register_presets",
    "strategy_class_of",
]
