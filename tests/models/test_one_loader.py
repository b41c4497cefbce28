"""One weight loader for every strategy (``models.fill``): holdings differ only by the adapter passed in.

A fourth adapter, defined here alone (this rank holds the last half of every flattened tensor, on one process),
loads pretrained, converted (fused MoE experts), NF4 and random weights; each held part equals the same part of an
ordinary single-process load. Checkpoint tensors the model does not use are named in one warning line.
"""

from __future__ import annotations

import ast
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from helpers.families import make_family_folder
from helpers.strategy_worker import TINY_OVERRIDES
from torch import nn
from transformers import AutoModelForCausalLM

from gym_lightning.lora import checkpoint_key
from gym_lightning.models import fill, holdings
from gym_lightning.models.fill import abbreviated, fill_on_cpu, fill_weights
from gym_lightning.models.holdings import Holdings, Part, Span, Value, Whole
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.models.plan import META, BuildPlan, WeightsSource
from gym_lightning.quant import QuantizationArgs
from gym_lightning.strategies.materialize import materialize

_T = TypeVar("_T")


class LastHalf:
    """This rank holds the last half of every flattened tensor (a 0-dim or one-element tensor whole), kept here
    rather than in the model, whose tensors stay on the meta device."""

    def __init__(self) -> None:
        self.held: dict[int, torch.Tensor] = {}

    def part(self, tensor: torch.Tensor) -> Part:
        if tensor.numel() < 2:
            return Whole()
        return Span(tuple(tensor.shape), range(tensor.numel() // 2, tensor.numel()))

    def write(self, tensor: torch.Tensor, part: Part, value: Value) -> None:
        self.held[id(tensor)] = value().reshape(-1).to(tensor.dtype)

    def alone(self, build: Callable[[WeightsSource], _T], source: WeightsSource) -> _T:
        return build(source)

    def distribute(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
    ) -> None:
        for key, tensor in targets.items():
            self.write(tensor, self.part(tensor), lambda key=key: _last_half(reference[checkpoint_key(key)]))


def _last_half(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.numel() < 2 else flat[flat.numel() // 2 :]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("one-loader")
    return {family: make_family_folder(family, root / family) for family in ("llama", "gemma3_text", "qwen3_moe")}


def _held_through_last_half(source: str, **build: object) -> tuple[nn.Module, LastHalf]:
    """A meta build of ``source`` whose weights the loader fills through :class:`LastHalf`."""
    plan = BuildPlan(device=META)
    model = build_causal_lm(source, plan=plan, **build)
    ((built, record),) = plan.take()
    adapter = LastHalf()
    assert isinstance(adapter, Holdings)
    fill_weights(built, record, built.state_dict(keep_vars=True), adapter)
    return model, adapter


def _assert_holds_the_last_half_of(model: nn.Module, adapter: LastHalf, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict(keep_vars=True)
    assert set(expected) <= set(state)
    for key, value in expected.items():
        assert torch.equal(adapter.held[id(state[key])], _last_half(value)), key


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe"])  # dense, tied embeddings, fused experts
def test_a_fourth_adapter_holds_parts_of_a_pretrained_load(family: str, folders: dict[str, Path]) -> None:
    model, adapter = _held_through_last_half(str(folders[family]))
    expected = AutoModelForCausalLM.from_pretrained(folders[family]).state_dict()
    _assert_holds_the_last_half_of(model, adapter, expected)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_fourth_adapter_holds_parts_of_an_nf4_load(family: str, folders: dict[str, Path]) -> None:
    args = QuantizationArgs()
    model, adapter = _held_through_last_half(str(folders[family]), quantization=args)
    whole = build_causal_lm(str(folders[family]), quantization=args)  # the whole-tensor adapter (models.fill)
    _assert_holds_the_last_half_of(model, adapter, whole.state_dict())


def test_a_fourth_adapter_holds_parts_of_a_random_init() -> None:
    torch.manual_seed(5)
    model, adapter = _held_through_last_half("tiny-llama", config_overrides=TINY_OVERRIDES)
    torch.manual_seed(5)
    expected = build_causal_lm("tiny-llama", config_overrides=TINY_OVERRIDES).state_dict()
    _assert_holds_the_last_half_of(model, adapter, expected)


def test_the_whole_tensor_adapter_loads_what_from_pretrained_loads(folders: dict[str, Path]) -> None:
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(folders["qwen3_moe"]), plan=plan)
    ((built, record),) = plan.take()
    fill_on_cpu(built, record)
    expected = AutoModelForCausalLM.from_pretrained(folders["qwen3_moe"]).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_the_loader_knows_no_strategy() -> None:
    # Names in the code (not the docs): no DTensor check, no deepspeed import, no ZeRO-3 helper.
    tree = ast.parse(inspect.getsource(fill) + inspect.getsource(holdings))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {name for name in names if any(w in name for w in ("DTensor", "deepspeed", "zero3", "ds_", "strateg"))}


# ----------------------------------------------------------------------------------- unused checkpoint tensors
def _one_warning(run: Callable[[], object]) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    lines = [str(w.message) for w in caught if "not used by the model" in str(w.message)]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]
    return lines[0]


def test_dropped_layers_are_named_in_one_warning_by_the_sharded_loader(folders: dict[str, Path]) -> None:
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(folders["llama"]), plan=plan, config_overrides={"num_hidden_layers": 1})
    line = _one_warning(lambda: materialize(model, torch.device("cpu"), plan.take()))
    assert "model.layers.1.*" in line and line.startswith("9 tensors of the checkpoint"), line


def test_dropped_layers_are_named_in_one_warning_by_a_4bit_load(folders: dict[str, Path]) -> None:
    overrides = {"num_hidden_layers": 1}
    line = _one_warning(
        lambda: build_causal_lm(str(folders["qwen3_moe"]), quantization=QuantizationArgs(), config_overrides=overrides)
    )
    assert "model.layers.1.*" in line, line


def test_a_load_that_uses_every_checkpoint_tensor_warns_nothing(folders: dict[str, Path]) -> None:
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(folders["qwen3_moe"]), plan=plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize(model, torch.device("cpu"), plan.take())


def test_long_lists_are_abbreviated_by_layer_and_counted() -> None:
    stored = [f"model.layers.{i}.{name}.weight" for i in range(16) for name in ("mlp", "attn")] + ["model.norm.weight"]
    unused = [key for key in stored if key.startswith(tuple(f"model.layers.{i}." for i in range(3, 16)))]
    assert abbreviated(unused, stored) == "model.layers.{3..15}.*"
    partial = [*unused, "model.layers.0.mlp.weight", "model.layers.2.mlp.weight"]
    assert abbreviated(partial, stored) == (
        "model.layers.{3..15}.*, model.layers.0.mlp.weight, model.layers.2.mlp.weight"
    )
    names = [f"extra.{name}" for name in "abcdefghijk"]
    assert abbreviated(names, names).endswith("extra.h and 3 more")
