"""ZeRO-3 leaf modules: the modules DeepSpeed gathers whole, with one set of hooks, instead of submodule by submodule.

Mixture-of-experts blocks always (:func:`mark_moe_leaf_modules`: ranks routed to different experts must still gather
the same parameters), decoder layers where the layer's parameters allow it (:func:`mark_decoder_leaf_modules`:
fewer hooks, one coalesced all-gather per layer). Both before ``deepspeed.initialize``, which reads the flags when it
installs its hooks. ``ZeROStrategy`` marks the policy (and a frozen reference, ``strategies.zero.frozen``) with them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from gym_lightning._compat import rank_zero_info, rank_zero_warn
from gym_lightning.models.decoder_layers import decoder_layer_names, decoder_layers
from gym_lightning.models.moe import moe_block_classes, moe_blocks


def mark_moe_leaf_modules(model: nn.Module) -> list[type[nn.Module]]:
    """Make every instance of ``model``'s mixture-of-experts block classes (``models.moe``) a ZeRO-3 leaf module;
    returns the classes.

    ZeRO-3 then gathers a block's experts together on every rank, whichever experts its tokens were routed to. One
    expert module at a time, ranks routed differently issue different all-gathers: gloo pairs equal-sized ones of
    different experts (wrong weights, no error) and aborts on unequal ones (tests/strategies/zero/test_moe_leaf.py).
    Before ``deepspeed.initialize``: the engine reads the flag when it installs its hooks
    (``DeepSpeedZeRoOffload._register_deepspeed_module``).
    """
    from deepspeed.utils import set_z3_leaf_modules

    classes = moe_block_classes(model)
    if classes:
        set_z3_leaf_modules(model, classes)
        _log_leaf_classes(tuple(cls.__name__ for cls in classes), "mixture-of-experts block")
        for block in moe_blocks(model):
            if "_gym_inputs_require_grad" not in vars(block) and any(p.requires_grad for p in block.parameters()):
                block._gym_inputs_require_grad = block.register_forward_pre_hook(_inputs_require_grad)
    return classes


def _inputs_require_grad(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A leaf block's floating inputs made to require grad while it trains (a forward pre-hook).

    DeepSpeed reduces a leaf's gradients in its ``register_full_backward_hook`` (``stage3.
    create_reduce_and_remove_grad_hooks``), and torch fires a full backward hook as soon as the output's gradient is
    known when no input requires grad: before the block's own backward, whose adapter gradients then meet released
    parameters. With LoRA on the experts alone the first MoE block's input (frozen embeddings and attention) requires
    none (measured: Qwen3-MoE, all-experts, 2 CPU ranks, "size of tensor a (0) must match ... (32)" in the first
    backward; tests/strategies/test_expert_lora_ranks.py). A detached copy that requires grad costs one activation's
    gradient per block and changes no result.

    Args:
        block: The MoE block about to run.
        args: Its positional inputs.
    """
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
        return None
    return tuple(
        a.detach().requires_grad_()
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not a.requires_grad
        else a
        for a in args
    )


def mark_decoder_leaf_modules(model: nn.Module, config: dict[str, Any], training: bool = True) -> list[str]:
    """Make ``model``'s decoder layers (the ``_no_split_modules`` classes of its Hugging Face models) ZeRO-3 leaf
    modules, unless ``config`` states its own ``zero_optimization.leaf_module`` (the user's choice wins) or, when
    ``training``, a layer holds frozen parameters beside trainable ones (LoRA, QLoRA): DeepSpeed 0.19's backward of
    such a leaf reads a LoRA weight after it was released (measured: LoRA r=4 on q/v of tiny-llama, 2 CPU ranks,
    "size of tensor a (0) must match ... (4)" in the first backward). Returns the class names marked.

    A leaf gets DeepSpeed's four hooks; its children get none (``_register_deepspeed_module`` stops at it). Its
    pre-forward hook gathers every parameter of the layer in one coalesced all-gather, and backward gathers them
    again at the leaf's pre-backward hook (``PreBackwardFunctionForModule`` on its output), then reduces the layer's
    gradients in one ``register_full_backward_hook`` (``stage3.create_reduce_and_remove_grad_hooks``) instead of one
    hook per parameter. A Qwen3 decoder layer has 12 submodules below it: 4 x 12 fewer hook calls per layer and
    step, and a layer's forward has no hook inside it for ``torch.compile`` to break on. Memory: the layer is the
    unit the stage-3 limits already gather (``sizing.stage3_limits``). Before ``deepspeed.initialize``.

    Args:
        model: The model handed to the engine.
        config: The run's DeepSpeed config.
    """
    from deepspeed.utils import set_z3_leaf_modules

    if "leaf_module" in (config.get("zero_optimization") or {}):
        return []
    names = sorted(decoder_layer_names(model))
    layers = decoder_layers(model)
    if training and any(len({p.requires_grad for p in layer.parameters()}) > 1 for layer in layers):
        _log_leaf_classes((), "decoder layer")
        if any("forward" in vars(layer) for layer in layers):  # models.compiled sets the instance's forward
            rank_zero_warn(
                "model.compile under ZeRO-3 with LoRA: DeepSpeed's gather hooks on every submodule of a layer split "
                "its compiled graph (and dynamo's recompile limit leaves later layers eager), so compiling gains "
                "little here. For the compiled fast path with LoRA use gym_fsdp, zero1 or zero2."
            )
        return []
    if names and set_z3_leaf_modules(model, names, raise_if_not_found=False):
        _log_leaf_classes(tuple(names), "decoder layer")
        return names
    return []


@functools.cache
def _log_leaf_classes(names: tuple[str, ...], what: str) -> None:
    # Once per process and model: fit, validate and predict each set up an engine.
    if not names:
        rank_zero_info(
            f"gym_lightning: ZeRO-3 gathers each {what}'s submodules one by one: the layers hold frozen and trainable "
            "parameters (LoRA), which DeepSpeed's leaf modules do not support in backward."
        )
        return
    rank_zero_info(f"gym_lightning: ZeRO-3 gathers each {what} whole (leaf modules: {', '.join(names)}).")


__all__ = ["mark_decoder_leaf_modules", "mark_moe_leaf_modules"]
