"""The one place where gym_lightning touches private (``_``-prefixed or undocumented) Lightning, DeepSpeed and torch
members.

None of these libraries promises to keep such members stable; keeping every use here means one file to fix on an
upgrade, and tests/test_compat.py checks that each member declared below still exists in the installed versions.

* :data:`PRIVATE_OVERRIDES`: private Lightning methods our subclasses override (they must keep the upstream name)
  or call through ``super()``. tests/test_compat.py also fails when a subclass overrides or touches any other
  upstream private member without it being listed here.
* :data:`PRIVATE_MEMBERS`, :data:`DEEPSPEED_MEMBERS`, :data:`DEEPSPEED_MEMORY_ATTRIBUTES`: private members that the
  package calls, reads or writes, only through the functions of this module.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

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
from torch import nn

# FSDP2-compatible activation checkpointing that keeps parameter names unchanged (unlike checkpoint_wrapper, which
# inserts ``_checkpoint_wrapped_module`` into every key); torchtitan and torch's own FSDP2 tests use it.
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle
from torchmetrics import Metric

try:  # public since torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor

# ------------------------------------------------------------------------------------------- declared inventory
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
    nn.Module: ("_forward_pre_hooks", "_forward_hooks"),
    RemovableHandle: ("hooks_dict_ref",),
    Metric: ("_defaults", "_apply"),
    DistributedDataParallel: ("_get_ddp_logging_data",),
}

# Private modules and names imported above: (module, name).
PRIVATE_IMPORTS: tuple[tuple[str, str], ...] = (
    ("lightning.fabric.strategies.registry", "_StrategyRegistry"),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_Metadata"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_Sync"),
    ("torch.distributed._composable", "checkpoint"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    ("lightning.fabric.plugins.precision.amp", "_optimizer_handles_unscaling"),
)


class DeepSpeedMember(NamedTuple):
    """A DeepSpeed member we rely on: ``owner`` is the dotted path of the class (or module) that defines or
    assigns it; DeepSpeed is imported lazily, so the owner is named, not imported, here."""

    owner: str
    name: str


_STAGE_1_2 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_STAGE_3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_OFFLOAD = "deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload"
_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator"

# Engine configuration and ZeRO-3's module hooks (strategies/zero/trace.py, checkpointing/safe_load.py).
DEEPSPEED_MEMBERS: tuple[DeepSpeedMember, ...] = (
    DeepSpeedMember("deepspeed.runtime.engine.DeepSpeedEngine", "_config"),
    # Read by the engine's load_checkpoint (checkpoint.load_universal of the JSON); set per load
    # (strategies/zero/universal.py).
    DeepSpeedMember("deepspeed.runtime.config.DeepSpeedConfig", "load_universal_checkpoint"),
    DeepSpeedMember(_STAGE_3, "parameter_offload"),
    DeepSpeedMember(_OFFLOAD, "forward_hooks"),
    DeepSpeedMember(_OFFLOAD, "backward_hooks"),
    DeepSpeedMember(_COORDINATOR, "trace_prologue"),
    # The full shape of a partitioned ZeRO-3 parameter (whose .data is empty), read by the exporter.
    DeepSpeedMember("deepspeed.runtime.zero.partition_parameters", "ds_shape"),
    # Where a ZeRO-3 parameter's partition lies in its flattened tensor (strategies/zero/stage3.Partitions):
    # partition i of a parameter's process group holds elements i * ds_tensor.ds_numel onwards, up to ds_numel.
    DeepSpeedMember("deepspeed.runtime.zero.partition_parameters", "ds_numel"),
    DeepSpeedMember("deepspeed.runtime.zero.partition_parameters", "ds_process_group"),
    # The ops loaded in this process, filled from the machine-wide op cache (strategies/zero/ops.py), and the JIT
    # build that cache stands in front of for one load.
    DeepSpeedMember("deepspeed.ops.op_builder.builder.OpBuilder", "_loaded_ops"),
    DeepSpeedMember("deepspeed.ops.op_builder.builder.OpBuilder", "jit_load"),
)

# What metrics/memory.py reads to count the bytes a rank holds (see its docstring for what each one is).
DEEPSPEED_MEMORY_ATTRIBUTES: tuple[DeepSpeedMember, ...] = (
    DeepSpeedMember(_STAGE_1_2, "single_partition_of_fp32_groups"),
    DeepSpeedMember(_STAGE_1_2, "all_grad_tensors"),
    DeepSpeedMember(_STAGE_1_2, "averaged_gradients"),
    DeepSpeedMember(_STAGE_1_2, "grads_in_partition"),
    DeepSpeedMember(_STAGE_1_2, "accumulated_grads_in_cpu"),
    DeepSpeedMember(_STAGE_1_2, "ipg_buckets"),
    DeepSpeedMember(_STAGE_1_2, "grad_accum"),  # set on each parameter by the ZeRO-1/2 optimizer
    DeepSpeedMember(_STAGE_3, "fp32_partitioned_groups_flat"),
    DeepSpeedMember(_STAGE_3, "param_groups_fp16_flat_cpu_memory"),
    DeepSpeedMember(_STAGE_3, "averaged_gradients"),
    DeepSpeedMember(_STAGE_3, "grad_partitions_flat_buffer"),
    DeepSpeedMember(_STAGE_3, "ipg_buckets"),
    DeepSpeedMember("deepspeed.runtime.zero.partition_parameters", "ds_tensor"),  # set on each ZeRO-3 parameter
    DeepSpeedMember("deepspeed.runtime.zero.stage_1_and_2.IPGBucket", "buffer"),
    DeepSpeedMember("deepspeed.runtime.zero.stage3.IPGBucketZ3", "buffer"),
)
_MEMORY_NAMES = frozenset(member.name for member in DEEPSPEED_MEMORY_ATTRIBUTES)
# Attributes a ZeRO optimizer itself carries (not its parameters or buckets): at least one must be there.
ZERO_OPTIMIZER_MEMORY_ATTRIBUTES: tuple[str, ...] = tuple(
    dict.fromkeys(
        m.name for m in DEEPSPEED_MEMORY_ATTRIBUTES if m.owner in (_STAGE_1_2, _STAGE_3) and m.name != "grad_accum"
    )
)


# ------------------------------------------------------------------------------------------------------ Lightning
def skip_same_device_result_moves() -> None:
    """Make every ``self.log`` of a tensor skip a walk that moves nothing (process-wide, idempotent).

    Applied by ``gym_lightning.patches`` only where :func:`result_moves_walk_when_nothing_moves` finds it needed.
    Lightning's ``_ResultCollection.log`` calls ``_ResultMetric.to(value.device)`` for every logged value at every
    step, and that ``to`` rebuilds the metric's whole ``__dict__`` with ``apply_to_collection`` (deep copies of its
    metadata included) even when every tensor in it is on that device already: 0.4 of the 0.55 ms that one
    ``self.log`` call cost on this 2-core CPU (cProfile of 300 calls, lightning 2.6.6, 1 Dec 2026), i.e. ~1 % of the
    45 ms step at which the benchmarks compare ``Trainer.fit`` with a plain loop (docs/benchmarks.md, section 1).
    Lightning issue #20388; the upstream fix (pull request #21769) is not released. The wrapper returns early only
    when the walk would move nothing: one device argument, no keyword, and every tensor the metric holds already on
    that device (a metric held in it, a dtype or another device take Lightning's own path).
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


def set_collective_timeout(timeout: timedelta, group: Any = None) -> None:
    """The timeout of a process group's collectives from now on (every backend of it, gloo and NCCL), separate
    from the rendezvous timeout it was created with; torch keeps this private (``_set_pg_timeout``, torch 2.3+)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def optimizer_unscales_itself(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer a ``LightningOptimizer`` wraps) unscales a ``GradScaler``'s gradients
    inside its own ``step`` (torch's fused optimizers); Lightning's test for it is private."""
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    return _optimizer_handles_unscaling(optimizer)


def init_deepspeed_distributed(strategy: DeepSpeedStrategy) -> None:
    """Lightning's start of DeepSpeed's process group (``deepspeed.init_distributed`` with Lightning's settings)."""
    strategy._init_deepspeed_distributed()


def training_dataloader(trainer: pl.Trainer) -> Any | None:
    """The training DataLoader as the fit loop will build it (from the module or data module), or ``None`` when
    neither defines one. Lightning keeps this source private (``_FitLoop._data_source``, Lightning 2.6)."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None


def init_deepspeed_config_if_needed(strategy: DeepSpeedStrategy) -> None:
    """Lightning's one-time completion of the DeepSpeed config (batch size, precision) before the model is built."""
    strategy._init_config_if_needed()


def set_model_parallel_sizes(strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int) -> None:
    """The (data, tensor) parallel sizes ``ModelParallelStrategy`` builds its device mesh and sampler from."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


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


def wrapped_optimizer(optimizer: Any) -> Any | None:
    """The optimizer inside ``optimizer``: DeepSpeed's ``.optimizer`` or Lightning's ``LightningOptimizer``'s."""
    return getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)


# ---------------------------------------------------------------------------------------------------------- torch
def ddp_bucket_sizes(module: DistributedDataParallel) -> list[int]:
    """Bytes of each of DDP's reducer buckets. The reducer does not expose its buckets; its logging data lists their
    sizes (``bucket_sizes``, and ``rebuilt_bucket_sizes`` once DDP has rebuilt them in the order gradients became
    ready, recorded at the next logged iteration)."""
    data = module._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(size) for size in str(sizes).split(",") if size.strip()]


def module_forward_hook_dicts(module: nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """The dictionaries that hold ``module``'s forward pre-hooks and forward hooks (handles point into them)."""
    return module._forward_pre_hooks, module._forward_hooks


def hook_handle_target(handle: RemovableHandle) -> dict[int, Any] | None:
    """The hook dictionary ``handle`` removes its hook from; ``None`` once that dictionary is gone."""
    return handle.hooks_dict_ref()


def apply_to_metric(metric: Metric, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``fn`` applied to every tensor of ``metric``: its states, the defaults ``reset()`` restores, cached results,
    and the device and dtype it reports. torchmetrics does this in its private ``_apply``, which ``Module.to``
    reaches, but only for device moves and ``set_dtype`` (which would also cast integer states)."""
    metric._apply(fn)


def metric_state_defaults(metric: Metric) -> dict[str, Any]:
    """The values ``metric.reset()`` restores, by state name (torchmetrics keeps them in ``_defaults``)."""
    return metric._defaults


# ------------------------------------------------------------------------------------------------------ DeepSpeed
ZERO3_HOOK_LISTS: tuple[str, ...] = ("forward_hooks", "backward_hooks")


def zero3_full_shape(param: torch.Tensor) -> tuple[int, ...] | None:
    """The full shape of a ZeRO-3 partitioned parameter, ``None`` for any other tensor."""
    shape = getattr(param, "ds_shape", None)
    return None if shape is None else tuple(shape)


def full_numel(param: torch.Tensor) -> int:
    """Elements of the full parameter: a ZeRO-3 partition's ``ds_numel``, else ``numel()`` (a DTensor's is global)."""
    numel = getattr(param, "ds_numel", None)
    return int(numel) if numel is not None else param.numel()


def zero3_partition(param: torch.Tensor) -> tuple[torch.Tensor, range] | None:
    """A ZeRO-3 parameter's local partition (flat, possibly padded at the end) and the elements of the flattened
    full tensor it holds; ``None`` for any other tensor, or a partition that is not in memory (swapped to NVMe)."""
    local = getattr(param, "ds_tensor", None)
    if local is None or local.numel() != local.ds_numel:
        return None
    start = local.ds_numel * torch.distributed.get_rank(group=param.ds_process_group)
    return local, range(min(start, param.ds_numel), min(start + local.ds_numel, param.ds_numel))


def deepspeed_engine_config(engine: Any) -> Any:
    """The engine's parsed ``DeepSpeedConfig`` (what DeepSpeed builds its checkpoint engines from)."""
    return engine._config


def load_universal_next(engine: Any) -> None:
    """Make the engine's next ``load_checkpoint`` read a universal checkpoint (``latest_universal``), as if its JSON
    had ``"checkpoint": {"load_universal": true}``; the engine reads that setting from its config on every load."""
    deepspeed_engine_config(engine).load_universal_checkpoint = True


def zero3_parameter_offload(engine: Any) -> Any | None:
    """DeepSpeed's ZeRO-3 hook owner (``DeepSpeedZeRoOffload``) of ``engine``, or None if it has none.

    Training engines keep it as ``engine.optimizer.parameter_offload``; an inference engine's optimizer is it.
    """
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if all(hasattr(offload, name) for name in ZERO3_HOOK_LISTS) else None


def zero3_hook_handles(offload: Any, name: str) -> list[RemovableHandle]:
    """The handles of the module hooks ZeRO-3 registered (``name``: one of :data:`ZERO3_HOOK_LISTS`)."""
    return getattr(offload, name)


def set_zero3_hook_handles(offload: Any, name: str, handles: list[RemovableHandle]) -> None:
    """Replace a hook-handle list, so that DeepSpeed's own cleanup does not remove the same hooks twice."""
    setattr(offload, name, handles)


@functools.cache
def zero3_trace_compares_with_ne() -> bool:
    """Whether ZeRO-3's trace check (``PartitionedParameterCoordinator.trace_prologue``) compares the running
    submodule with ``!=``, which torchmetrics overloads (strategies/zero/trace.py); read once from its source.

    Assumed True when the source cannot be read or parsed: the fix is harmless where it is not needed.
    """
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        source = textwrap.dedent(inspect.getsource(PartitionedParameterCoordinator.trace_prologue))
    except (ImportError, AttributeError, OSError, TypeError):
        return True
    return compares_argument_with_ne(source)


def compares_argument_with_ne(source: str) -> bool:
    """Whether the method in ``source`` compares its first argument after ``self`` with ``!=`` (True if unsure)."""
    try:
        function = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return True
    if not isinstance(function, ast.FunctionDef) or len(function.args.args) < 2:
        return True
    argument = function.args.args[1].arg
    for node in ast.walk(function):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, ast.NotEq) for op in node.ops):
            continue
        if any(isinstance(side, ast.Name) and side.id == argument for side in (node.left, *node.comparators)):
            return True
    return False


def deepspeed_loaded_ops() -> dict[str, Any]:
    """DeepSpeed's per-process table of loaded ops (``OpBuilder._loaded_ops``, builder name -> module): an op found
    there is not loaded (nor built) again (``strategies.zero.ops``)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    return OpBuilder._loaded_ops


@contextlib.contextmanager
def jit_load_replaced(replacement: Callable[[Any, Callable[..., Any], bool], Any]) -> Iterator[None]:
    """Inside, DeepSpeed's ``OpBuilder.jit_load`` (every op builder's JIT build) runs ``replacement(builder,
    original_jit_load, verbose)``; restored on exit. ``strategies.zero.ops`` puts the machine-wide op cache there
    for the length of one ``load`` call, so that ops an op loads first (async I/O loads pinned memory) use it too."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    original = OpBuilder.jit_load

    def jit_load(self: Any, verbose: bool = True) -> Any:
        return replacement(self, original, verbose)

    OpBuilder.jit_load = jit_load
    try:
        yield
    finally:
        OpBuilder.jit_load = original


def deepspeed_attribute(obj: Any, name: str) -> Any:
    """``obj.name`` or None, for a ``name`` declared in :data:`DEEPSPEED_MEMORY_ATTRIBUTES` (others are refused, so
    that every attribute read stays in the declared, tested table)."""
    if name not in _MEMORY_NAMES:
        raise KeyError(f"{name!r} is not declared in gym_lightning._compat.DEEPSPEED_MEMORY_ATTRIBUTES")
    return getattr(obj, name, None)


def is_zero_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is one of DeepSpeed's ZeRO optimizer wrappers (not a torch optimizer DeepSpeed provides)."""
    return type(obj).__module__.startswith("deepspeed.runtime.zero.") and not isinstance(obj, torch.optim.Optimizer)


def zero_optimizer_lacks_memory_attributes(obj: Any) -> bool:
    """A ZeRO optimizer on which none of :data:`ZERO_OPTIMIZER_MEMORY_ATTRIBUTES` exists: DeepSpeed moved them."""
    return is_zero_optimizer(obj) and not any(hasattr(obj, name) for name in ZERO_OPTIMIZER_MEMORY_ATTRIBUTES)


# ------------------------------------------------------------------------------------------------ transformers
# Private transformers members, named with the module that assigns them (checked by tests/test_compat.py).
TRANSFORMERS_MEMBERS: tuple[tuple[str, str], ...] = (
    # The conversion table from_pretrained loaded a model with; save_pretrained reverts that one
    # (core_model_loading.revert_weight_conversion), and so does the exporter (models/conversion.py).
    ("transformers.core_model_loading", "_weight_conversions"),
    # Undocumented: marks DeepSpeed's zero.Init as open already, so that from_config under transformers' ZeRO-3
    # integration neither opens another one nor gathers every module to initialise it (initialize_weights_zero3).
    ("transformers.modeling_utils", "set_zero3_state"),
    # The attention implementation a built model's attention layers look up at every call (a config property;
    # set_attn_implementation validates against the installed kernels, which a registered name is not).
    ("transformers.configuration_utils", "_attn_implementation"),
)


def attention_implementation(config: Any) -> str | None:
    """The attention implementation the model of ``config`` runs (``_attn_implementation``, declared above)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, name: str) -> None:
    """Make the built model of ``config`` attend with ``name`` from its next call (a registered implementation)."""
    config._attn_implementation = name


def weight_conversions_of(model: nn.Module) -> list[Any] | None:
    """The weight transforms ``from_pretrained`` loaded ``model`` with, or ``None`` (built another way)."""
    return getattr(model, "_weight_conversions", None)


# ------------------------------------------------------------------------------------------------ peft
# peft members patched for a while: (module, name), checked by tests/test_compat.py.
PEFT_MEMBERS: tuple[tuple[str, str], ...] = (
    # get_peft_model's bridge from transformers 4 to 5 LoRA targets (called by BaseTuner.inject_adapter).
    ("peft.utils.transformers_weight_conversion", "convert_peft_config_for_transformers"),
)


@contextlib.contextmanager
def peft_v4_target_conversion_off() -> Iterator[None]:
    """Inside, peft adapts what the LoRA config names in the model as transformers 5 built it.

    peft (0.21) rewrites the config of a mixture of experts on the way in, for adapters written for transformers 4's
    per-expert ``nn.Linear`` layers (``_convert_peft_config_moe``): any ``target_modules`` entry ending in
    ``gate_proj``/``up_proj``/``down_proj`` (``w1``/``w2``/``w3`` on Mixtral) or ``gate`` becomes the fused experts'
    or the router's ``target_parameters``. On Qwen3-MoE, ``all-linear`` then adapted every routed expert and the
    router (whose adapters peft's ``ParamWrapper`` builds as whole-stack deltas, refusing any dropout: configs/
    qlora.yaml's 0.05 failed with "lora.ParamWrapper does not work with lora_dropout != 0"), and DeepSeek-V3's dense
    MLP and shared experts could not be adapted at all. gym_lightning's settings name transformers 5's modules:
    linear layers by ``target_modules``, expert weights by ``target_parameters``."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def zero3_init_open() -> contextlib.AbstractContextManager[None]:
    """transformers' own marker that a ``zero.Init`` context is open (``set_zero3_state``, declared above): a
    model built inside it is neither wrapped in a second ``zero.Init`` nor initialised by gathers."""
    from transformers.modeling_utils import set_zero3_state

    return set_zero3_state()


__all__ = [
    "DEEPSPEED_MEMBERS",
    "DEEPSPEED_MEMORY_ATTRIBUTES",
    "PEFT_MEMBERS",
    "PRIVATE_IMPORTS",
    "PRIVATE_MEMBERS",
    "PRIVATE_OVERRIDES",
    "ZERO3_HOOK_LISTS",
    "ZERO_OPTIMIZER_MEMORY_ATTRIBUTES",
    "DTensor",
    "DeepSpeedMember",
    "_StrategyRegistry",
    "apply_to_metric",
    "checkpoint_activations",
    "compares_argument_with_ne",
    "deepspeed_attribute",
    "deepspeed_engine_config",
    "deepspeed_loaded_ops",
    "full_numel",
    "hook_handle_target",
    "init_deepspeed_config_if_needed",
    "init_deepspeed_distributed",
    "is_zero_optimizer",
    "jit_load_replaced",
    "load_combined_loader_states",
    "load_universal_next",
    "logged_result_metric",
    "module_forward_hook_dicts",
    "optimizer_unscales_itself",
    "peft_v4_target_conversion_off",
    "per_batch_lightning_calls",
    "rank_zero_info",
    "rank_zero_warn",
    "record_checkpoint_saved",
    "result_moves_patched",
    "result_moves_walk_when_nothing_moves",
    "save_topk_and_last_checkpoint",
    "set_collective_timeout",
    "set_model_parallel_sizes",
    "set_zero3_hook_handles",
    "skip_same_device_result_moves",
    "training_dataloader",
    "weight_conversions_of",
    "wrapped_optimizer",
    "zero3_full_shape",
    "zero3_hook_handles",
    "zero3_init_open",
    "zero3_parameter_offload",
    "zero3_partition",
    "zero3_trace_compares_with_ne",
    "zero_optimizer_lacks_memory_attributes",
]


# ------------------------------------------------------------------------------------------ torch dynamo (DDP)
# dynamo's handling of a frame compiled inside a DistributedDataParallel forward (torch/_dynamo/config.py
# ``optimize_ddp``): split at DDP's bucket boundaries (``ddp_optimizer``, the default) or not (``no_optimization``).
DYNAMO_DDP_MODES: tuple[str, ...] = ("ddp_optimizer", "no_optimization")


def set_dynamo_ddp_mode(mode: str) -> None:
    """Frames dynamo compiles from now on use DDP mode ``mode`` (one of :data:`DYNAMO_DDP_MODES`): the private,
    process-wide setting ``torch._dynamo.config.optimize_ddp``, read when a frame is converted
    (torch/_dynamo/convert_frame.py)."""
    if mode not in DYNAMO_DDP_MODES:
        raise ValueError(f"dynamo DDP mode must be one of {DYNAMO_DDP_MODES}, got {mode!r}")
    torch._dynamo.config.optimize_ddp = mode


def dynamo_ddp_mode() -> str:
    """dynamo's DDP mode now (``torch._dynamo.config.optimize_ddp``; ``True``/``False`` are its old spellings)."""
    mode = torch._dynamo.config.optimize_ddp
    if isinstance(mode, bool):
        return "ddp_optimizer" if mode else "no_optimization"
    return mode


__all__ += ["DYNAMO_DDP_MODES", "dynamo_ddp_mode", "set_dynamo_ddp_mode"]


# ------------------------------------------------------------------------------------------- interpreter exit
def run_exit_handlers() -> None:
    """Run (and clear) every ``atexit`` handler now, as the interpreter's exit would (``atexit._run_exitfuncs``,
    CPython's, private; in every CPython 3): ``cli.end_process`` runs them before it skips the finalisation."""
    import atexit

    atexit._run_exitfuncs()


__all__ += ["run_exit_handlers"]


# ------------------------------------------------------------------------------------------- gradient scalers
def start_grad_scaler_on(scaler: Any, device: torch.device) -> None:
    """Create ``scaler``'s scale and growth tracker on ``device`` now, unless it has them: torch's ``GradScaler``
    creates them lazily on the device of the first loss it scales (``_lazy_init_scale_growth_tracker``)."""
    if getattr(scaler, "_scale", None) is None:
        scaler._lazy_init_scale_growth_tracker(device)


def grad_scaler_found_infs(scaler: Any, optimizer: Any) -> dict[torch.device, torch.Tensor]:
    """The per-device inf/NaN flags ``scaler.unscale_(optimizer)`` left for this step, as the scaler holds them
    (``GradScaler``'s ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``: replacing a value replaces
    what ``step`` and ``update`` read); empty before ``unscale_``."""
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state["found_inf_per_device"] if state is not None else {}


__all__ += ["grad_scaler_found_infs", "start_grad_scaler_on"]
