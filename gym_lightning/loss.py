"""Token-level causal-LM loss pieces.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` and ``-100`` marks tokens that
are not targets; the model's logits at position ``t`` predict ``labels[t + 1]``. The loss of an optimizer step is the
sum of target-token cross-entropies divided by the number of target tokens in that whole step (all accumulation
micro-batches, all data-parallel ranks), so that gradient accumulation cannot re-weight short and long sequences
(the fix Hugging Face made in late 2024 with ``num_items_in_batch``:
https://huggingface.co/blog/gradient_accumulation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def count_target_tokens(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Number of tokens that contribute to the loss (after the causal shift), as a 0-d ``int64`` tensor.

    ``shifted``: ``labels`` are already each position's next-token target (transformers' ``shift_labels``; what a
    sequence-parallel rank holds, ``strategies.sequence``), so every position counts, the last one included.
    """
    return ((labels if shifted else labels[..., 1:]) != IGNORE_INDEX).sum()


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropies over target tokens, computed in fp32.

    Args:
        logits: ``[batch, seq, vocab]`` model outputs.
        labels: ``[batch, seq]`` aligned with the inputs; ``-100`` marks non-targets.
        shifted: ``labels`` are already the next-token targets of each position (``shift_labels``).
    """
    shifted_logits = (logits if shifted else logits[:, :-1, :]).float()
    shifted_labels = (labels if shifted else labels[:, 1:]).to(shifted_logits.device)
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# Vocabulary size from which the module computes the loss in chunks by default (``loss_chunking="auto"``): from 64k
# entries a token's fp32 logits take 256 KiB and the unchunked loss holds about three [tokens, vocab] fp32 buffers
# (the fp32 logits, log-softmax saved for backward, its gradient): 16 GB for 8k tokens at Qwen3's 151,936 entries.
# Below it (Llama 2's 32,000, Phi-3's 32,064) the saving is small and the recomputation (one more LM-head matmul in
# backward) is not worth it. docs/benchmarks.md has the measured figures.
CHUNKED_LOSS_MIN_VOCAB = 65_536


def use_chunked_loss(setting: str, vocab_size: int) -> bool:
    """Whether ``loss_chunking=setting`` (``auto``/``on``/``off``) chunks the loss of a ``vocab_size`` model."""
    return setting == "on" or (setting == "auto" and vocab_size >= CHUNKED_LOSS_MIN_VOCAB)


def num_loss_chunks(labels: torch.Tensor, chunk_tokens: int, shifted: bool = False) -> int:
    """How many chunks of at most ``chunk_tokens`` positions the shifted ``[batch, seq]`` labels split into."""
    positions = labels.size(0) * max(0, labels.size(1) - (0 if shifted else 1))
    return max(1, math.ceil(positions / chunk_tokens))


def has_cpu_backend() -> bool:
    """Whether the default process group can reduce host tensors (gloo, or a ``cpu:gloo,cuda:nccl`` pair)."""
    return "cpu:" in torch.distributed.get_backend_config()


def _head_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_summed_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int,
    num_chunks: int = 0,
    shifted: bool = False,
) -> torch.Tensor:
    """``summed_cross_entropy(lm_head(hidden_states), labels)`` without ever holding ``[tokens, vocab]`` logits.

    The LM head and the fp32 cross-entropy run on ``chunk_tokens`` positions at a time, each under non-reentrant
    activation checkpointing: a chunk's logits are freed as soon as its loss is summed and recomputed (one more
    LM-head matmul) in backward, so at most one chunk's logits exist at any time. ``lm_head`` is called as a module,
    so the hooks of the strategy that owns its weight still run on every call (ZeRO-3 gathers it, peft's LoRA
    layers and tied embeddings work unchanged).

    Args:
        hidden_states: ``[batch, seq, hidden]`` final hidden states (after the last norm), the LM head's input.
        lm_head: The output projection (``model.get_output_embeddings()``).
        labels: ``[batch, seq]`` aligned with the inputs; ``-100`` marks non-targets.
        chunk_tokens: Positions per chunk (>= 1).
        num_chunks: Call the LM head this many times (empty chunks at the end) when it is more than the positions
            need: ZeRO-3 gathers the weight on every call, a collective, so every rank must make the same number of
            calls even when its batch is shorter. ``0``: as many as the positions need.
        shifted: ``labels`` are already the next-token targets of each position (``shift_labels``).
    """
    hidden = (hidden_states if shifted else hidden_states[:, :-1, :]).reshape(-1, hidden_states.size(-1))
    targets = (labels if shifted else labels[:, 1:]).to(hidden.device).reshape(-1)
    chunks = max(num_chunks, num_loss_chunks(labels, chunk_tokens, shifted))
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, chunks * chunk_tokens, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        total = total + checkpoint(_head_cross_entropy, hidden[part], targets[part], lm_head, use_reentrant=False)
    return total


def step_loss_scale(step_tokens: torch.Tensor, world_size: int, accumulation: int) -> torch.Tensor:
    """The factor that turns a micro-batch's summed token loss into its share of the optimizer step's token mean.

    Data-parallel strategies average gradients over the ``world_size`` ranks and Lightning divides each micro-batch's
    loss by the ``accumulation`` count; multiplying both back and dividing by ``step_tokens`` (the target tokens of
    the whole step, all micro-batches and ranks) makes the summed gradient d(sum of token losses in the step) /
    (tokens in the step), the loss of the module docstring. ``accumulation`` is 1 when the micro-batches are
    normalised one by one (batches that carry no step token count).
    """
    return world_size * accumulation / step_tokens.clamp(min=1.0)
