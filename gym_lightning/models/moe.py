"""The mixture-of-experts blocks of a model, found from what the model says about itself (no table of class names).

Why a strategy needs them: DeepSpeed ZeRO-3 gathers a module's parameters (a collective) just before the module
runs. An MoE block that runs only the experts that received tokens (transformers 4's ``for expert in hit_experts``
loop, DeepSeek's own remote code) makes ranks whose tokens went to different experts gather different parameters,
and the collectives no longer match: the job hangs or mixes partitions (DeepSpeed issues #4094 and #4808). DeepSpeed's
remedy is to make the whole block a ZeRO-3 "leaf" (``deepspeed.utils.set_z3_leaf_modules``, DeepSpeed PR #4966):
every rank gathers all of the block's parameters when the block starts, and its gradients are reduced when its
backward ends, with zeros for experts that received no tokens (PR #5008).

The rules, in order of trust:

1. transformers' expert-parallel plan (``config.base_model_ep_plan``, rules relative to the base model such as
   ``"layers.*.mlp.experts": "ep_dispatch_experts"``) names each layer's experts module: the rule whose style is
   ``ep_dispatch_experts`` (the module tokens are dispatched to, ``transformers.distributed.expert_parallel``) or
   whose last name is ``experts``. The MoE block is that module's parent (the router and shared experts live there).
2. For models without a plan (custom or ``trust_remote_code`` modules, transformers 4-style models): a module with an
   ``nn.ModuleList`` child named ``experts`` (one module per expert) is an MoE block.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

# The expert-parallel style transformers gives the module that receives the dispatched tokens.
DISPATCH_STYLE = "ep_dispatch_experts"
EXPERTS = "experts"


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks of ``model`` (each once, in module order) by the rules of this module's docstring."""
    found = {id(block): block for block in (*_planned_blocks(model), *_module_list_blocks(model))}
    return [module for module in model.modules() if id(module) in found]


def moe_block_classes(model: nn.Module) -> list[type[nn.Module]]:
    """The classes of ``model``'s MoE blocks, each once, in module order."""
    return list(dict.fromkeys(type(block) for block in moe_blocks(model)))


def _planned_blocks(model: nn.Module) -> Iterable[nn.Module]:
    """Rule 1: the parents of the experts modules named by each sub-model's ``config.base_model_ep_plan``.

    The plan's rules are relative to the base model, so they are matched against the names inside every module that
    carries such a config (a causal LM and its base model share one config; only the base model's names match).
    """
    for owner in model.modules():
        patterns = _experts_patterns(getattr(getattr(owner, "config", None), "base_model_ep_plan", None))
        if not patterns:
            continue
        for name, _ in owner.named_modules():
            parent, _, _ = name.rpartition(".")
            # A parentless experts module would make the whole sub-model one leaf: ZeRO-3 would gather all of it.
            if parent and any(pattern.fullmatch(name) for pattern in patterns):
                yield owner.get_submodule(parent)


def _experts_patterns(plan: object) -> list[re.Pattern[str]]:
    """The plan rules that name an experts module, as regular expressions over module names (``*``: a layer index,
    as in transformers' ``_get_parameter_plan``)."""
    if not isinstance(plan, dict):
        return []
    rules = [rule for rule, style in plan.items() if style == DISPATCH_STYLE or rule.rsplit(".", 1)[-1] == EXPERTS]
    return [re.compile(r"\d+".join(re.escape(part) for part in rule.split("*"))) for rule in rules]


def _module_list_blocks(model: nn.Module) -> Iterable[nn.Module]:
    """Rule 2: modules with an ``nn.ModuleList`` child named ``experts``."""
    return (module for module in model.modules() if isinstance(getattr(module, EXPERTS, None), nn.ModuleList))


__all__ = ["moe_block_classes", "moe_blocks"]
