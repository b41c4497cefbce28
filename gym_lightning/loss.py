"""Token-level causal-LM loss pieces.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` and ``-100`` marks tokens that
are not targets; the model's logits at position ``t`` predict ``labels[t + 1]``. The loss of an optimizer step is the
sum of target-token cross-entropies divided by the number of target tokens in that whole step (all accumulation
micro-batches, all data-parallel ranks), so that gradient accumulation cannot re-weight short and long sequences
(the fix Hugging Face made in late 2024 with ``num_items_in_batch``:
https://huggingface.co/blog/gradient_accumulation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of tokens that contribute to the loss (after the causal shift), as a 0-d ``int64`` tensor."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropies over target tokens, computed in fp32.

    Args:
        logits: ``[batch, seq, vocab]`` model outputs.
        labels: ``[batch, seq]`` aligned with the inputs; ``-100`` marks non-targets.
    """
    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = labels[:, 1:].to(shifted_logits.device)
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
