"""gym's routed experts forward (``models.experts.route_experts``) stops the host once per MoE layer, and computes
what the per-expert forward it replaced computed (``benchmarks.common.routed_reference``: main at e2e4f84).

The census (``sync_census``) stands in for a GPU: a CPU run performs no copy and waits for nothing, so the
census counts what would stop the host on CUDA, at two levels: the Python API (``tolist``, ``numpy``, device moves,
which a CPU run does without an aten op) and aten ops (``item``-like reads, ``nonzero`` and other outputs sized by
the data, ``lift_fresh``: host data becoming a tensor, a blocking copy to the device on a GPU). It shows which ops
of the forward and backward would block; it cannot show syncs inside a CUDA kernel it does not list, the caching
allocator's, or stream ordering (the helper's docstring). torch's FakeTensorMode with fake ``cuda`` tensors is the
other stand-in: there a data-dependent op raises, so it proves a piece sync-free; it is used below for the device
half of the grouping (everything before its one read), which must run on CUDA semantics without a read.

Before (e2e4f84), per call of the forward and backward of one experts slot with two adapters: ``nonzero`` 1 + one
per routed expert, ``tolist`` 1, ``lift_fresh`` (an index made from the host list) 1 per adapter (and on a CPU the
one-hot mask's two value checks, which CUDA skips). Now: one ``tolist`` (the experts' group bounds) and nothing else.
"""

from __future__ import annotations

import pytest
import torch
from helpers.families import family_config
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM

from benchmarks.common.routed_reference import reference_route_experts
from benchmarks.common.sync_census import SyncCensus
from gym_lightning.lora import EXPERTS_SHORTHAND, LoRAArgs, apply_lora
from gym_lightning.models import experts as routed
from gym_lightning.models.experts import (
    adapters_of,
    base_experts,
    expert_targets,
    experts_slots,
    install_routed_experts,
)
from gym_lightning.quant import QuantizationArgs, nf4
from gym_lightning.quant import experts as nf4_experts

TOKENS, DROPOUT = 24, 0.3
NF4 = QuantizationArgs(block_size=32, compute_dtype="float32")  # both expert weights of the tiny families


def _model(family: str, quantized: bool = False, **overrides: int) -> torch.nn.Module:
    """The tiny ``family`` model in fp32 with LoRA r=4 on all its experts (random factors: lora_B starts at 0), its
    expert weights in NF4 (random codes of random weights) if ``quantized``."""
    torch.manual_seed(0)
    config = family_config(family, **overrides)
    if quantized:
        model_class = type(AutoModelForCausalLM.from_config(config))
        with nf4_experts.experts_built_as_nf4(nf4_experts.experts_classes(model_class), NF4):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for experts, name in nf4_experts.nf4_expert_weights(model).values():
            weight = torch.randn(nf4_experts.logical_shape(experts, name)) * 0.05
            for part, value in nf4.quantize(weight, NF4.block_size, NF4.double_quant).items():
                nf4_experts.parts_of(experts, name)[part].data.copy_(value)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = apply_lora(model, LoRAArgs(r=4, alpha=8, target_parameters=[EXPERTS_SHORTHAND]), expert_targets(model))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape) * 0.1)
    return model.train()


def _routing(num_experts: int, top_k: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """Seeded tokens, top-k indices (two of them expert parallelism's sentinel, E) and routing weights."""
    generator = torch.Generator().manual_seed(3)
    index = torch.rand(TOKENS, num_experts, generator=generator).topk(top_k).indices
    index[3, 1] = index[7, 0] = num_experts
    hidden_states = torch.randn(TOKENS, hidden, generator=generator)
    return hidden_states, index, torch.rand(TOKENS, top_k, generator=generator)


def _run(forward: object, slot: torch.nn.Module, routing: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """``forward`` of the slot's experts with its adapters and dropout, then a backward: the output and the
    gradients of the tokens, the routing weights and every adapter factor. The dropout draws from a fixed seed."""
    experts = base_experts(slot)
    hidden_states, index, weights = (t.clone().requires_grad_(t.is_floating_point()) for t in routing)
    slot.zero_grad()
    torch.manual_seed(11)
    out = forward(experts, hidden_states, index, weights, adapters_of(slot), dropout=DROPOUT)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in slot.named_parameters() if p.requires_grad}
    return {"out": out.detach(), "d tokens": hidden_states.grad, "d weights": weights.grad, **grads}


TOP8 = {"num_experts": 16, "num_experts_per_tok": 8}  # Qwen3-30B-A3B's top-k: 8 contributions summed per token
CASES = [("qwen3_moe", False, {}), ("qwen3_moe", False, TOP8), ("gpt_oss", False, {}), ("qwen3_moe", True, {}),
         ("gpt_oss", True, {})]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "quantized", "overrides"),
    CASES,
    ids=["qwen3_moe", "qwen3_moe-top8", "gpt_oss", "qwen3_moe-nf4", "gpt_oss-nf4"],
)
def test_the_routed_forward_reads_the_device_once_and_keeps_its_numbers(
    family: str, quantized: bool, overrides: dict[str, int]
) -> None:
    """Forward and backward of one experts slot (LoRA on both weights, dropout, two sentinel pairs): one host read
    where the per-expert forward made one per routed expert and one per adapter; the output and every gradient
    within 1e-5 (fp32) of that forward's, with the same dropout draws (measured: all equal bit for bit but the
    tokens' gradient at top-8, 3e-8 apart: its 8 contributions summed in another order). Qwen3-MoE: [E, out, in]
    weights; gpt-oss: transposed, with biases; NF4: only the routed experts dequantised."""
    model = _model(family, quantized, **overrides)
    slot = experts_slots(model)[0][1]
    experts = base_experts(slot)
    assert all(nf4_experts.is_nf4(experts, name) is quantized for name in ("gate_up_proj", "down_proj"))
    routing = _routing(experts.num_experts, model.config.num_experts_per_tok, model.config.hidden_size)
    with SyncCensus() as before:
        expected = _run(reference_route_experts, slot, routing)
    with SyncCensus() as after:
        actual = _run(routed.route_experts, slot, routing)
    assert before.counts["shape", "nonzero"] > 1 and before.of("host data") == 2, before  # the census sees them
    assert dict(after.counts) == {("read", "tolist"): 1}, after
    assert actual.keys() == expected.keys() and sum("lora_A" in k for k in actual) == 2
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=1e-5, msg=key)


def test_a_training_step_reads_the_device_once_per_moe_layer() -> None:
    """A whole step of the installed forward (``install_routed_experts``, as ``gym fit`` installs it): every experts
    slot's forward and the backward through it stop the host once, whatever the number of routed experts."""
    model = _model("qwen3_moe")
    assert install_routed_experts(model, dropout=DROPOUT) == len(experts_slots(model)) == 2
    censuses: list[SyncCensus] = []

    def counted(hidden_states: torch.Tensor, *args: torch.Tensor, slot: torch.nn.Module) -> torch.Tensor:
        with SyncCensus() as census:
            out = routed._routed_forward(slot, hidden_states, *args)
        censuses.append(census)
        return out

    for _, slot in experts_slots(model):
        slot.forward = lambda h, i, w, slot=slot: counted(h, i, w, slot=slot)
    ids = (torch.arange(2 * 16).reshape(2, 16) * 7 + 3) % 500
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    with SyncCensus() as backward:
        loss.backward()
    assert [dict(c.counts) for c in censuses] == [{("read", "tolist"): 1}] * 2
    assert backward.total == 0, backward  # the backward of the whole model: nothing of the experts' stops the host


def test_the_grouping_runs_on_fake_cuda_tensors_up_to_its_one_read() -> None:
    """Under FakeTensorMode with fake ``cuda`` tensors any data-dependent op raises: the device half of
    ``group_by_expert`` (sort, bounds) runs there, and what stops it is its one read (``tolist``), nothing
    before."""
    with FakeTensorMode():
        index = torch.empty(TOKENS, 2, dtype=torch.long, device="cuda")
        with pytest.raises(Exception, match="_local_scalar_dense") as raised:
            routed.group_by_expert(index, 8)
    frames = [entry for entry in raised.traceback if entry.name == "group_by_expert"]
    assert frames and ".tolist()" in str(frames[-1].statement)


def test_the_speed_benchmark_times_both_forwards_and_counts_their_syncs() -> None:
    """``benchmarks.routed_forward_speed`` at its tiny size: both forwards timed, their syncs counted, their
    outputs and gradients equal (bf16, the same products in the same order), the table rendered."""
    from benchmarks import routed_forward_speed as bench

    result = bench.measure("tiny", 16, repeats=1)
    assert result["grouped"]["syncs"] == {"read: tolist": 1}, result["grouped"]["syncs"]
    assert result["per-expert"]["syncs"]["shape: nonzero"] > 1 and max(result["max_abs_diff"].values()) == 0
    table = bench.render({"tiny/16": result})
    assert table.startswith(bench.SECTION) and "| tiny | 16 |" in table
