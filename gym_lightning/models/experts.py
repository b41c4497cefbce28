"""LoRA on the fused experts of a mixture of experts, computed for the routed experts only.

transformers 5 holds a MoE layer's routed experts as two fused 3-D weights (``experts.gate_up_proj [E, 2I, h]``,
``experts.down_proj [E, h, I]``; gpt-oss transposed, with biases), not as ``nn.Linear`` layers. peft (>= 0.17) adapts
them through ``LoraConfig(target_parameters=...)``: its ``ParamWrapper`` keeps per-expert factors in two matrices
(``lora_A [r*E, in]``, ``lora_B [out, r*E]``) and, in every forward, parametrises the whole weight as ``W + B @ A``
for all E experts (1.2 GB in 16 bits for one Qwen3-30B-A3B layer: 128 x 2 x 1536 x 2048 + 128 x 2048 x 768), which it
cannot do for 4-bit codes at all, and it refuses dropout (a merged delta has no input to drop).

Here the experts' forward is gym's (:func:`route_experts`): for each expert the batch routes to, and only those, the
expert's weight (a view of the fused tensor, or the NF4 codes of that one expert dequantised,
``quant.experts.dequantize_expert``) is applied to its tokens, and the adapter is the low-rank path
``scaling * (dropout(x) @ A_e.T) @ B_e.T``, as peft's ``lora.Linear`` computes it. The (token, slot) pairs are
sorted by expert on the device and the group bounds read once: one host sync per MoE layer and pass
(:func:`group_by_expert`; a grouped GEMM would need none, but it takes bf16 only, and NF4 experts must be known on
the host to be dequantised one by one). peft still owns the adapter tensors and their names, so checkpoints,
``PeftModel.save_pretrained``'s file format and ``merge_and_unload`` are peft's. The routing, the gate and the
weighting are the experts module's own (``_apply_gate``, ``act_fn``, the transformers ``use_experts_implementation``
attributes), so one forward serves every family that uses them.
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gym_lightning.lora import ExpertTargets
from gym_lightning.models.moe import EXPERTS, moe_blocks
from gym_lightning.quant import experts as nf4_experts
from gym_lightning.quant.experts import EXPERT_WEIGHTS

# The names families give their always-on shared experts (DeepSeek-V2/V3 ``shared_experts``, Qwen2-MoE
# ``shared_expert``, Llama 4 ``shared_expert``): nn.Linear layers, adapted by their weights (``ExpertTargets.shared``).
SHARED = ("shared_experts", "shared_expert")


@dataclass
class ExpertAdapter:
    """One expert weight's LoRA factors in peft's layout, as the routed forward reads them.

    Args:
        a: ``lora_A.weight`` ``[r * E, in]``: expert e's rows are ``a.view(E, r, in)[e]``.
        b: ``lora_B.weight`` ``[out, r * E]``: expert e's columns are ``b.view(out, r, E)[:, :, e]``.
        scaling: ``alpha / r``.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def per_expert(self, num_experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(A_e [r, in], B_e [out, r])`` of every expert: views made by one ``unbind`` per factor, with no index
        (an index of the routed experts would be host data copied to the device). Autograd then writes each
        factor's gradient once: ``unbind``'s backward stacks the routed experts' gradients beside broadcast zeros
        for the rest. Indexing ``a.view(E, r, in)[e]`` per expert gave each expert a zero-filled gradient of the
        whole ``[r E, in]`` factor to sum (E^2 work)."""
        a = self.a.view(num_experts, -1, self.a.shape[-1]).unbind(0)
        b = self.b.view(self.b.shape[0], -1, num_experts).unbind(2)
        return list(zip(a, b, strict=True))

    def delta(
        self, x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], dropout: float, training: bool
    ) -> torch.Tensor:
        """``scaling * (dropout(x) @ A_e.T) @ B_e.T`` in the adapters' dtype (peft's ``lora.Linear`` order)."""
        a_e, b_e = factors
        x = nn.functional.dropout(x, dropout, training) if dropout else x
        return (x.to(a_e.dtype) @ a_e.t()) @ b_e.t() * self.scaling


def experts_slots(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(MoE block, its experts slot)`` for every MoE block whose ``experts`` child holds fused 3-D weights; the
    slot is the experts module itself or the outermost peft wrapper around it."""
    found = []
    for block in moe_blocks(model):
        slot = getattr(block, EXPERTS, None)
        if isinstance(slot, nn.Module) and any(name in _weights(base_experts(slot)) for name in EXPERT_WEIGHTS):
            found.append((block, slot))
    return found


def base_experts(slot: nn.Module) -> nn.Module:
    """The experts module inside peft's (nested) ``ParamWrapper``s."""
    while _is_param_wrapper(slot):
        slot = slot.base_layer
    return slot


def _is_param_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "ParamWrapper" or any(c.__name__ == "ParamWrapper" for c in type(module).__mro__)


def _weights(experts: nn.Module) -> dict[str, nn.Parameter]:
    return dict(experts.named_parameters(recurse=False))


def expert_targets(model: nn.Module) -> ExpertTargets:
    """The model's names for ``lora.target_parameters: [all-experts]``: its routed experts' fused weights (as peft
    matches them: ``experts.gate_up_proj``), its shared experts' linear layers and its routers' (the linear layers
    an MoE block holds itself), each found from the model's modules."""
    parameters: set[str] = set()
    shared: set[str] = set()
    routers: list[str] = []
    names = {id(module): name for name, module in model.named_modules()}
    for block in moe_blocks(model):
        experts = getattr(block, EXPERTS, None)
        if isinstance(experts, nn.Module):
            parameters |= {f"{EXPERTS}.{name}" for name in EXPERT_WEIGHTS if name in _weights(base_experts(experts))}
        for child_name, child in block.named_children():
            if child_name in SHARED:
                shared |= {f"{child_name}.{n}.weight" for n, m in child.named_modules() if isinstance(m, nn.Linear)}
            elif isinstance(child, nn.Linear):  # a router (Qwen2-MoE's gate, shared_expert_gate)
                routers.append(f"{names[id(block)]}.{child_name}")
    return ExpertTargets(tuple(sorted(parameters)), tuple(sorted(shared)), tuple(routers))


def install_routed_experts(model: nn.Module, dropout: float = 0.0) -> int:
    """Give every experts slot whose weights have LoRA adapters or are NF4 gym's routed forward
    (:func:`route_experts`), and every peft ``ParamWrapper`` around a linear layer (a shared expert targeted by
    parameter) the low-rank forward of :func:`_adapted_linear_forward`; ``dropout`` applies to those adapters'
    inputs in training. Returns how many experts slots were given the routed forward."""
    count = 0
    slots = {id(slot) for _, slot in experts_slots(model)}
    for _, slot in experts_slots(model):
        experts = base_experts(slot)
        nf4 = any(nf4_experts.is_nf4(experts, name) for name in EXPERT_WEIGHTS)
        if slot is experts and not nf4:
            continue  # plain 16-bit experts keep transformers' forward (grouped_mm on a GPU)
        slot.__dict__["_gym_expert_dropout"] = dropout
        slot.forward = types.MethodType(_routed_forward, slot)
        count += 1
    for module in list(model.modules()):
        wrapped_linear = _is_param_wrapper(module) and isinstance(base_experts(module), nn.Linear)
        if id(module) not in slots and wrapped_linear and not _is_param_wrapper_inside(model, module):
            module.__dict__["_gym_expert_dropout"] = dropout
            module.forward = types.MethodType(_adapted_linear_forward, module)
    return count


def _is_param_wrapper_inside(model: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` is the ``base_layer`` of another ParamWrapper (only the outermost gets the forward)."""
    return any(_is_param_wrapper(m) and m.base_layer is module for m in model.modules())


def _adapted_linear_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A linear layer adapted through peft's ``ParamWrapper`` (a shared expert, or a layer ``lora.lora_config_for``
    names by its weight): ``base(x)`` plus each active adapter's ``lora_B(lora_A(dropout(x))) * scaling``, as peft's
    ``lora.Linear`` computes it (peft's wrapper would add the whole ``[out, in]`` delta to the weight, and refuses
    dropout). The adapter layers are called, not read: outside a ZeRO-3 leaf module their call gathers them."""
    y = base_experts(self)(x, *args, **kwargs)
    if self.disable_adapters or self.merged:
        return y
    dropout = self.__dict__.get("_gym_expert_dropout", 0.0)
    for adapter in self.active_adapters:
        if adapter in self.lora_A:
            a, b = self.lora_A[adapter], self.lora_B[adapter]
            h = nn.functional.dropout(x, dropout, self.training) if dropout else x
            y = y + (b(a(h.to(a.weight.dtype))) * self.scaling[adapter]).to(y.dtype)
    return y


def _routed_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts slot's forward: its adapters (peft's wrappers, outermost first) collected, then routed."""
    return route_experts(
        base_experts(self),
        hidden_states,
        top_k_index,
        top_k_weights,
        adapters_of(self),
        dropout=self.__dict__.get("_gym_expert_dropout", 0.0),
    )


def adapters_of(slot: nn.Module) -> dict[str, list[ExpertAdapter]]:
    """``{weight name: its active adapters}`` of an experts slot (none when adapters are disabled or merged)."""
    found: dict[str, list[ExpertAdapter]] = {}
    while _is_param_wrapper(slot):
        if not slot.disable_adapters and not slot.merged:
            for adapter in slot.active_adapters:
                if adapter in slot.lora_A:
                    found.setdefault(slot.parameter_name, []).append(
                        ExpertAdapter(slot.lora_A[adapter].weight, slot.lora_B[adapter].weight, slot.scaling[adapter])
                    )
        slot = slot.base_layer
    return found


@dataclass(frozen=True)
class ExpertGroups:
    """The (token, slot) pairs a batch routes to the experts, grouped by expert (ascending) on the device.

    Args:
        tokens: ``[n]`` the token of each routed pair, expert by expert; within an expert by slot, then token.
        slots: ``[n]`` the pair's top-k slot (its column of ``top_k_index`` and ``top_k_weights``).
        counts: The pairs of each of the E experts, on the host: the one value the forward reads from the device.
    """

    tokens: torch.Tensor
    slots: torch.Tensor
    counts: list[int]

    @property
    def hit(self) -> list[int]:
        """The experts that receive a pair, ascending."""
        return [e for e, count in enumerate(self.counts) if count]


def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> ExpertGroups:
    """``top_k_index`` ``[T, k]``'s pairs sorted by expert with device ops alone (a stable sort, then each expert's
    first pair by ``searchsorted``; no ``nonzero``, no ``bincount``, whose CUDA kernel reads the largest index), and
    the E + 1 group bounds read once (one ``tolist``: the forward's only host sync, which its per-expert loop
    needs; transformers' ``grouped_mm`` fallback pays the same one read). An index >= E, expert parallelism's
    sentinel, sorts after every expert and is no pair. The pairs are listed slot-major (pair ``s * T + t``), the
    order ``torch.where`` gave on the one-hot ``[E, k, T]`` mask of transformers' eager forward, so each expert's
    rows and the output's sums come in the order they always did."""
    num_tokens = top_k_index.shape[0]
    with torch.no_grad():
        experts_of_pairs, order = torch.sort(top_k_index.t().reshape(-1), stable=True)
        starts = torch.arange(num_experts + 1, device=experts_of_pairs.device, dtype=experts_of_pairs.dtype)
        bounds = torch.searchsorted(experts_of_pairs, starts).tolist()
    order = order[bounds[0] : bounds[-1]]
    counts = [end - start for start, end in itertools.pairwise(bounds)]
    return ExpertGroups(order % num_tokens, order // num_tokens, counts)


def route_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    adapters: dict[str, list[ExpertAdapter]] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """transformers' eager experts forward (``[T, h]`` tokens, ``[T, k]`` expert indices and weights), with each
    routed expert's weight from :func:`expert_matmul` and its adapters' low-rank path added: only the experts the
    tokens were sent to are touched. The pairs are grouped on the device (:func:`group_by_expert`, one host read
    per call); the tokens and routing weights are gathered once and split by expert (one gather each, whose
    backward is one scatter, where a gather per expert made a whole ``[T, h]`` gradient per expert)."""
    adapters = adapters or {}
    out = torch.zeros_like(hidden_states)
    num_experts = experts.num_experts
    groups = group_by_expert(top_k_index, num_experts)
    if not groups.hit:
        return out
    tokens = groups.tokens.split(groups.counts)
    inputs = hidden_states[groups.tokens].split(groups.counts)
    weights = top_k_weights[groups.tokens, groups.slots].split(groups.counts)
    factors = {name: [(a, a.per_expert(num_experts)) for a in found] for name, found in adapters.items()}
    for e in groups.hit:
        routed = {name: [(a, f[e]) for a, f in found] for name, found in factors.items()}
        gate_up = _project(experts, "gate_up_proj", e, inputs[e], routed.get("gate_up_proj", []), dropout)
        h = experts._apply_gate(gate_up) if getattr(experts, "has_gate", True) else experts.act_fn(gate_up)
        y = _project(experts, "down_proj", e, h, routed.get("down_proj", []), dropout)
        out.index_add_(0, tokens[e], (y * weights[e][:, None]).to(out.dtype))
    return out


def _project(
    experts: nn.Module,
    name: str,
    e: int,
    x: torch.Tensor,
    adapters: list[tuple[ExpertAdapter, tuple[torch.Tensor, torch.Tensor]]],
    dropout: float,
) -> torch.Tensor:
    """Expert ``e``'s projection ``name`` of ``x``: weight, bias (gpt-oss), then each adapter's low-rank path (the
    adapter and expert e's factors)."""
    y = expert_matmul(experts, name, e, x)
    bias = getattr(experts, f"{name}_bias", None)
    if bias is not None and getattr(experts, "has_bias", True):
        y = y + bias[e]
    for adapter, factors in adapters:
        y = y + adapter.delta(x, factors, dropout, experts.training).to(y.dtype)
    return y


def expert_matmul(experts: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` through expert ``e``'s weight ``name``: a view of the fused 16-bit tensor (``x @ W_e`` when the experts
    store ``[in, out]``, gpt-oss; ``x @ W_e.T`` otherwise), or that expert's NF4 codes dequantised in forward and
    again in backward (:class:`_NF4ExpertMatmul`), never the whole stack."""
    transposed = getattr(experts, "is_transposed", False)
    if nf4_experts.is_nf4(experts, name):
        return _NF4ExpertMatmul.apply(x, experts, name, e, transposed)
    weight = getattr(experts, name)[e]
    return x @ weight if transposed else nn.functional.linear(x, weight)


class _NF4ExpertMatmul(torch.autograd.Function):
    """``x @ W_e`` (or ``x @ W_e.T``) with expert e's NF4 weight dequantised in forward and again in backward: only
    the codes are kept between them (``quant.linear._NF4Matmul``'s rule, per expert)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, experts: nn.Module, name: str, e: int, transposed: bool) -> torch.Tensor:
        weight = nf4_experts.dequantize_expert(experts, name, e)
        ctx.experts, ctx.name, ctx.e, ctx.transposed, ctx.input_dtype = experts, name, e, transposed, x.dtype
        out = x.to(weight.dtype) @ (weight if transposed else weight.t())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight = nf4_experts.dequantize_expert(ctx.experts, ctx.name, ctx.e)
        grad_x = grad.to(weight.dtype) @ (weight.t() if ctx.transposed else weight)
        return grad_x.to(ctx.input_dtype), None, None, None, None


__all__ = [
    "EXPERT_WEIGHTS",
    "ExpertAdapter",
    "ExpertGroups",
    "adapters_of",
    "base_experts",
    "expert_matmul",
    "expert_targets",
    "experts_slots",
    "group_by_expert",
    "install_routed_experts",
    "route_experts",
]
