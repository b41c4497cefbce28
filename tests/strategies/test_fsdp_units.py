"""gym_fsdp's shard units: one per decoder layer (a mixture of experts' with the layer's experts inside, and the run
says so: no expert parallelism is offered); an untied input embedding and LM head each a unit of its own."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers.families import family_config
from helpers.fsdp_units_worker import CASES
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


# ------------------------------------------------------------------------------------------------ vocabulary units
def _meta_model(family: str, **overrides: object) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_config(family, **overrides))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text"])
def test_an_untied_embedding_and_head_are_units_of_their_own_a_tied_pair_stays_in_the_root(family: str) -> None:
    from gym_lightning.strategies.fsdp import vocabulary_units

    model = _meta_model(family)
    holder = torch.nn.Module()
    holder.model = model
    units = vocabulary_units(holder)
    if model.config.tie_word_embeddings:  # gemma3_text: one weight, which FSDP needs in one unit
        assert units == []
        return
    assert [(u.module, u.first_in_forward) for u in units] == [
        (model.get_input_embeddings(), True),
        (model.get_output_embeddings(), False),
    ]


def test_vocabulary_units_are_found_inside_a_peft_model() -> None:
    from peft import LoraConfig, get_peft_model

    from gym_lightning.strategies.fsdp import vocabulary_units

    peft_model = get_peft_model(_meta_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    base = peft_model.get_base_model()
    modules = [u.module for u in vocabulary_units(peft_model)]
    assert modules == [base.get_input_embeddings(), base.get_output_embeddings()]


@pytest.mark.slow
def test_vocabulary_units_train_as_the_root_unit_did_gather_once_a_step_and_resume_old_checkpoints(
    tmp_path: Path,
) -> None:
    """2 CPU ranks, an untied tiny Llama (``helpers.fsdp_units_worker``): the embedding and the head are units of
    their own, train bit for bit as they did in the root unit, gather as often under a chunked loss (13 LM-head
    calls a step) as under one call, and a checkpoint written with them in the root unit resumes into the new
    layout with its weights and optimizer state (distributed checkpoints are keyed by parameter name)."""
    from helpers.dist import HELPERS, run_ranks
    from helpers.fsdp_units_worker import UNTIED

    from gym_lightning.models.loading import build_causal_lm
    from gym_lightning.tokenizer import load_tokenizer

    folder = tmp_path / "model"
    torch.manual_seed(0)
    build_causal_lm("tiny-llama", config_overrides=UNTIED).save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    run_ranks([str(HELPERS / "fsdp_units_worker.py"), str(folder), str(tmp_path)], timeout=600)
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in CASES}
    vocabulary = {"model.model.embed_tokens", "model.lm_head"}
    assert vocabulary <= set(runs["fsdp"]["units"]) and not vocabulary & set(runs["old_layout"]["units"])
    assert runs["fsdp"]["losses"][:2] == runs["old_layout"]["losses"]  # the same sums, in the same order
    assert runs["fsdp"]["all_gathers"][:2] == runs["fsdp_unchunked"]["all_gathers"]  # not one more per loss chunk
    assert runs["resumed"]["start"] == runs["old_layout"]["end"]  # weights and Adam moments, as saved
    assert len(runs["resumed"]["losses"]) == 1
