"""The checkpoint layout and the model layout, mapped through transformers' conversion table (``models.conversion``),
on tiny random folders of every family (``helpers.families``): what ``from_pretrained`` loads, what
``save_pretrained`` writes, and the row ranges and flat ranges that sharded loaders read."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli_runs import tensors_of
from helpers.families import FAMILIES, MOE_FAMILIES, make_family_folder
from transformers import AutoConfig, AutoModelForCausalLM

from gym_lightning.lazy import eager
from gym_lightning.models.conversion import (
    SafetensorsReader,
    checkpoint_layout,
    checkpoint_sources,
    convert,
    read_rows,
)
from gym_lightning.models.fill import part_value
from gym_lightning.models.holdings import Span
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.models.plan import META, BuildPlan
from gym_lightning.strategies.materialize import materialize


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_folder(family, root / family) for family in FAMILIES}


def _meta_model(folder: Path) -> torch.nn.Module:
    with META:
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_model_tensor_converts_to_what_from_pretrained_loads(family: str, folders: dict[str, Path]) -> None:
    folder = folders[family]
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    model, reader = _meta_model(folder), SafetensorsReader(folder)
    sources = checkpoint_sources(model, reader.where, loaded)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(sources) == set(loaded) - tied
    for key, source in sources.items():
        assert torch.equal(convert(source, reader.load, model), loaded[key]), key
    fused = [key for key, source in sources.items() if source.converter is not None]
    if family in ("qwen3_moe", "mixtral", "deepseek_v3"):  # checkpoints with one tensor per expert
        assert fused and all(sources[key].by_rows for key in fused)
        assert all(len(sources[key].keys) >= model.config.num_local_experts for key in fused)
    else:
        assert not fused, "dense families and gpt-oss store the model's own layout"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_row_range_reads_only_its_experts(family: str, folders: dict[str, Path]) -> None:
    folder = folders[family]
    model, reader = _meta_model(folder), SafetensorsReader(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    read: list[str] = []

    def load(key: str) -> torch.Tensor:
        read.append(key)
        return reader.load(key)

    for key, source in checkpoint_sources(model, reader.where, loaded).items():
        if not source.by_rows:
            continue
        experts = loaded[key].shape[0]
        read.clear()
        part = convert(source, load, model, rows=(1, experts - 1))
        assert torch.equal(part, loaded[key][1 : experts - 1]), key
        assert len(read) == (experts - 2) * len(source.sources), f"{key}: read {read}"
        assert not any(".experts.0." in name or f".experts.{experts - 1}." in name for name in read)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_a_flat_range_is_that_slice_of_the_flattened_tensor(family: str, folders: dict[str, Path]) -> None:
    """What one ZeRO-3 partition holds: any span of the flattened tensor, including spans that start and end
    inside a row (an expert) and empty spans past the end."""
    folder = folders[family]
    model, reader = _meta_model(folder), SafetensorsReader(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    rng = random.Random(0)
    for key, source in checkpoint_sources(model, reader.where, loaded).items():
        flat, shape = loaded[key].reshape(-1), tuple(loaded[key].shape)
        for _ in range(3):
            start = rng.randrange(flat.numel())
            span = range(start, rng.randrange(start, flat.numel()) + 1)
            assert torch.equal(_flat_range(source, reader, model, shape, span), flat[span.start : span.stop]), key
        assert _flat_range(source, reader, model, shape, range(flat.numel(), flat.numel())).numel() == 0


def _flat_range(
    source: Any, reader: SafetensorsReader, model: Any, shape: tuple[int, ...], span: range
) -> torch.Tensor:
    """What the one loader computes for a ZeRO-3 partition's span of ``source``'s tensor (``models.fill``)."""
    rows = partial(read_rows, source, reader, model)
    return part_value(Span(shape, span), rows, partial(convert, source, reader.load, model))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_checkpoint_layout_is_what_save_pretrained_wrote(family: str, folders: dict[str, Path]) -> None:
    folder = folders[family]
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    written = tensors_of(folder)
    for model in (loaded, _meta_model(folder)):  # loaded: its own conversion record; built: its class's table
        tied = {"lm_head.weight"} - set(written)  # the exporter drops tied weights before this, as save_pretrained
        state = {k: eager(v) for k, v in loaded.state_dict().items() if k not in tied}
        layout = checkpoint_layout(model, state)
        assert set(layout) == set(written)
        for key, lazy in layout.items():
            value = lazy.load()
            assert tuple(value.shape) == lazy.shape and torch.equal(value, written[key]), key


def test_a_converted_group_is_converted_once_and_released(folders: dict[str, Path]) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(folders["qwen3_moe"], dtype=torch.bfloat16)
    calls: list[str] = []

    def counted(key: str, tensor: torch.Tensor) -> object:
        lazy = eager(tensor)
        return type(lazy)(lazy.shape, lazy.dtype, lambda: calls.append(key) or lazy.load())

    layout = checkpoint_layout(loaded, {k: counted(k, v) for k, v in loaded.state_dict().items()})
    experts = [key for key in layout if ".experts." in key and ".layers.0." in key]
    for key in experts:
        layout[key].load()
    assert calls == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_meta_build_of_a_moe_loads_what_from_pretrained_loads(family: str, folders: dict[str, Path]) -> None:
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(folders[family]), plan=plan)
    materialize(model, torch.device("cpu"), plan.take())
    expected = AutoModelForCausalLM.from_pretrained(folders[family]).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
