"""The routed experts forward as it was before issue 55 (main at e2e4f84), kept as the numeric reference for
``models.experts.route_experts``: one expert at a time, the experts found with ``nonzero().tolist()``, each expert's
(slot, token) pairs with ``torch.where`` on a one-hot mask, each adapter's routed factors picked with an index made
from the host list. Every one of those is a host sync on a GPU (tests/models/test_routed_syncs.py counts them); the
arithmetic is what the new forward must reproduce (fp32 within 1e-5, forward and gradients), with the same dropout
draws in the same order. ``benchmarks.routed_forward_speed`` times it beside the new forward.
"""

from __future__ import annotations

import torch
from torch import nn

from gym_lightning.models.experts import ExpertAdapter, expert_matmul


def _routed_factors(adapter: ExpertAdapter, hit: list[int], num_experts: int) -> list[tuple[torch.Tensor, ...]]:
    index = torch.tensor(hit, device=adapter.a.device)
    a = adapter.a.view(num_experts, -1, adapter.a.shape[-1]).index_select(0, index).unbind(0)
    b = adapter.b.view(adapter.b.shape[0], -1, num_experts).index_select(2, index).unbind(2)
    return list(zip(a, b, strict=True))


def reference_route_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    adapters: dict[str, list[ExpertAdapter]] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``models.experts.route_experts`` at e2e4f84, unchanged but for the names."""
    adapters = adapters or {}
    out = torch.zeros_like(hidden_states)
    num_experts = experts.num_experts
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)[:num_experts]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    if not hit:
        return out
    factors = {name: [(a, _routed_factors(a, hit, num_experts)) for a in found] for name, found in adapters.items()}
    for j, e in enumerate(hit):
        top_k_pos, token_idx = torch.where(mask[e])
        x = hidden_states[token_idx]
        routed = {name: [(a, f[j]) for a, f in found] for name, found in factors.items()}
        gate_up = _project(experts, "gate_up_proj", e, x, routed.get("gate_up_proj", []), dropout)
        h = experts._apply_gate(gate_up) if getattr(experts, "has_gate", True) else experts.act_fn(gate_up)
        y = _project(experts, "down_proj", e, h, routed.get("down_proj", []), dropout)
        y = y * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _project(
    experts: nn.Module,
    name: str,
    e: int,
    x: torch.Tensor,
    adapters: list[tuple[ExpertAdapter, tuple[torch.Tensor, ...]]],
    dropout: float,
) -> torch.Tensor:
    y = expert_matmul(experts, name, e, x)
    bias = getattr(experts, f"{name}_bias", None)
    if bias is not None and getattr(experts, "has_bias", True):
        y = y + bias[e]
    for adapter, (a_e, b_e) in adapters:
        h = nn.functional.dropout(x, dropout, experts.training) if dropout else x
        y = y + ((h.to(a_e.dtype) @ a_e.t()) @ b_e.t() * adapter.scaling).to(y.dtype)
    return y
