"""The one place where gym_lightning touches private (``_``-prefixed or undocumented) members of the libraries it
builds on: one module per library (``lightning`` with torchmetrics, ``torch``, ``deepspeed``, ``transformers``,
``peft``), every name re-exported here, so that ``from gym_lightning._compat import x`` is the only spelling the
package uses.

None of these libraries promises to keep such members stable; keeping every use here means one package to fix on
an upgrade, and tests/test_compat.py checks that each member declared here still exists in the installed versions.

* :data:`PRIVATE_OVERRIDES`: private Lightning methods our subclasses override (they must keep the upstream name)
  or call through ``super()``. tests/test_compat.py also fails when a subclass overrides or touches any other
  upstream private member without it being listed here.
* :data:`PRIVATE_MEMBERS`, :data:`PRIVATE_IMPORTS`, :data:`DEEPSPEED_MEMBERS`, :data:`DEEPSPEED_MEMORY_ATTRIBUTES`,
  :data:`TRANSFORMERS_MEMBERS`, :data:`PEFT_MEMBERS`: private members that the package calls, reads or writes,
  only through the functions of this package (each library's module declares its own; the tables here join them).
"""

from __future__ import annotations

from gym_lightning._compat import lightning as _lightning
from gym_lightning._compat import torch as _torch
from gym_lightning._compat.deepspeed import (
    DEEPSPEED_MEMBERS,
    DEEPSPEED_MEMORY_ATTRIBUTES,
    ZERO3_HOOK_LISTS,
    ZERO_OPTIMIZER_MEMORY_ATTRIBUTES,
    DeepSpeedMember,
    compares_argument_with_ne,
    deepspeed_attribute,
    deepspeed_engine_config,
    deepspeed_loaded_ops,
    full_numel,
    is_zero_optimizer,
    jit_load_replaced,
    load_universal_next,
    set_zero3_hook_handles,
    zero3_full_shape,
    zero3_hook_handles,
    zero3_parameter_offload,
    zero3_partition,
    zero3_trace_compares_with_ne,
    zero_optimizer_lacks_memory_attributes,
)
from gym_lightning._compat.lightning import (
    PRIVATE_OVERRIDES,
    _all_tensors_on,
    _FitLoop,
    _StrategyRegistry,
    apply_to_metric,
    init_deepspeed_config_if_needed,
    init_deepspeed_distributed,
    load_combined_loader_states,
    logged_result_metric,
    metric_state_defaults,
    optimizer_unscales_itself,
    per_batch_lightning_calls,
    rank_zero_info,
    rank_zero_warn,
    record_checkpoint_saved,
    result_moves_patched,
    result_moves_walk_when_nothing_moves,
    save_topk_and_last_checkpoint,
    set_model_parallel_sizes,
    skip_same_device_result_moves,
    training_dataloader,
    wrapped_optimizer,
)
from gym_lightning._compat.peft import PEFT_MEMBERS, peft_v4_target_conversion_off
from gym_lightning._compat.torch import (
    DYNAMO_DDP_MODES,
    DTensor,
    checkpoint_activations,
    ddp_bucket_sizes,
    dynamo_ddp_mode,
    grad_scaler_found_infs,
    hook_handle_target,
    initialize_fsdp_now,
    module_forward_hook_dicts,
    run_exit_handlers,
    set_collective_timeout,
    set_dynamo_ddp_mode,
    start_grad_scaler_on,
    stop_threads_as_at_exit,
)
from gym_lightning._compat.transformers import (
    TRANSFORMERS_MEMBERS,
    attention_implementation,
    set_attention_implementation,
    weight_conversions_of,
    zero3_init_open,
)

# Upstream class -> private members called, read or written through this package's functions (Lightning's, then
# torch's).
PRIVATE_MEMBERS: dict[type, tuple[str, ...]] = {**_lightning.PRIVATE_MEMBERS, **_torch.PRIVATE_MEMBERS}
# Private modules and names imported by this package: (module, name).
PRIVATE_IMPORTS: tuple[tuple[str, str], ...] = _lightning.PRIVATE_IMPORTS + _torch.PRIVATE_IMPORTS

__all__ = [
    "DEEPSPEED_MEMBERS",
    "DEEPSPEED_MEMORY_ATTRIBUTES",
    "DYNAMO_DDP_MODES",
    "PEFT_MEMBERS",
    "PRIVATE_IMPORTS",
    "PRIVATE_MEMBERS",
    "PRIVATE_OVERRIDES",
    "TRANSFORMERS_MEMBERS",
    "ZERO3_HOOK_LISTS",
    "ZERO_OPTIMIZER_MEMORY_ATTRIBUTES",
    "DTensor",
    "DeepSpeedMember",
    "_FitLoop",
    "_StrategyRegistry",
    "_all_tensors_on",
    "apply_to_metric",
    "attention_implementation",
    "checkpoint_activations",
    "compares_argument_with_ne",
    "ddp_bucket_sizes",
    "deepspeed_attribute",
    "deepspeed_engine_config",
    "deepspeed_loaded_ops",
    "dynamo_ddp_mode",
    "full_numel",
    "grad_scaler_found_infs",
    "hook_handle_target",
    "init_deepspeed_config_if_needed",
    "init_deepspeed_distributed",
    "initialize_fsdp_now",
    "is_zero_optimizer",
    "jit_load_replaced",
    "load_combined_loader_states",
    "load_universal_next",
    "logged_result_metric",
    "metric_state_defaults",
    "module_forward_hook_dicts",
    "optimizer_unscales_itself",
    "peft_v4_target_conversion_off",
    "per_batch_lightning_calls",
    "rank_zero_info",
    "rank_zero_warn",
    "record_checkpoint_saved",
    "result_moves_patched",
    "result_moves_walk_when_nothing_moves",
    "run_exit_handlers",
    "save_topk_and_last_checkpoint",
    "set_attention_implementation",
    "set_collective_timeout",
    "set_dynamo_ddp_mode",
    "set_model_parallel_sizes",
    "set_zero3_hook_handles",
    "skip_same_device_result_moves",
    "start_grad_scaler_on",
    "stop_threads_as_at_exit",
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
