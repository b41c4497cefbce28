"""Ulysses sequence parallelism: ``sequence_parallel_size`` ranks share each training sequence.

The W ranks form W/N groups of N consecutive ranks (N = ``sequence_parallel_size``). The data-parallel sampler deals
batches to the W/N groups, so the N ranks of a group receive the same batch (``strategies.parallel_dims``); each
rank then trains on its N-th of every sequence (``shard_batch``): rank ``r`` of the group keeps positions
``[r L/N, (r+1) L/N)`` of the rows padded to a multiple of N. Everything outside attention works on tokens one by
one, so it runs on the local slice unchanged; attention needs the whole sequence and gets it as DeepSpeed Ulysses
does (Jacobs et al. 2023, arXiv 2309.14509; ALST, arXiv 2506.13996): an all-to-all turns ``[local tokens, all
heads]`` into ``[all tokens, heads/N]``, each rank runs causal attention over the whole sequence for its heads,
and a second all-to-all turns the output back (``ulysses_attention``). Both all-to-alls are differentiable
(``_AllToAll``), so the backward pass sends each rank's share of the gradient back where it came from.

The loss needs no collective: the labels are shifted before they are sliced (``shift_labels``: the last token of
rank 0's slice predicts the first of rank 1's), every rank sums the cross-entropy of its own targets, and the
package's rule (``gym_lightning.loss``: the step's summed token loss over the target tokens of the whole step and
all ranks, gradients averaged over all W ranks by DDP/FSDP/ZeRO as before) makes the gradient the one of one
process on the whole sequences. The step's target-token count, which every rank of a group carries for the whole
batch, is divided by N so that the sum over ranks counts each token once.

Validation, test and prediction run every rank of a group on the whole (same) sequences with the model's own
``sdpa``: no activations are kept there, and generation needs whole prompts. Why not DeepSpeed's own
``UlyssesSPAttentionHF``: :func:`register_ulysses_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gym_lightning._compat import attention_implementation
from gym_lightning.errors import GymUserError, raise_if_problems
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.protocols import SHIFT_LABELS_KEY, STEP_TOKENS_KEY
from gym_lightning.strategies.parallel_dims import ParallelDims, world_problems

# The attention implementation name the exchange is registered under (transformers' AttentionInterface).
ULYSSES_ATTENTION = "gym_ulysses"
# The only core attention the exchange runs: torch's fused kernels (flash / memory-efficient on GPU), no mask.
SUPPORTED_CORE_ATTENTION = "sdpa"
_DROPPED_KEYS = ("labels", "attention_mask", "cu_seq_lens")

Spans = list[list[tuple[int, int]]]


@dataclass
class SequenceShard:
    """The sequence-parallel group of this rank and the layout of the batch being trained.

    Args:
        size: Ranks per group (``sequence_parallel_size``).
        rank: This rank's place in its group (which slice of every sequence it holds).
        group: The group's process group (the all-to-alls run on it).
        spans: ``[start, end)`` of every document of every row of the current batch, over the whole padded
            sequence; ``None`` when every row is one sequence (one causal attention call for the batch).
    """

    size: int
    rank: int
    group: Any
    spans: Spans | None = None


_ACTIVE: SequenceShard | None = None  # one model trains per process; set by the strategy before its first step


# ----------------------------------------------------------------------------------------------- settings
def model_problems(config: Any, size: int) -> list[str]:
    """Why the model of ``config`` cannot split its sequences over ``size`` ranks (empty when it can)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = []
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        return [f"{type(config).__name__} has no num_attention_heads: sequence parallelism splits attention heads."]
    if heads % size:
        problems.append(
            f"the model's {heads} attention heads do not divide into sequence_parallel_size={size} groups: use a "
            f"sequence_parallel_size that divides {heads}."
        )
    if kv_heads % size and size % kv_heads:
        problems.append(
            f"the model's {kv_heads} key/value heads and sequence_parallel_size={size}: one must divide the other "
            "(each rank takes kv_heads/N heads, or each head is repeated on N/kv_heads ranks)."
        )
    implementation = attention_implementation(config)
    if implementation not in (SUPPORTED_CORE_ATTENTION, ULYSSES_ATTENTION):
        problems.append(
            f"attn_implementation={implementation!r} cannot be split over ranks: sequence parallelism runs attention "
            f"through 'sdpa' (torch's flash / memory-efficient kernels, packed documents kept apart); set "
            "model.attn_implementation: sdpa."
        )
    problems += _window_problems(text)
    return problems


def _window_problems(text: Any) -> list[str]:
    """Sliding-window layers: a model that names its layers' kinds (``layer_types``: Qwen2/3, Gemma) has windows
    only where it says so; one that does not (Mistral) windows every layer whenever ``sliding_window`` is set."""
    layer_types = getattr(text, "layer_types", None) or []
    windowed = [kind for kind in layer_types if kind != "full_attention"]
    window = getattr(text, "sliding_window", None)
    if windowed or getattr(text, "use_sliding_window", False):
        kind = windowed[0] if windowed else "sliding_attention"
    elif not layer_types and window is not None:
        return [
            f"the model attends over a sliding window of {window} tokens in every layer: sequence parallelism "
            "computes full causal attention only; for sequences no longer than the window (where the two agree) set "
            "model.config_overrides: {sliding_window: null}, else train without sequence_parallel_size."
        ]
    else:
        return []
    return [
        f"the model has {kind} layers: sequence parallelism computes full causal attention only; train this model "
        "without sequence_parallel_size."
    ]


def raise_if_unsplittable(config: Any, size: int, world_size: int) -> None:
    """Raise one ``GymUserError`` listing every reason the run cannot use ``size``-way sequence parallelism."""
    raise_if_problems("Invalid sequence parallelism", world_problems(size, world_size) + model_problems(config, size))


# ----------------------------------------------------------------------------------------------- groups
def new_sequence_group(dims: ParallelDims) -> tuple[Any, int]:
    """This rank's sequence group (``dims.sequence_groups()``) and its place in it. Every rank creates every group,
    in the same order, as ``torch.distributed.new_group`` requires."""
    rank = torch.distributed.get_rank()
    mine = None
    for ranks in dims.sequence_groups():
        group = torch.distributed.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine, dims.sequence_rank(rank)


# ----------------------------------------------------------------------------------------------- data
def document_spans(position_ids: torch.Tensor) -> Spans | None:
    """``[start, end)`` of every document of every row: a document starts where the position does not continue
    the previous one (transformers' ``find_packed_sequence_indices`` rule); ``None`` when no row has a second one."""
    restarts = torch.ones_like(position_ids, dtype=torch.bool)
    restarts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(restarts[:, 1:].any()):
        return None
    width = position_ids.size(1)
    spans = []
    for row in restarts.cpu():
        starts = row.nonzero().flatten().tolist()
        spans.append(list(zip(starts, [*starts[1:], width], strict=True)))
    return spans


def _padded(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.size(1)), value=value)


def shard_batch(batch: dict[str, Any], size: int, rank: int) -> tuple[dict[str, Any], Spans | None]:
    """This rank's slice of a training batch, and the documents of the whole padded rows.

    The rows are padded to a multiple of ``size`` (no targets there); ``labels`` become ``shift_labels`` (each
    position's next-token target, so that the last token of a slice keeps its target from the next slice); the
    attention mask goes (right padding only trails the tokens, which causal attention never lets them see) and
    position ids of unpacked rows continue over their padding, so that a padded row stays one sequence.
    """
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise GymUserError(
            "sequence parallelism needs right-padded training rows (padding after the tokens), and this batch has "
            "padding before them: pad training rows on the right (CausalLMDataModule's collator does) or pack them."
        )
    width = -(-ids.size(1) // size) * size
    if "attention_mask" in batch or "position_ids" not in batch:  # unpacked rows: one sequence each
        positions = torch.arange(width, device=ids.device).expand(ids.size(0), width)
    else:  # packed rows: documents restart at 0; the padding continues the last one
        positions = batch["position_ids"]
        tail = positions[:, -1:] + torch.arange(1, width - positions.size(1) + 1, device=ids.device)
        positions = torch.cat([positions, tail], dim=1)
    shifted = _padded(batch["labels"][:, 1:], width, IGNORE_INDEX)
    local = slice(rank * width // size, (rank + 1) * width // size)
    out = {k: v for k, v in batch.items() if k not in _DROPPED_KEYS}
    out["input_ids"] = _padded(ids, width, 0)[:, local]
    out["position_ids"] = positions[:, local]
    out[SHIFT_LABELS_KEY] = shifted[:, local]
    if STEP_TOKENS_KEY in batch:  # every rank of the group carries the whole batch's count
        out[STEP_TOKENS_KEY] = batch[STEP_TOKENS_KEY].to(torch.float32) / size
    return out, document_spans(positions)


# ----------------------------------------------------------------------------------------------- attention
class _AllToAll(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` over dimension 0 with its gradient: the same exchange, backwards.

    By hand on the public collective: ``torch.distributed.nn.functional.all_to_all_single`` is deprecated since
    torch 2.13 for the private ``torch.distributed._functional_collectives``.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(tensor)
        torch.distributed.all_to_all_single(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def _to_whole_sequence(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[B, H, L/N, D]`` local tokens of all heads -> ``[B, H/N, L, D]`` all tokens of this rank's heads."""
    b, h, n, d = x.shape
    send = x.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()
    received = _AllToAll.apply(send, group)  # [source rank = slice, B, H/N, L/N, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _to_local_tokens(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[B, H/N, L, D]`` -> ``[B, H, L/N, D]``: the inverse of ``_to_whole_sequence``."""
    b, h, n, d = x.shape
    send = x.reshape(b, h, size, n // size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _AllToAll.apply(send, group)  # [source rank = heads, B, H/N, L/N, D]
    return received.transpose(0, 1).reshape(b, size * h, n // size, d)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: Spans | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention of ``[B, H, L, D]`` queries over grouped keys/values, each document on its own.

    Written by hand because sdpa takes either ``is_causal`` (no document boundaries) or a dense ``[L, L]`` mask
    (what the exchange exists to avoid at 100k tokens): packed documents are attended one by one, each causal.
    """

    # Grouped-query attention inside sdpa (enable_gqa, as transformers' sdpa does): k and v are saved for backward
    # at their own width, not repeated to the query heads.
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = q.size(1) != k.size(1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa)

    if spans is None:
        return attend(query, key, value)
    rows = []
    for row, documents in enumerate(spans):
        pick = [(slice(row, row + 1), slice(None), slice(a, b)) for a, b in documents]
        rows.append(torch.cat([attend(query[p], key[p], value[p]) for p in pick], dim=2))
    return torch.cat(rows, dim=0)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over this rank's slice of the sequence: ``[B, H, L/N, D]``
    queries/keys/values in, ``[B, L/N, H, D]`` out (what ``sdpa_attention_forward`` returns). The mask is ignored:
    the model built none (``no_mask``), and causality and documents come from the batch (``SequenceShard.spans``)."""
    shard = _ACTIVE
    if shard is None:
        raise RuntimeError(f"attn_implementation={ULYSSES_ATTENTION!r} is set by a sequence-parallel strategy only.")
    size, group = shard.size, shard.group
    if key.size(1) < size:  # fewer key/value heads than ranks: each rank gets a copy of its query heads' one
        key, value = key.repeat_interleave(size // key.size(1), 1), value.repeat_interleave(size // value.size(1), 1)
    q, k, v = (_to_whole_sequence(x, size, group) for x in (query, key, value))
    out = causal_attention(q, k, v, shard.spans, scaling, dropout if module.training else 0.0)
    return _to_local_tokens(out, size, group).transpose(1, 2).contiguous(), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of ``ULYSSES_ATTENTION``: none. A local slice's mask would describe the wrong sequence,
    and a packed slice's would be a dense ``[L/N, L/N]`` tensor."""
    return None


def register_ulysses_attention() -> None:
    """Register the exchange with transformers under ``ULYSSES_ATTENTION`` (idempotent).

    Why not DeepSpeed's ``UlyssesSPAttentionHF`` (deepspeed/runtime/sequence_parallel/ulysses_sp.py, 0.19.8), whose
    exchange this follows: it fixes the micro-batch size when it is built (and asserts every batch's shape), talks
    through ``deepspeed.comm`` (not started under gym_fsdp or gym_ddp), replaces transformers' ``sdpa`` entry for every
    model of the process, and drops the attention mask while sdpa's ``is_causal`` ignores document boundaries, so packed
    rows would attend across documents (its flex_attention path also rebuilds a plain causal mask). Here the exchange is
    registered under its own attention name, set on this model's config for training steps only, and packed documents
    are kept apart (``causal_attention``).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, no_mask)


def activate(shard: SequenceShard | None) -> None:
    """Make ``shard`` the group the exchange runs on (``None``: none)."""
    global _ACTIVE
    _ACTIVE = shard


def hf_config(root: nn.Module) -> Any:
    """The config of the first Hugging Face model inside ``root`` (a LightningModule), or ``None``."""
    for module in root.modules():
        config = getattr(module, "config", None)
        if config is not None and attention_implementation(config) is not None:
            return config
    return None
