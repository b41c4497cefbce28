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
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gym_lightning.protocols import SHIFT_LABELS_KEY, AgreesCallCounts

IGNORE_INDEX = -100


def labels_of(batch: Mapping[str, Any]) -> tuple[torch.Tensor, bool]:
    """A batch's targets and whether they are already shifted (the ``shifted`` argument of the functions below).

    A sequence-parallel rank's slice of the sequence carries each position's next-token target already shifted
    (``protocols.SHIFT_LABELS_KEY``, ``strategies.sequence``); every other batch its aligned ``labels``.
    """
    if SHIFT_LABELS_KEY in batch:
        return batch[SHIFT_LABELS_KEY], True
    return batch["labels"], False


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


def has_cpu_backend(group: Any = None) -> bool:
    """Whether ``group`` (the default process group when ``None``) can reduce host tensors (gloo, or a
    ``cpu:gloo,cuda:nccl`` pair)."""
    return "cpu:" in torch.distributed.get_backend_config(group)


class AgreedCounts:
    """Call counts every rank agrees on, readable once the collective that agrees them (if any) has finished.

    Args:
        counts: The counts: host integers, or a tensor an all-reduce is reducing in place.
        pending: That all-reduce's work handle; ``None`` when nothing is in flight.
    """

    def __init__(self, counts: list[int] | torch.Tensor, pending: Any = None) -> None:
        self._counts = counts
        self._pending = pending

    def __getitem__(self, index: int) -> int:
        """Count ``index``, once the all-reduce has finished (a device sync only on NCCL-only groups)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return int(self._counts[index])


def start_max_counts(local: list[int], device: torch.device | None = None, group: Any = None) -> AgreedCounts:
    """The largest of each of ``local``'s counts over the ranks of ``group`` (the default process group when
    ``None``), the all-reduce started but not waited for so that it overlaps the forward pass.

    The counts come from the batch's shape, so they are host integers on one rank. Over ranks they are all-reduced
    as a host tensor where the group has a CPU backend (gloo, ``cpu:gloo,cuda:nccl``): reading a device tensor back
    would stop the host until the GPU has finished the forward. ``device`` holds them on NCCL-only groups.
    """
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) <= 1:
        return AgreedCounts(local)
    counts = torch.tensor(local, device=torch.device("cpu") if has_cpu_backend(group) else device)
    pending = torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group, async_op=True)
    return AgreedCounts(counts, pending)


def agreed_counts_of(strategy: object, local: list[int], device: torch.device | None = None) -> AgreedCounts:
    """The call counts of ``local`` every rank makes: the strategy's (``protocols.AgreesCallCounts``), else the
    largest over the default process group (safe for any strategy that gathers weights on each call, such as
    Lightning's ``DeepSpeedStrategy`` at stage 3; ``device`` as for ``start_max_counts``)."""
    if isinstance(strategy, AgreesCallCounts):
        return strategy.start_agreed_counts(local)
    return start_max_counts(local, device)


def start_rank_sum(value: torch.Tensor, world_size: int) -> Any:
    """Start summing ``value`` in place over the ``world_size`` ranks; returns the pending all-reduce (``None`` on
    one rank, or without a process group), to wait for once the sum is needed."""
    if world_size > 1 and torch.distributed.is_initialized():
        return torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM, async_op=True)
    return None


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


def sequence_ids(batch: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """Which sequence each position of a ``[B, T]`` batch belongs to, ``[B, T]`` int64 on the labels' device, and
    how many sequences there are (no host sync: the count is a shape).

    Padded rows hold one sequence each (row ``b`` is sequence ``b``). Padding-free packed rows (``data.collate``'s
    ``cu_seq_lens``, the cumulative document lengths of the flattened batch) hold several: a position's sequence is
    the document its flattened index falls in; a row's trailing padding is a document with no targets.
    """
    labels = batch["labels"]
    bounds = batch.get("cu_seq_lens")
    if bounds is None:
        rows = torch.arange(labels.size(0), device=labels.device)
        return rows[:, None].expand_as(labels), labels.size(0)
    flat = torch.arange(labels.numel(), device=labels.device)
    ids = torch.searchsorted(bounds[1:].to(device=labels.device, dtype=torch.long), flat, right=True)
    return ids.view_as(labels), bounds.numel() - 1


def _token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of its target in fp32, 0 where the target is ``IGNORE_INDEX``."""
    return -F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def _per_sequence(
    token_logps: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of ``token_logps`` and counts of targets per sequence id (``[count]`` each)."""
    logps = token_logps.new_zeros(count).index_add_(0, ids, token_logps)
    tokens = torch.zeros(count, dtype=torch.long, device=ids.device).index_add_(
        0, ids, (targets != IGNORE_INDEX).long()
    )
    return logps, tokens


def summed_sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the summed log-probabilities of its next-token targets (fp32) and their count.

    Args:
        logits: ``[batch, seq, vocab]`` model outputs.
        labels: ``[batch, seq]`` aligned with the inputs; ``-100`` marks non-targets.
        ids: ``[batch, seq]`` sequence of each position (``sequence_ids``); a target counts for its own position's
            sequence.
        count: Number of sequences.
    """
    targets = labels[:, 1:].to(logits.device).reshape(-1)
    token_logps = _token_logps(logits[:, :-1, :].reshape(-1, logits.size(-1)), targets)
    return _per_sequence(token_logps, targets, ids[:, 1:].reshape(-1), count)


def _head_token_logps(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    return _token_logps(lm_head(hidden), labels)


def chunked_sequence_logps(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    ids: torch.Tensor,
    count: int,
    chunk_tokens: int,
    num_chunks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed_sequence_logps(lm_head(hidden_states), ...)`` without ever holding ``[tokens, vocab]`` logits: the LM
    head runs ``chunk_tokens`` positions at a time under activation checkpointing, as in
    ``chunked_summed_cross_entropy`` (whose ``num_chunks`` rule applies: every rank makes the same LM-head calls)."""
    hidden = hidden_states[:, :-1, :].reshape(-1, hidden_states.size(-1))
    targets = labels[:, 1:].to(hidden.device).reshape(-1)
    chunks = max(num_chunks, num_loss_chunks(labels, chunk_tokens))
    parts = [
        checkpoint(
            _head_token_logps,
            hidden[start : start + chunk_tokens],
            targets[start : start + chunk_tokens],
            lm_head,
            use_reentrant=False,
        )
        for start in range(0, chunks * chunk_tokens, chunk_tokens)
    ]
    return _per_sequence(torch.cat(parts), targets, ids[:, 1:].reshape(-1), count)
