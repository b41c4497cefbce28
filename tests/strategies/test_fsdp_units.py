"""gym_fsdp's shard units for a mixture of experts: one per decoder layer, with the layer's experts inside, and the
run says so (no expert parallelism is offered)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.families import family_config
from transformers import AutoModelForCausalLM

from gym_lightning.strategies import GymFSDPStrategy


@pytest.mark.parametrize(("family", "experts"), [("qwen3_moe", True), ("deepseek_v3", True), ("llama", False)])
def test_a_moe_is_sharded_one_decoder_layer_per_unit_and_says_so(
    family: str, experts: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(family))
    holder = torch.nn.Module()
    holder.model = model
    with caplog.at_level(logging.INFO):
        layers = GymFSDPStrategy()._layers(holder)
    assert layers == list(model.model.layers)
    said = [r.getMessage() for r in caplog.records if "mixture of experts" in r.getMessage()]
    assert bool(said) == experts
    if experts:
        assert f"{len(layers)} shard units" in said[0] and "experts inside" in said[0]


def test_integer_parameters_are_refused_in_one_line_where_fsdp2_cannot_shard_them() -> None:
    from gym_lightning.errors import EveryRankError
    from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters, refuse_integer_parameters

    module = torch.nn.Module()
    module.codes = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(EveryRankError, match=r"codes, 1 in all\) with torch 2.11.0\+cu130.*torch>=2.13"):
        refuse_integer_parameters(module, "2.11.0+cu130")  # the GPU image's torch
    refuse_integer_parameters(module, "2.13.0+cpu")
    refuse_integer_parameters(torch.nn.Linear(2, 2), "2.11.0")  # nothing to refuse without integer parameters
    assert fsdp2_holds_integer_parameters("2.14.0.dev20270101") and not fsdp2_holds_integer_parameters("2.12.1")
