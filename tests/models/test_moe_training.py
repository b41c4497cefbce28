"""What a user meets when training the families of ``helpers.families`` in one process: the router load-balancing
loss in the training loss as transformers computes it, one-line refusals of LoRA targets a family lacks and of
models transformers cannot build as causal LMs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.families import family_config, make_family_folder
from transformers import AutoConfig

from gym_lightning import CausalLMModule
from gym_lightning.errors import EveryRankError, GymUserError
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.models.loading import import_model_code


def _module(folder: Path, output_router_logits: bool, **kwargs: object) -> CausalLMModule:
    module = CausalLMModule(
        str(folder), tokenizer=str(folder), torch_dtype="float32",
        config_overrides={"output_router_logits": output_router_logits}, **kwargs,
    )  # fmt: skip
    module.configure_model()
    module.log = lambda *args, **kwargs: None  # no Trainer loop to log into
    module.trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=1)  # type: ignore[assignment]
    return module


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (2, 16), generator=generator)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_router_loss_enters_the_training_loss_as_transformers_adds_it(family: str, tmp_path: Path) -> None:
    folder = make_family_folder(family, tmp_path / family)
    module, batch = _module(folder, output_router_logits=True), _batch()
    with torch.no_grad():
        expected = module.model(**batch, use_cache=False)  # transformers: token mean + coef * aux
        ours = module.training_step(batch, 0)
        plain = _module(folder, output_router_logits=False).training_step(batch, 0)
    coefficient = module.model.config.router_aux_loss_coef
    assert expected.aux_loss is not None and float(expected.aux_loss) > 0
    torch.testing.assert_close(ours, expected.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours - plain, coefficient * expected.aux_loss, rtol=1e-4, atol=1e-7)


def test_without_router_logits_the_loss_is_the_token_mean(tmp_path: Path) -> None:
    folder = make_family_folder("qwen3_moe", tmp_path / "qwen3_moe")
    module, batch = _module(folder, output_router_logits=False), _batch()
    with torch.no_grad():
        expected = module.model(**batch, use_cache=False)
        summed = module.engine.token_loss(module.model, batch)
        ours = module.training_step(batch, 0)
    assert summed.router_aux is None
    torch.testing.assert_close(ours, expected.loss, rtol=1e-6, atol=1e-6)


def test_lora_targets_a_family_lacks_are_refused_in_one_line(tmp_path: Path) -> None:
    folder = make_family_folder("phi3", tmp_path / "phi3")
    module = CausalLMModule(str(folder), tokenizer=str(folder), lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(EveryRankError) as raised:
        module.configure_model()
    message = str(raised.value)
    assert "\n" not in message and "Phi3ForCausalLM" in message and "qkv_proj" in message and "all-linear" in message


@pytest.mark.parametrize("model_type", ["t5", "qwen2_5_vl"])
def test_a_model_that_is_not_a_causal_lm_is_refused_before_loading(model_type: str) -> None:
    with pytest.raises(GymUserError) as raised:
        import_model_code(AutoConfig.for_model(model_type))
    message = str(raised.value)
    assert "\n" not in message and repr(model_type) in message and "AutoModelForCausalLM" in message


def test_remote_code_models_are_left_to_trust_remote_code() -> None:
    config = family_config("llama")
    import_model_code(config)  # a transformers class: imported, nothing to say
    remote = AutoConfig.for_model("t5")
    remote.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    with pytest.raises(GymUserError, match="trust_remote_code=true"):
        import_model_code(remote)
    import_model_code(remote, trust_remote_code=True)
