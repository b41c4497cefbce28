"""Private Lightning (and torchmetrics, Lightning's metric library) members: the declared inventory and the functions
through which the package reaches them (``gym_lightning._compat`` says why)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

# Strategy classes register their names through this registry type (Lightning's ``register_strategies`` hook).
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import Metric

# Upstream class -> private members that gym_lightning's subclasses override (same name) or call through super().
PRIVATE_OVERRIDES: dict[type, tuple[str, ...]] = {
    DeepSpeedStrategy: (
        "_format_batch_size_and_grad_accum_config",
        "_init_optimizers",
        "_setup_model_and_optimizer",
        "_initialize_deepspeed_inference",
    ),
    ModelCheckpoint: ("_save_checkpoint", "_link_checkpoint", "_remove_checkpoint"),
    ModelParallelStrategy: ("_get_process_group_backend",),
}

# Upstream class -> private members called, read or written through the functions below.
PRIVATE_MEMBERS: dict[type, tuple[str, ...]] = {
    DeepSpeedStrategy: ("_init_deepspeed_distributed", "_init_config_if_needed"),
    ModelParallelStrategy: ("_data_parallel_size", "_tensor_parallel_size"),
    ModelCheckpoint: (
        "_last_global_step_saved",
        "_last_checkpoint_saved",
        "_should_skip_saving_checkpoint",
        "_monitor_candidates",
        "_save_topk_checkpoint",
        "_save_last_checkpoint",
    ),
    _FitLoop: ("_load_combined_loader_states", "_data_source"),
    # Timed (never changed) by benchmarks/workers/probe.py through per_batch_lightning_calls().
    _TrainingEpochLoop: ("_broadcast_sigterm_tensor",),
    pl.Trainer: ("_logger_connector",),
    LightningOptimizer: ("_optimizer",),
    Metric: ("_defaults", "_apply"),
}

# Private modules and names imported here: (module, name).
PRIVATE_IMPORTS: tuple[tuple[str, str], ...] = (
    ("lightning.fabric.strategies.registry", "_StrategyRegistry"),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_Metadata"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_Sync"),
    ("lightning.fabric.plugins.precision.amp", "_optimizer_handles_unscaling"),
)


# ---------------------------------------------------------------------------------------- self.log's device walk
def skip_same_device_result_moves() -> None:
    """Make every ``self.log`` of a tensor skip a walk that moves nothing (process-wide, idempotent).

    Applied by ``gym_lightning.patches`` only where :func:`result_moves_walk_when_nothing_moves` finds it needed.
    Lightning's ``_ResultCollection.log`` calls ``_ResultMetric.to(value.device)`` for every logged value at every
    step, and that ``to`` rebuilds the metric's whole ``__dict__`` with ``apply_to_collection`` (deep copies of its
    metadata included) even when every tensor in it is on that device already: most of what one ``self.log`` call
    costs (docs/benchmarks-history.md, "Lightning's self.log device walk"). Lightning issue #20388; the upstream
    fix (pull request #21769) is not released. The wrapper returns early only when the walk would move nothing: one
    device argument, no keyword, and every tensor the metric holds already on that device (a metric held in it, a
    dtype or another device take Lightning's own path).
    """
    if result_moves_patched():
        return
    move = _ResultMetric.to

    @functools.wraps(move)
    def to(self: _ResultMetric, *args: Any, **kwargs: Any) -> _ResultMetric:
        one_device = not kwargs and len(args) == 1 and isinstance(args[0], str | torch.device)
        if one_device and _all_tensors_on(vars(self), torch.device(args[0])):
            return self
        return move(self, *args, **kwargs)

    to._gym_same_device_skip = True  # type: ignore[attr-defined]
    _ResultMetric.to = to  # type: ignore[method-assign]


def result_moves_patched() -> bool:
    """Whether :func:`skip_same_device_result_moves` has been applied in this process."""
    return getattr(_ResultMetric.to, "_gym_same_device_skip", False)


def logged_result_metric(value: torch.Tensor) -> _ResultMetric:
    """A ``_ResultMetric`` holding ``value`` as ``self.log("train/loss", value)`` in ``training_step`` makes it."""
    meta = _Metadata("training_step", "train/loss", prog_bar=True, on_step=True, on_epoch=False)
    meta.sync = _Sync()
    metric = _ResultMetric(meta, is_tensor=True)
    metric.update(value, 1)
    return metric


def result_moves_walk_when_nothing_moves() -> bool:
    """The probe of :func:`skip_same_device_result_moves`: whether Lightning's own ``_ResultMetric.to`` (this
    process's, unpatched) still rebuilds a logged value's metadata when every tensor is on the target device."""
    move = getattr(_ResultMetric.to, "__wrapped__", _ResultMetric.to)
    metric = logged_result_metric(torch.tensor(0.0))
    meta = metric.meta
    move(metric, torch.device("cpu"))
    return metric.meta is not meta


def _all_tensors_on(value: Any, device: torch.device) -> bool:
    """Whether every tensor in ``value`` (through dicts, lists, tuples and dataclass fields) is on ``device``; False
    at any ``torchmetrics.Metric`` inside (``apply_to_collection`` would move it)."""
    if isinstance(value, torch.Tensor):
        return value.device == device
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, list | tuple):
        items = value
    elif value is None or isinstance(value, str | int | float):  # most of a metric's state: skip the checks below
        return True
    elif isinstance(value, Metric):
        return False
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # as apply_to_collection reads them
        items = (getattr(value, field.name) for field in dataclasses.fields(value))
    else:
        return True
    return all(_all_tensors_on(item, device) for item in items)


# --------------------------------------------------------------------------------------------- loops and trainer
def per_batch_lightning_calls(trainer: pl.Trainer) -> list[tuple[Any, str, str]]:
    """``(owner, method name, label)`` of what Lightning's training loop runs on every batch that a plain loop does
    not: the SIGTERM flag broadcast (a blocking collective + host read), the scheduler update, the logger
    connector. benchmarks/workers/probe.py wraps these on the given trainer's own objects to time them."""
    loop, connector = trainer.fit_loop.epoch_loop, trainer._logger_connector
    calls = [(loop, "_broadcast_sigterm_tensor", "sigterm"), (loop, "update_lr_schedulers", "lr_schedulers")]
    return calls + [
        (connector, hook, "logger") for hook in ("on_batch_start", "on_batch_end", "update_train_step_metrics")
    ]


def load_combined_loader_states(trainer: pl.Trainer) -> None:
    """Run the fit loop's own (private, Lightning 2.6) step that hands saved DataLoader states to the loaders.

    It checks ``restarting`` and clears the pending states itself, so calling it again is a no-op. If a Lightning
    upgrade removes it, say so: mid-epoch resume would otherwise silently restart the interrupted epoch.
    """
    restore = getattr(trainer.fit_loop, "_load_combined_loader_states", None)
    if restore is None:
        rank_zero_warn(
            "This Lightning version has no FitLoop._load_combined_loader_states: a run resumed mid-epoch restarts "
            "the interrupted epoch from its first batch. Pin lightning<2.7 for exact resume."
        )
        return
    restore()


def training_dataloader(trainer: pl.Trainer) -> Any | None:
    """The training DataLoader as the fit loop will build it (from the module or data module), or ``None`` when
    neither defines one. Lightning keeps this source private (``_FitLoop._data_source``, Lightning 2.6)."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None


def optimizer_unscales_itself(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer a ``LightningOptimizer`` wraps) unscales a ``GradScaler``'s gradients
    inside its own ``step`` (torch's fused optimizers); Lightning's test for it is private."""
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    return _optimizer_handles_unscaling(optimizer)


def wrapped_optimizer(optimizer: Any) -> Any | None:
    """The optimizer inside ``optimizer``: DeepSpeed's ``.optimizer`` or Lightning's ``LightningOptimizer``'s."""
    return getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)


# ---------------------------------------------------------------------------------------------------- strategies
def init_deepspeed_distributed(strategy: DeepSpeedStrategy) -> None:
    """Lightning's start of DeepSpeed's process group (``deepspeed.init_distributed`` with Lightning's settings)."""
    strategy._init_deepspeed_distributed()


def init_deepspeed_config_if_needed(strategy: DeepSpeedStrategy) -> None:
    """Lightning's one-time completion of the DeepSpeed config (batch size, precision) before the model is built."""
    strategy._init_config_if_needed()


def set_model_parallel_sizes(strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int) -> None:
    """The (data, tensor) parallel sizes ``ModelParallelStrategy`` builds its device mesh and sampler from."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


# --------------------------------------------------------------------------------------------------- checkpoints
def record_checkpoint_saved(callback: ModelCheckpoint, global_step: int, filepath: str) -> None:
    """What ``ModelCheckpoint._save_checkpoint`` records after a save: its skip logic and ``last`` link read it."""
    callback._last_global_step_saved = global_step
    callback._last_checkpoint_saved = filepath


def save_topk_and_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> None:
    """``ModelCheckpoint``'s own save (top-k, then ``last``), unless it would skip now (e.g. this step is saved)."""
    if callback._should_skip_saving_checkpoint(trainer):
        return
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


# --------------------------------------------------------------------------------------------------- torchmetrics
def apply_to_metric(metric: Metric, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``fn`` applied to every tensor of ``metric``: its states, the defaults ``reset()`` restores, cached results,
    and the device and dtype it reports. torchmetrics does this in its private ``_apply``, which ``Module.to``
    reaches, but only for device moves and ``set_dtype`` (which would also cast integer states)."""
    metric._apply(fn)


def metric_state_defaults(metric: Metric) -> dict[str, Any]:
    """The values ``metric.reset()`` restores, by state name (torchmetrics keeps them in ``_defaults``)."""
    return metric._defaults


__all__ = [
    "PRIVATE_IMPORTS",
    "PRIVATE_MEMBERS",
    "PRIVATE_OVERRIDES",
    "_FitLoop",
    "_StrategyRegistry",
    "_all_tensors_on",
    "apply_to_metric",
    "init_deepspeed_config_if_needed",
    "init_deepspeed_distributed",
    "load_combined_loader_states",
    "logged_result_metric",
    "metric_state_defaults",
    "optimizer_unscales_itself",
    "per_batch_lightning_calls",
    "rank_zero_info",
    "rank_zero_warn",
    "record_checkpoint_saved",
    "result_moves_patched",
    "result_moves_walk_when_nothing_moves",
    "save_topk_and_last_checkpoint",
    "set_model_parallel_sizes",
    "skip_same_device_result_moves",
    "training_dataloader",
    "wrapped_optimizer",
]
