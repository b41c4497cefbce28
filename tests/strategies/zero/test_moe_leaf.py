"""Mixtures of experts under ZeRO-3: their blocks are found from the model (``models.moe``) and made leaf modules.

The 2-rank test routes rank 0's tokens only to expert 0 and rank 1's only to expert 1, experts being separate modules
that run only when they received tokens (tests/helpers/moe_worker.py). Without the leaf marking ZeRO-3 gathers expert 0
on rank 0 while rank 1 gathers expert 1: equal sizes, so gloo pairs the two all-gathers and each rank assembles an
"expert" from halves of both; training ends without an error and with wrong weights (the control run below). Ranks
that run different numbers of experts abort instead (gloo: "Received data size doesn't match expected size. Is there
a distributed collective mismatch in your code?").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers.dist import HELPERS, run_ranks
from helpers.families import MOE_FAMILIES, family_config
from helpers.moe_worker import PerExpertMoE, reference_state
from torch import nn

from gym_lightning.models.moe import moe_block_classes, moe_blocks
from gym_lightning.strategies.zero.leaf import mark_moe_leaf_modules

STEPS = 3
# Each family's MoE block class and the layers that have one (DeepSeek-V3's first layer is dense here).
FAMILY_BLOCKS = {
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", [0, 1]),
    "mixtral": ("MixtralSparseMoeBlock", [0, 1]),
    "gpt_oss": ("GptOssMLP", [0, 1]),
    "deepseek_v3": ("DeepseekV3MoE", [1]),
}


def _meta_model(family: str, **overrides: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_config(family, **overrides))


def _block_names(model: nn.Module) -> list[str]:
    found = {id(block) for block in moe_blocks(model)}
    return [name for name, module in model.named_modules() if id(module) in found]


# ------------------------------------------------------------------------------------------------- finding blocks


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_blocks_of_transformers_families_come_from_the_expert_parallel_plan(family: str) -> None:
    model = _meta_model(family)
    cls_name, layers = FAMILY_BLOCKS[family]
    assert [cls.__name__ for cls in moe_block_classes(model)] == [cls_name]
    assert _block_names(model) == [f"model.layers.{i}.mlp" for i in layers]
    # Their experts are one module of 3-D tensors, not a ModuleList: only the plan can name them.
    model.config.base_model_ep_plan = None
    assert moe_blocks(model) == []


def test_dense_model_has_no_blocks() -> None:
    assert moe_blocks(_meta_model("llama")) == []


class _PlanConfig:
    # As in transformers' Gemma 4: the experts hang directly off the decoder layer, which is then the block.
    base_model_ep_plan: ClassVar[dict[str, str]] = {
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.experts.gate_up_proj": "grouped_gemm",
        "layers.*.experts": "ep_dispatch_experts",
    }


class _FusedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 4))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(4, 4)
        self.experts = _FusedExperts()


class _Base(nn.Module):
    def __init__(self, config: _PlanConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(_Layer() for _ in range(2))


class _ForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _PlanConfig()  # shared with the base model: its names ("model.layers.0...") must not match
        self.model = _Base(self.config)


def test_plan_rules_are_relative_to_the_base_model_and_only_experts_rules_count() -> None:
    model = _ForCausalLM()
    assert _block_names(model) == ["model.layers.0", "model.layers.1"]  # not the dense mlp of the gate_proj rule


class _Wrapper(nn.Module):
    """A model without any plan, MoE blocks with one module per expert (transformers 4, remote code)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PerExpertMoE(4) for _ in range(2))
        self.dense = nn.Module()
        self.dense.experts = nn.Linear(4, 4)  # not a ModuleList: not a block
        self.dense.layers = nn.ModuleList([nn.Linear(4, 4)])  # a ModuleList not named experts: not a block


def test_blocks_with_a_module_list_of_experts() -> None:
    model = _Wrapper()
    assert _block_names(model) == ["blocks.0", "blocks.1"]
    assert moe_block_classes(model) == [PerExpertMoE]


def test_mark_moe_leaf_modules_flags_every_block_instance() -> None:
    from deepspeed.utils import get_z3_leaf_modules

    model = _Wrapper()
    assert mark_moe_leaf_modules(model) == [PerExpertMoE]
    assert get_z3_leaf_modules(model) == list(model.blocks)
    dense = nn.Sequential(nn.Linear(4, 4))
    assert mark_moe_leaf_modules(dense) == [] and get_z3_leaf_modules(dense) == []


# ------------------------------------------------------------------------------------------ 2 ranks, divergent routing


@pytest.fixture(scope="module")
def divergent_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank launch: the run with gym_lightning's leaf marking, then the control run without it."""
    out = tmp_path_factory.mktemp("moe")
    phases = [{"name": "leaf", "leaf": True}, {"name": "without_leaf", "leaf": False}]
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({"out": str(out), "steps": STEPS, "timeout_s": 60, "phases": phases}))
    run_ranks([str(HELPERS / "moe_worker.py"), str(spec_path)], timeout=300)
    return torch.load(Path(out) / "result.pt", weights_only=True)


@pytest.mark.slow
def test_zero3_with_divergent_routing_trains_like_one_process(divergent_runs: dict[str, Any]) -> None:
    run, expected = divergent_runs["leaf"], reference_state(STEPS)
    assert run["global_step"] == STEPS
    assert run["state"].keys() == expected.keys()
    for key, value in expected.items():  # fp32, 3 SGD steps: observed differences ~3e-8
        torch.testing.assert_close(run["state"][key], value, rtol=0, atol=1e-6, msg=f"weights differ at {key}")


@pytest.mark.slow
def test_without_leaf_blocks_divergent_routing_trains_wrong_weights(divergent_runs: dict[str, Any]) -> None:
    # The control: shows the test above can fail. Observed: up to 0.24 off, as large as the 3 steps' updates.
    run, expected = divergent_runs["without_leaf"], reference_state(STEPS)
    assert run["global_step"] == STEPS
    assert max(float((run["state"][key] - value).abs().max()) for key, value in expected.items()) > 1e-2
