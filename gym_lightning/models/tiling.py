"""Tiled MLP: a decoder layer's MLP run over a few thousand token positions at a time.

At long sequences the MLP's intermediate activations are the largest tensors of a layer: gate, up and
``act(gate) * up`` are ``[tokens, intermediate_size]`` each, 3.5x the hidden size for Llama-3-8B (14,336 / 4,096),
so 3 x 0.94 GB in bf16 for 32k local tokens, and activation checkpointing recreates them all when it recomputes the
layer in backward. The MLP treats every position on its own, so it can run on slices of the positions: each tile
runs under non-reentrant activation checkpointing, keeps only its input (a view of the layer's), and is recomputed
on its own in backward, so at most one tile's intermediates exist at any time (ALST's TiledMLP, arXiv 2506.13996).

Written with ``torch.utils.checkpoint`` rather than DeepSpeed's ``TiledMLP``
(deepspeed/runtime/sequence_parallel/ulysses_sp.py): that one runs each tile's backward inside its own backward
and holds back gradient reduction through ZeRO's ``ds_grad_is_ready`` flag, which DDP and FSDP2 do not have (its
own comment: "DDP, FSDP will need something similar"). Checkpointed tiles are ordinary autograd, so every strategy's
hooks see one gradient per parameter per step.

Under ZeRO-3 every call of a linear layer gathers its weight, a collective: every rank must run the same number of
tiles, unless the decoder layer is a leaf module gathered whole. The module sets the count before each training
forward (``TileCount``) as the strategy answers (``protocols.AgreesCallCounts``): the largest any rank needs where
tiles are collectives, this rank's own elsewhere (no rank waits for another), and tiling applies to
gradient-tracking forwards only (evaluation keeps no activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class TileCount:
    """How many tiles every tiled MLP splits its positions into during the next forward (``1``: no tiling)."""

    value: int = 1


def num_mlp_tiles(positions: int, tile_tokens: int) -> int:
    """Tiles of at most ``tile_tokens`` positions for ``positions`` (batch x local sequence) positions."""
    return max(1, math.ceil(positions / tile_tokens))


def _tiled_forward(forward: Any, count: TileCount, hidden: torch.Tensor) -> torch.Tensor:
    if count.value <= 1 or not torch.is_grad_enabled():
        return forward(hidden)
    flat = hidden.reshape(-1, hidden.size(-1))
    tiles = [checkpoint(forward, tile, use_reentrant=False) for tile in flat.tensor_split(count.value)]
    return torch.cat(tiles).reshape(*hidden.shape[:-1], -1)


def dense_mlps(model: nn.Module) -> list[nn.Module]:
    """The dense MLPs of a transformers decoder: modules named ``mlp`` whose class name ends in ``MLP`` (LlamaMLP,
    Qwen3MLP, ...). Mixture-of-experts blocks are left alone: their router records its logits on every call."""
    named = model.named_modules()
    return [m for name, m in named if name.rsplit(".", 1)[-1] == "mlp" and type(m).__name__.endswith("MLP")]


def tile_mlps(model: nn.Module, count: TileCount) -> int:
    """Make every dense MLP of ``model`` run in ``count.value`` checkpointed tiles; returns how many it tiled.

    The instance's ``forward`` is replaced (its class, parameters and names stay), so checkpoints, LoRA targets and
    the strategies' module hooks see the same model.
    """
    mlps = dense_mlps(model)
    for mlp in mlps:
        mlp.forward = partial(_tiled_forward, mlp.forward, count)
    return len(mlps)
