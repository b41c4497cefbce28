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


_HOST_GROUPS: dict[Any, Any] = {}


def host_group(group: Any = None) -> Any:
    """A process group over ``group``'s ranks (the default group's when ``None``) that reduces host tensors:
    ``group`` itself where it has a CPU backend, else a gloo group made for it at the first call (a collective:
    every rank of the job reaches it at the same agreement, as it reaches the agreement's all-reduce)."""
    if has_cpu_backend(group):
        return group
    key = group if group is not None else torch.distributed.group.WORLD
    if key not in _HOST_GROUPS:
        ranks = torch.distributed.get_process_group_ranks(key)
        _HOST_GROUPS[key] = torch.distributed.new_group(ranks, backend="gloo")
    return _HOST_GROUPS[key]


# Where the module's call counts stand in the lists it asks a strategy to agree on (``protocols.AgreesCallCounts``).
LOSS_CHUNKS, MLP_TILES = 0, 1


class AgreedCounts:
    """Call counts every rank agrees on: this rank's own where no agreement is needed, the largest over the ranks
    where one is, readable once the host-side all-reduce that agrees them has finished.

    Args:
        local: This rank's counts.
        agreed: The positions in ``local`` that are agreed over the ranks (none: every count is ``local``'s).
        reduced: A host tensor an all-reduce is reducing in place: the agreed counts, in ``agreed``'s order.
        pending: That all-reduce's work handle; ``None`` when nothing is in flight.
    """

    def __init__(
        self, local: list[int], agreed: tuple[int, ...] = (), reduced: torch.Tensor | None = None, pending: Any = None
    ) -> None:
        self._local, self._agreed, self._reduced, self._pending = list(local), agreed, reduced, pending

    def __getitem__(self, index: int) -> int:
        """Count ``index``; an agreed one once its all-reduce has finished (host memory: no device is waited for)."""
        if index not in self._agreed:
            return self._local[index]
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return int(self._reduced[self._agreed.index(index)])


def start_max_counts(local: list[int], agreed: tuple[int, ...] | None = None, group: Any = None) -> AgreedCounts:
    """The largest of ``local``'s counts at the positions ``agreed`` (all when ``None``) over the ranks of ``group``
    (the default process group when ``None``), the all-reduce started but not waited for so that it overlaps the
    forward pass; the other counts stay this rank's.

    The counts come from the batch's shape, host integers on every rank, so they are all-reduced as a host tensor
    (over a gloo group where ``group`` has no CPU backend, ``host_group``): on CUDA a device tensor would be a
    blocking copy from host data to the device, and reading it back would stop the host until the GPU had run
    everything queued before, the forward included.
    """
    agreed = tuple(range(len(local))) if agreed is None else agreed
    if not agreed or not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) <= 1:
        return AgreedCounts(local)
    reduced = torch.tensor([local[i] for i in agreed], dtype=torch.int64)  # host memory, on CUDA too
    max_op = torch.distributed.ReduceOp.MAX
    pending = torch.distributed.all_reduce(reduced, op=max_op, group=host_group(group), async_op=True)
    return AgreedCounts(local, agreed, reduced, pending)


def agreed_counts_of(strategy: object, local: list[int]) -> AgreedCounts:
    """The call counts of ``local`` every rank makes: the strategy's (``protocols.AgreesCallCounts``), else the
    largest over the default process group (safe for any strategy that gathers weights on each call, such as
    Lightning's ``DeepSpeedStrategy`` at stage 3)."""
    if isinstance(strategy, AgreesCallCounts):
        return strategy.start_agreed_counts(local)
    return start_max_counts(local)


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
