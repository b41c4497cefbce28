"""The HF Trainer's ``--optim`` optimizers and ``--lr_scheduler_type`` schedules as ``CausalLMModule`` builds them."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler
from transformers.optimization import Adafactor

from gym_lightning.optim import build_optimizer, hf_scheduler


def _groups() -> list[dict[str, object]]:
    return [{"params": [torch.nn.Parameter(torch.ones(2, 2))], "weight_decay": 0.1}]


@pytest.mark.parametrize(
    ("name", "cls", "defaults"),
    [
        ("adamw_torch", torch.optim.AdamW, {"betas": (0.8, 0.9), "eps": 1e-6, "fused": None}),
        ("adamw_torch_fused", torch.optim.AdamW, {"betas": (0.8, 0.9), "fused": True}),
        ("sgd", torch.optim.SGD, {"momentum": 0}),
        ("adagrad", torch.optim.Adagrad, {}),
        ("rmsprop", torch.optim.RMSprop, {}),
        ("adafactor", Adafactor, {"relative_step": False, "scale_parameter": False}),
    ],
)
def test_build_optimizer_as_the_hf_trainer(name: str, cls: type, defaults: dict[str, object]) -> None:
    optimizer = build_optimizer(name, _groups(), lr=0.01, betas=(0.8, 0.9), eps=1e-6)  # type: ignore[arg-type]
    assert type(optimizer) is cls and optimizer.defaults["lr"] == 0.01
    assert {key: optimizer.defaults[key] for key in defaults} == defaults
    assert optimizer.param_groups[0]["weight_decay"] == 0.1  # the module's decay groups are kept


@pytest.mark.parametrize("name", ["linear", "cosine_with_min_lr", "warmup_stable_decay", "constant"])
def test_hf_scheduler_is_transformers_get_scheduler(name: str) -> None:
    kwargs = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "warmup_stable_decay": {"num_decay_steps": 3}}.get(name)
    ours = hf_scheduler(name, torch.optim.SGD(_groups(), lr=1.0), warmup_steps=2, total_steps=10, kwargs=kwargs)
    theirs = get_scheduler(name, torch.optim.SGD(_groups(), lr=1.0), 2, 10, scheduler_specific_kwargs=kwargs)
    rates = []
    for _ in range(10):
        rates.append((ours.get_last_lr()[0], theirs.get_last_lr()[0]))
        ours.optimizer.step(), ours.step(), theirs.optimizer.step(), theirs.step()
    assert [a for a, _ in rates] == [b for _, b in rates]
    if name != "constant":
        assert rates[0][0] == 0.0 and rates[1][0] == 0.5  # HF's warm-up: step / warmup_steps


def test_hf_decay_rule_follows_names_not_shapes() -> None:
    from gym_lightning.optim import hf_decay_names, weight_decay_groups

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(4, 4)
    model.input_layernorm = torch.nn.Module()
    model.input_layernorm.weight = torch.nn.Parameter(torch.ones(4))
    model.ln = torch.nn.LayerNorm(4)
    model.scale = torch.nn.Parameter(torch.ones(4))  # 1-D but neither bias nor norm: HF decays it
    names = hf_decay_names(model)
    assert names == {"proj.weight", "scale"}
    decayed, plain = weight_decay_groups(model.named_parameters(), 0.1, names)
    assert sorted(p.ndim for p in decayed["params"]) == [1, 2]  # type: ignore[union-attr]
    assert len(plain["params"]) == 4  # type: ignore[arg-type]
    shape_rule, _ = weight_decay_groups(model.named_parameters(), 0.1)
    assert len(shape_rule["params"]) == 1  # type: ignore[arg-type]
