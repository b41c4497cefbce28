"""Keep DeepSpeed ZeRO-3's module trace valid when a LightningModule calls torchmetrics metrics in its steps.

ZeRO-3 records the order in which submodules run during the first step; from then on it prefetches the parameters
the next submodules need and keeps those reused soon gathered. Before each submodule it checks the trace with
``sub_module != expected`` (``PartitionedParameterCoordinator.trace_prologue`` in
deepspeed/runtime/zero/partitioned_param_coordinator.py) and throws the whole trace away on a mismatch.
torchmetrics' ``Metric`` overloads ``!=`` to build a ``CompositionalMetric``, an object that is always truthy, so a
metric called in ``training_step`` (``self.train_acc(preds, target)``, the usual Lightning pattern) invalidates the
trace on every step: no prefetch, and every partitioned parameter is gathered again at each use, about twice the
all-gathers per step (docs/benchmarks-history.md, "ZeRO-3's trace with torchmetrics").

Such a metric owns no parameters, so ZeRO-3 has nothing to gather for it. Removing DeepSpeed's hooks from it (and
only from it) leaves it out of the trace and changes nothing else. A metric that owns parameters (a learned metric
with its own network) keeps its hooks: ZeRO-3 must gather those. Where DeepSpeed's trace check no longer compares
with ``!=`` (``gym_lightning._compat.zero3_trace_compares_with_ne`` reads it), nothing is detached.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from gym_lightning._compat import (
    ZERO3_HOOK_LISTS,
    hook_handle_target,
    module_forward_hook_dicts,
    rank_zero_info,
    rank_zero_warn,
    set_zero3_hook_handles,
    zero3_hook_handles,
    zero3_parameter_offload,
    zero3_trace_compares_with_ne,
)


def overloads_comparison(module: nn.Module) -> bool:
    """Whether ``module != other`` is not plain identity (``nn.Module`` inherits ``object``'s)."""
    cls = type(module)
    return cls.__ne__ is not object.__ne__ or cls.__eq__ is not object.__eq__


def trace_breaking_modules(root: nn.Module) -> list[nn.Module]:
    """Submodules of ``root`` without parameters whose ``!=`` is overloaded (e.g. torchmetrics metrics)."""
    return [m for m in root.modules() if overloads_comparison(m) and next(m.parameters(), None) is None]


def detach_zero3_hooks(engine: Any, modules: list[nn.Module]) -> int:
    """Remove the forward/backward hooks that DeepSpeed ZeRO-3 registered on ``modules``; returns how many.

    Only DeepSpeed's own handles are removed (matched by the hook dictionary they live in), never a user's hooks.
    """
    if not modules:
        return 0
    offload = zero3_parameter_offload(engine)
    if offload is None:
        rank_zero_warn(
            "gym_lightning could not find DeepSpeed's ZeRO-3 hooks on this engine (DeepSpeed's internals changed?): "
            f"{len(modules)} metric module(s) stay hooked, and calling them in a step makes ZeRO-3 re-gather every "
            "parameter each step. Call metrics with .update() instead of metric(...) to avoid it."
        )
        return 0
    targets = {id(hooks) for module in modules for hooks in module_forward_hook_dicts(module)}
    removed = 0
    for name in ZERO3_HOOK_LISTS:
        kept = []
        for handle in zero3_hook_handles(offload, name):
            hooks = hook_handle_target(handle)
            if hooks is not None and id(hooks) in targets:
                handle.remove()
                removed += 1
            else:
                kept.append(handle)
        set_zero3_hook_handles(offload, name, kept)
    return removed


def keep_zero3_trace_valid(engine: Any) -> int:
    """Detach ZeRO-3's hooks from the parameter-free, ``!=``-overloading submodules of ``engine.module``.

    Only where this DeepSpeed still compares modules with ``!=`` in its trace check; elsewhere nothing is detached.
    """
    if not zero3_trace_compares_with_ne():
        _log_trace_fix_not_needed()
        return 0
    return detach_zero3_hooks(engine, trace_breaking_modules(engine.module))


@functools.cache
def _log_trace_fix_not_needed() -> None:
    # Once per process: the probe's answer cannot change, and every ZeRO-3 setup would repeat it.
    rank_zero_info(
        "gym_lightning: this DeepSpeed's ZeRO-3 trace check does not compare modules with '!=', so metric modules "
        "keep their ZeRO-3 hooks (the torchmetrics trace fix is not needed)."
    )
