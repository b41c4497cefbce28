"""Private torch members: the declared inventory and the functions through which the package reaches them
(``gym_lightning._compat`` says why)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch import nn

# FSDP2-compatible activation checkpointing that keeps parameter names unchanged (unlike checkpoint_wrapper, which
# inserts ``_checkpoint_wrapped_module`` into every key); torchtitan and torch's own FSDP2 tests use it.
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

try:  # public since torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor

# Upstream class -> private members called, read or written through the functions below.
PRIVATE_MEMBERS: dict[type, tuple[str, ...]] = {
    nn.Module: ("_forward_pre_hooks", "_forward_hooks"),
    RemovableHandle: ("hooks_dict_ref",),
    DistributedDataParallel: ("_get_ddp_logging_data",),
    torch.amp.GradScaler: ("_lazy_init_scale_growth_tracker",),  # and the instance attribute _per_optimizer_states
    FSDPModule: ("_get_fsdp_state",),  # its FSDPState's _lazy_init (PRIVATE_IMPORTS)
}

# Private modules and names imported here: (module, name).
PRIVATE_IMPORTS: tuple[tuple[str, str], ...] = (
    ("torch.distributed._composable", "checkpoint"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState"),
)


def set_collective_timeout(timeout: timedelta, group: Any = None) -> None:
    """The timeout of a process group's collectives from now on (every backend of it, gloo and NCCL), separate
    from the rendezvous timeout it was created with; torch keeps this private (``_set_pg_timeout``, torch 2.3+)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def initialize_fsdp_now(module: nn.Module) -> None:
    """FSDP2's lazy initialisation of every outermost ``fully_shard`` module in ``module``, now rather than at its
    first forward. FSDP2 fixes each parameter group's gradient dtypes from the parameters that require gradients at
    that moment (``FSDPParamGroup._init_mp_dtypes``): a first forward with the trainable ones switched off (a LoRA
    reference's forward under peft's ``disable_adapter``, which sets the adapters' ``requires_grad`` to False) records
    none, and the first backward under ``bf16-mixed`` fails ("attempting to assign a gradient with dtype BFloat16 to
    a tensor with grad_dtype Float"). torch has no public call for it (``FSDPState._lazy_init``)."""
    if isinstance(module, FSDPModule):
        module._get_fsdp_state()._lazy_init()
        return
    for child in module.children():
        initialize_fsdp_now(child)


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


# ------------------------------------------------------------------------------------------- interpreter exit
def stop_threads_as_at_exit() -> None:
    """Do now what the interpreter's exit does with threads (``threading._shutdown``, CPython's, private; in every
    CPython 3): the callbacks registered with ``threading._register_atexit`` first (``concurrent.futures`` stops its
    executors' idle workers there), then every non-daemon thread joined. Joining first waits forever on an idle
    ``ThreadPoolExecutor`` worker (torch inductor compiles through one)."""
    import threading

    threading._shutdown()


def run_exit_handlers() -> None:
    """Run (and clear) every ``atexit`` handler now, as the interpreter's exit would (``atexit._run_exitfuncs``,
    CPython's, private; in every CPython 3): ``cli.end_process`` runs them before it skips the finalisation."""
    import atexit

    atexit._run_exitfuncs()


__all__ = [
    "DYNAMO_DDP_MODES",
    "PRIVATE_IMPORTS",
    "PRIVATE_MEMBERS",
    "DTensor",
    "checkpoint_activations",
    "ddp_bucket_sizes",
    "dynamo_ddp_mode",
    "grad_scaler_found_infs",
    "hook_handle_target",
    "initialize_fsdp_now",
    "module_forward_hook_dicts",
    "run_exit_handlers",
    "set_collective_timeout",
    "set_dynamo_ddp_mode",
    "start_grad_scaler_on",
    "stop_threads_as_at_exit",
]
