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

Frozen parameters (LoRA): a frozen weight still costs 2 FLOPs forward and 2 for the gradient w.r.t. its input (the
backward pass has to go through it to reach the adapters below), but no weight gradient, so 4·N_frozen instead of
6·N_frozen. The activation-gradient part is only needed above the lowest trainable parameter; we count it for every
layer, which is exact when adapters sit in the first layer (PEFT's usual ``target_modules`` on all layers) and a
small overestimate otherwise. Activation recomputation (gradient checkpointing) is not model FLOPs and is not counted:
this is MFU, not HFU (hardware FLOPs utilisation), in PaLM's terms.

Under padding we count only real tokens: a sequence of ``n`` non-padding tokens costs ``dense·n + attention·n²`` where
``dense = 6·N_trainable + 4·N_frozen`` and ``attention = 12·L·H·Q``, so a batch costs
``dense·Σn + attention·Σn²`` and the callback only has to accumulate ``Σn`` and ``Σn²``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gym_lightning.errors import GymUserError


@dataclass(frozen=True)
class TransformerFlops:
    """Training FLOPs of a decoder-only transformer, per the module docstring's convention.

    Args:
        trainable_params: Matmul parameters that receive gradients (``N_trainable``).
        frozen_params: Matmul parameters with ``requires_grad=False`` (``N_frozen``, e.g. the base model under LoRA).
        num_layers: Transformer blocks ``L``.
        attention_dim: Query heads times head size, ``H·Q``.
    """

    trainable_params: int
    frozen_params: int
    num_layers: int
    attention_dim: int

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
        """Training FLOPs of sequences with ``Σn = num_tokens`` real tokens and ``Σn² = sum_squared_lengths``."""
        return self.dense_per_token * num_tokens + self.attention_per_token_per_position * sum_squared_lengths


def global_numel(param: torch.Tensor) -> int:
    """Elements of the full (unsharded) parameter: DeepSpeed ZeRO-3 keeps it in ``ds_numel``; a DTensor's
    ``numel()`` is already global."""
    ds_numel = getattr(param, "ds_numel", None)
    return int(ds_numel) if ds_numel is not None else param.numel()


def matmul_param_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` parameter counts that enter ``N``: all parameters except embedding lookups, plus the
    output projection when it is tied to an embedding (see the module docstring)."""
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_ids = {id(p) for p in output.parameters()} if isinstance(output, nn.Module) else set()
    trainable = frozen = 0
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen or (id(param) in embedding_ids and id(param) not in output_ids):
            continue
        seen.add(id(param))
        if param.requires_grad:
            trainable += global_numel(param)
        else:
            frozen += global_numel(param)
    return trainable, frozen


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
    """:class:`TransformerFlops` of a Hugging Face causal LM (or PEFT model) and its config."""
    trainable, frozen = matmul_param_counts(model)
    num_layers, attention_dim = attention_shape(config)
    return TransformerFlops(trainable, frozen, num_layers, attention_dim)


def _first_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int):
            return value
    return None
