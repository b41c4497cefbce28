"""Private and undocumented DeepSpeed members: the declared inventory and the functions through which the package
reaches them (``gym_lightning._compat`` says why). DeepSpeed is imported lazily: owners are named, not imported."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle


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
ZERO3_HOOK_LISTS: tuple[str, ...] = ("forward_hooks", "backward_hooks")


# ------------------------------------------------------------------------------------------ partitioned tensors
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


# ------------------------------------------------------------------------------------------ engine and its hooks
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


# --------------------------------------------------------------------------------------------------------- ops
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


# ------------------------------------------------------------------------------------------------------ memory
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


__all__ = [
    "DEEPSPEED_MEMBERS",
    "DEEPSPEED_MEMORY_ATTRIBUTES",
    "ZERO3_HOOK_LISTS",
    "ZERO_OPTIMIZER_MEMORY_ATTRIBUTES",
    "DeepSpeedMember",
    "compares_argument_with_ne",
    "deepspeed_attribute",
    "deepspeed_engine_config",
    "deepspeed_loaded_ops",
    "full_numel",
    "is_zero_optimizer",
    "jit_load_replaced",
    "load_universal_next",
    "set_zero3_hook_handles",
    "zero3_full_shape",
    "zero3_hook_handles",
    "zero3_parameter_offload",
    "zero3_partition",
    "zero3_trace_compares_with_ne",
    "zero_optimizer_lacks_memory_attributes",
]
