"""LoRA on the fused experts of every bundled MoE family: gym's routed forward against peft's own (which builds the
whole ``[E, in, out]`` delta each call), the ``all-experts`` shorthand, frozen routers, dropout, untouched experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.families import COMMON, FAMILIES, MOE_FAMILIES, family_config
from peft import get_peft_model
from peft.tuners.lora import ParamWrapper
from transformers import AutoConfig, AutoModelForCausalLM

from gym_lightning import CausalLMModule
from gym_lightning.errors import EveryRankError, GymUserError
from gym_lightning.lora import EXPERTS_SHORTHAND, LoRAArgs, apply_lora, peft_lora_config
from gym_lightning.models import experts as routed
from gym_lightning.models.experts import expert_targets, experts_slots, install_routed_experts

IDS = (torch.arange(2 * 12).reshape(2, 12) * 7 + 3) % 500


def _model(family: str, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    if family in FAMILIES:
        config = family_config(family, **overrides)
    else:
        config = AutoConfig.for_model(family, vocab_size=512, **{**COMMON, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _randomise_adapters(model: torch.nn.Module) -> None:
    """lora_B starts at 0 (the adapted model equals its base): random factors make the expert deltas count."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _adapted(family: str, args: LoRAArgs) -> torch.nn.Module:
    model = _model(family)
    peft_model = apply_lora(model, args, expert_targets(model))
    _randomise_adapters(peft_model)
    return peft_model


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_forward_equals_peft_own_on_every_family(family: str) -> None:
    args = LoRAArgs(r=4, alpha=8, target_parameters=[EXPERTS_SHORTHAND])
    model = _adapted(family, args)
    assert any(isinstance(m, ParamWrapper) for m in model.modules())
    peft_loss, peft_grads = _loss_and_grads(model)  # peft's ParamWrapper forward: W + B @ A for all experts
    assert install_routed_experts(model) == len(experts_slots(model)) > 0
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, peft_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == peft_grads.keys() and any("experts.lora_A" in k for k in grads)
    for key, grad in peft_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {key}")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_without_adapters_the_routed_forward_is_transformers_forward(family: str) -> None:
    model = _model(family)
    with torch.no_grad():
        expected = model(input_ids=IDS, use_cache=False).logits
        for _, slot in experts_slots(model):  # force gym's forward onto the plain experts
            slot.forward = lambda h, i, w, slot=slot: routed.route_experts(slot, h, i, w)
        actual = model(input_ids=IDS, use_cache=False).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_all_experts_names_routed_and_shared_experts_and_never_the_router() -> None:
    model = _model("deepseek_v3")
    targets = expert_targets(model)
    assert targets.parameters == ("experts.down_proj", "experts.gate_up_proj")
    shared = ("shared_experts.down_proj.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")
    assert targets.shared == shared
    peft_model = apply_lora(model, LoRAArgs(r=2, target_parameters=[EXPERTS_SHORTHAND]), targets)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("shared_experts.gate_proj.lora_A" in n for n in trainable)
    assert not any(".layers.0.mlp." in n for n in trainable)  # layer 0's dense MLP is no expert
    assert any("mlp.experts.lora_A" in n for n in trainable)
    assert any("experts.base_layer.lora_A" in n for n in trainable)
    # the experts alone: no attention, the router frozen
    assert not any("self_attn" in n or ".gate." in n or "router" in n for n in trainable)


def test_all_linear_leaves_a_linear_router_frozen_unless_named() -> None:
    overrides = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 32}  # fmt: skip
    model = _model("qwen2_moe", **overrides)
    targets = expert_targets(model)
    # Its router (mlp.gate) holds a plain weight, its shared expert's gate is an nn.Linear, which all-linear would take
    assert targets.routers == ("model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate")
    config = peft_lora_config(LoRAArgs(target_modules=["all-linear"]), targets)
    peft_model = get_peft_model(model, config)
    adapted = {n.rpartition(".lora_A")[0] for n, _ in peft_model.named_parameters() if ".lora_A." in n}
    assert not any(n.endswith((".mlp.gate", ".shared_expert_gate")) for n in adapted)
    # Asked for by its parameter (transformers 5's routers are no nn.Linear), the router is adapted
    named = _model("qwen2_moe", **overrides)
    named = apply_lora(named, LoRAArgs(r=2, target_parameters=["mlp.gate.weight"]), expert_targets(named))
    install_routed_experts(named)
    named(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    grads = [p.grad for n, p in named.named_parameters() if n.endswith("mlp.gate.lora_B.default.weight")]
    assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_only_the_routed_experts_get_gradients() -> None:
    model = _adapted("qwen3_moe", LoRAArgs(r=2, target_parameters=["experts.gate_up_proj"]))
    install_routed_experts(model)
    slot = experts_slots(model)[0][1]
    used: set[int] = set()
    original = routed.expert_matmul

    def recording(experts: torch.nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        used.add(e)
        return original(experts, name, e, x)

    routed.expert_matmul = recording  # type: ignore[assignment]
    try:
        ids = torch.full((1, 3), 7)  # 3 tokens, top-2 of 8 experts: at most 6 experts receive any
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        routed.expert_matmul = original  # type: ignore[assignment]
    grad = slot.lora_A["default"].weight.grad.view(slot.num_experts, 2, -1)
    touched = {e for e in range(slot.num_experts) if grad[e].abs().sum() > 0}
    assert touched and touched <= used and len(used) < slot.num_experts


def test_dropout_reaches_the_expert_adapters_in_training_only() -> None:
    args = LoRAArgs(r=4, alpha=8, dropout=0.5, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = _adapted("mixtral", args)
    assert model.peft_config["default"].lora_dropout == 0.0  # peft's ParamWrapper refuses dropout
    install_routed_experts(model, dropout=args.dropout)
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=IDS, use_cache=False).logits
        model.train()
        trained = model(input_ids=IDS, use_cache=False).logits
        model.eval()
        again = model(input_ids=IDS, use_cache=False).logits
    torch.testing.assert_close(again, evaluated)
    assert not torch.allclose(trained, evaluated)


def test_target_parameters_refused_on_a_dense_model_and_when_malformed() -> None:
    with pytest.raises(EveryRankError, match=r"no expert weight of .*qwen3.*no mixture-of-experts"):
        apply_lora(_model("qwen3"), LoRAArgs(target_parameters=[EXPERTS_SHORTHAND]))
    assert "lora.target_parameters must be a non-empty list" in LoRAArgs(target_parameters=[]).problems()[0]
    assert LoRAArgs(target_parameters="all-experts").problems()  # type: ignore[arg-type]


def test_gym_fit_module_adapts_the_experts_and_routes_them(tmp_path: Path) -> None:
    from helpers.families import make_family_folder

    folder = make_family_folder("qwen3_moe", tmp_path / "qwen3_moe")
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj"], "target_parameters": [EXPERTS_SHORTHAND]}
    module = CausalLMModule(str(folder), tokenizer=str(folder), torch_dtype="float32", lora=lora)
    module.configure_model()
    slots = experts_slots(module.model)
    assert len(slots) == 2 and all(s.forward.__func__ is routed._routed_forward for _, s in slots)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in n for n in trainable) and any("experts.lora_B" in n for n in trainable)
    with pytest.raises(GymUserError, match="target_parameters"):
        CausalLMModule(str(folder), lora={"r": 4, "target_parameters": "all-experts"})


def test_target_modules_name_transformers_5_modules_only() -> None:
    # peft's transformers-4 bridge would turn all-linear into the experts and the router (and refuse the dropout)
    model = apply_lora(_model("qwen3_moe"), LoRAArgs(r=2, dropout=0.05, target_modules=["all-linear"]))
    adapted = {n.split(".layers.0.")[-1].partition(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted >= {"self_attn.q_proj", "self_attn.o_proj"} and not any("mlp" in n for n in adapted)
    with pytest.raises(EveryRankError, match=r"named .*q_proj.*target_parameters: \[all-experts\]"):
        apply_lora(_model("qwen3_moe"), LoRAArgs(target_modules=["gate_proj", "up_proj"]))
