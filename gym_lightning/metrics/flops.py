"""Model FLOPs of training a decoder-only transformer, per token (pure functions, no Lightning).

Convention (PaLM, Chowdhery et al. 2022, appendix B "Compute usage and MFU"; the dense term is Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", section 2.1): training one token of a sequence of length ``T`` costs

    6·N + 12·L·H·Q·T

* ``6·N``: every weight ``w`` of a matmul does one multiply-add (2 FLOPs) per token in the forward pass, 2 more for the
  gradient w.r.t. the layer's input and 2 more for the gradient w.r.t. ``w`` itself. ``N`` counts the parameters of
  the matmuls: the input-embedding lookup is a gather, not a matmul, so every ``nn.Embedding`` is EXCLUDED; the output
  projection (``lm_head``) is INCLUDED, also when it is tied to the input embedding, because its matmul runs anyway.
  Norm weights and biases are counted in ``N`` like Kaplan and PaLM do (they are a rounding error).
* ``12·L·H·Q·T``: the two attention matmuls (``QKᵀ`` and ``AV``) of ``L`` layers with ``H`` query heads of size
  ``Q`` against ``T`` positions, 2 FLOPs each, times 3 for forward + backward. Like PaLM we do not halve it for the
  causal mask and count query heads (grouped-query attention shares K/V but still computes one score per query head).

A frozen weight (LoRA's base) costs ``4·N_frozen`` (no weight gradient: :class:`TransformerFlops`), a routed expert
``k/E`` of its size (``N`` is the *active* parameter count: :func:`matmul_param_counts`), a 4-bit weight the 16-bit
weight it stands for (:func:`logical_numels`), and only real tokens count under padding
(:meth:`TransformerFlops.for_tokens`). Activation recomputation (gradient checkpointing) is not model FLOPs: this is
MFU, not HFU (hardware FLOPs utilisation), in PaLM's terms.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gym_lightning._compat import full_numel
from gym_lightning.errors import GymUserError


@dataclass(frozen=True)
class TransformerFlops:
    """Training FLOPs of a decoder-only transformer, per the module docstring's convention.

    Frozen parameters (LoRA): a frozen weight still costs 2 FLOPs forward and 2 for the gradient w.r.t. its input
    (the backward pass has to go through it to reach the adapters below), but no weight gradient, so 4·N_frozen
    instead of 6·N_frozen. The activation-gradient part is only needed above the lowest trainable parameter; it is
    counted for every layer, which is exact when adapters sit in the first layer (PEFT's usual ``target_modules`` on
    all layers) and a small overestimate otherwise.

    Args:
        trainable_params: Active matmul parameters that receive gradients (``N_trainable``; routed experts at
            ``k/E`` of their size).
        frozen_params: Active matmul parameters with ``requires_grad=False`` (``N_frozen``, e.g. the base model under
            LoRA).
        num_layers: Transformer blocks ``L``.
        attention_dim: Query heads times head size, ``H·Q``.
        expert_params: Parameters of the routed experts, all of them (0 for a dense model).
        experts_per_token: Routed experts each token uses, ``k`` (0 for a dense model).
        num_experts: Routed experts per MoE layer, ``E`` (0 for a dense model).
    """

    trainable_params: int
    frozen_params: int
    num_layers: int
    attention_dim: int
    expert_params: int = 0
    experts_per_token: int = 0
    num_experts: int = 0

    @property
    def dense_per_token(self) -> int:
        """FLOPs per token independent of the sequence length: ``6·N_trainable + 4·N_frozen``."""
        return 6 * self.trainable_params + 4 * self.frozen_params

    @property
    def attention_per_token_per_position(self) -> int:
        """``12·L·H·Q``: multiply by the sequence length to get the attention FLOPs of one token."""
        return 12 * self.num_layers * self.attention_dim

    def per_token(self, seq_len: int) -> int:
        """Training FLOPs of one token in a sequence of ``seq_len`` tokens (PaLM's ``6N + 12LHQT``)."""
        return self.dense_per_token + self.attention_per_token_per_position * seq_len

    def for_tokens(self, num_tokens: float, sum_squared_lengths: float) -> float:
        """Training FLOPs of sequences with ``Σn = num_tokens`` real tokens and ``Σn² = sum_squared_lengths``.

        Under padding only real tokens count: a sequence of ``n`` non-padding tokens costs ``dense·n +
        attention·n²``, so a batch costs ``dense·Σn + attention·Σn²`` and the callback only has to accumulate ``Σn``
        and ``Σn²``.
        """
        return self.dense_per_token * num_tokens + self.attention_per_token_per_position * sum_squared_lengths


def matmul_param_counts(
    model: nn.Module, experts: Sequence[re.Pattern[str]] = (), expert_share: tuple[int, int] = (1, 1)
) -> tuple[int, int]:
    """``(trainable, frozen)`` parameter counts that enter ``N``: all parameters except embedding lookups, plus the
    output projection when it is tied to an embedding (see the module docstring). Parameters named by ``experts``
    (:func:`expert_patterns`) count ``k / E`` of their size, ``expert_share = (k, E)``; NF4 weights count as the
    16-bit weights they stand for (:func:`logical_numels`).

    Mixture of experts (Qwen3-30B-A3B, Mixtral, DeepSeek-V3, gpt-oss): each token goes through ``k`` of the ``E``
    routed experts of a layer (``num_experts_per_tok`` of ``num_experts``), so a routed expert's weights enter ``N``
    at ``k/E`` of their size: exactly the ``k`` experts' weights a token uses, whichever they are. Routers and shared
    experts (DeepSeek's ``shared_experts``, Qwen2-MoE's ``shared_expert``) run for every token and count whole. ``N``
    is then the *active* parameter count the model cards publish ("A3B": 3.3B of Qwen3-30B-A3B's 30.5B, checked in
    tests/metrics/test_flops.py). Which parameters are routed experts is what the model's config says (its
    expert-parallel plan, :func:`expert_patterns`), not a table of ours; a model without that plan counts every
    parameter whole (an overestimate for MoE, exact for a dense model). LoRA on routed experts (peft's
    ``target_parameters``: ``lora_A [r E, in]``, ``lora_B [out, r E]`` under the experts module, so the plan's
    pattern names them too) counts at ``k/E`` like the experts: a token runs the ``k`` adapters of its experts,
    ``k r (in + out)`` parameters per adapted weight.
    """
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_ids = {id(p) for p in output.parameters()} if isinstance(output, nn.Module) else set()
    trainable = frozen = 0
    seen: set[int] = set()
    named = list(model.named_parameters(remove_duplicate=False))
    logical = logical_numels(named)
    for name, param in named:
        if id(param) in seen or (id(param) in embedding_ids and id(param) not in output_ids):
            continue
        seen.add(id(param))
        numel = logical[name]
        if is_routed_expert(name, experts):
            numel = numel * expert_share[0] // expert_share[1]
        if param.requires_grad:
            trainable += numel
        else:
            frozen += numel
    return trainable, frozen


# The parameters a 4-bit weight ``name`` adds beside its codes (quant.linear.COMPONENTS, quant.experts.SUFFIXES).
NF4_PART_SUFFIXES = ("_scales", "_scale_stats", "_quant_type")


def logical_numels(named: Sequence[tuple[str, nn.Parameter]]) -> dict[str, int]:
    """``{name: elements}`` of each parameter as the matmul sees it: its full size (:func:`full_numel`), except a
    4-bit weight's parts (recognised by their names, as ``quant`` makes them: uint8 codes ``name`` beside a
    ``name_scales``): the codes count ``2 x`` (two 4-bit weights a byte), the scales and statistics 0. 4-bit weights
    (QLoRA: ``NF4Linear`` and NF4 fused experts, ``quant.experts``) are dequantised and run as the 16-bit matmul, so
    they count as the weight they stand for.

    Args:
        named: ``model.named_parameters(remove_duplicate=False)`` as a list.
    """
    dtypes = {name: param.dtype for name, param in named}

    def codes(name: str) -> bool:  # the uint8 codes of a 4-bit weight: a ``_scales`` parameter beside them
        return dtypes.get(name) == torch.uint8 and name + "_scales" in dtypes

    numels = {}
    for name, param in named:
        numel = full_numel(param)
        if codes(name):
            numel *= 2
        elif any(name.endswith(s) and codes(name.removesuffix(s)) for s in NF4_PART_SUFFIXES):
            numel = 0
        numels[name] = numel
    return numels


def expert_patterns(config: Any) -> list[re.Pattern[str]]:
    """The routed experts' parameter names of a model, from its config's expert-parallel plan
    (``base_model_ep_plan``: ``"layers.*.mlp.experts": ...``); none for a dense model or one without the plan.

    The plan's router rules are left out: transformers 5.17 (the GPU image's) lists the router too
    (``"layers.*.mlp.gate": "ep_router"``, gpt-oss's ``mlp.router``), which runs for every token and counts whole;
    5.25 lists only the experts."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text_config, "base_model_ep_plan", None) or {}
    experts = [key for key, style in plan.items() if "router" not in str(style)]
    return [re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + r"(\.|$)") for key in experts]


def is_routed_expert(name: str, patterns: Sequence[re.Pattern[str]]) -> bool:
    """Whether parameter ``name`` (any prefix: ``model.``, PEFT's ``base_model.model.``) lies in a routed expert."""
    return any(pattern.search(name) for pattern in patterns)


def expert_routing(config: Any) -> tuple[int, int] | None:
    """``(k, E)``: routed experts per token and per layer, from a Hugging Face config; ``None`` for a dense model."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_token = _first_attr(text_config, ("num_experts_per_tok", "moe_topk", "top_k"))
    experts = _first_attr(text_config, ("num_experts", "num_local_experts", "n_routed_experts"))
    return (per_token, experts) if per_token and experts else None


def attention_shape(config: Any) -> tuple[int, int]:
    """``(L, H·Q)`` from a Hugging Face config (the text config of a multimodal one).

    Raises:
        ValueError: if the config lacks the layer count or the head count / size.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = _first_attr(text_config, ("num_hidden_layers", "n_layer", "num_layers"))
    num_heads = _first_attr(text_config, ("num_attention_heads", "n_head"))
    head_dim = getattr(text_config, "head_dim", None)
    if head_dim is None and num_heads:
        hidden = _first_attr(text_config, ("hidden_size", "n_embd", "d_model"))
        head_dim = hidden // num_heads if hidden else None
    if not num_layers or not num_heads or not head_dim:
        raise GymUserError(
            f"cannot read the attention shape from {type(text_config).__name__}: need num_hidden_layers, "
            "num_attention_heads and head_dim (or hidden_size); pass flops_per_token explicitly instead."
        )
    return int(num_layers), int(num_heads) * int(head_dim)


def transformer_flops(model: nn.Module, config: Any) -> TransformerFlops:
    """:class:`TransformerFlops` of a Hugging Face causal LM (or PEFT model) and its config (MoE: active parameters)."""
    num_layers, attention_dim = attention_shape(config)
    patterns, routing = expert_patterns(config), expert_routing(config)
    if not patterns or routing is None:
        return TransformerFlops(*matmul_param_counts(model), num_layers, attention_dim)
    logical = logical_numels(list(model.named_parameters()))
    experts = sum(n for name, n in logical.items() if is_routed_expert(name, patterns))
    counts = matmul_param_counts(model, patterns, routing)
    return TransformerFlops(*counts, num_layers, attention_dim, experts, *routing)


def _first_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int):
            return value
    return None
