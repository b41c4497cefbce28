"""NF4 storage of the fused 3-D expert weights (``quant.experts``): built as integer parts from the start (no 16-bit
expert weight is ever made), quantised as read from the per-expert checkpoint tensors (only the experts a caller
holds), equal to ``nf4.quantize`` of the whole fused weight on one process and on 2 ranks (gym_fsdp's dim-0 shards,
ZeRO-3's flat spans), saved and resumed bit for bit, and exported as the dequantised per-expert tensors.

The tiny folders (``helpers.families``) have hidden size 64: ``block_size: 32`` quantises both expert weights of
every family (the down projections of Qwen3-MoE and DeepSeek-V3 are 32 wide, which the default 64 leaves in 16 bits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.dist import HELPERS, run_ranks
from helpers.families import MOE_FAMILIES, PROBE_IDS, make_family_folder
from helpers.nf4_experts_worker import FloatFactories
from transformers import AutoModelForCausalLM

from gym_lightning.lazy import LazyTensor
from gym_lightning.models.conversion import SafetensorsReader, checkpoint_layout, checkpoint_sources
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.models.plan import META, BuildPlan
from gym_lightning.models.quantized import RowQuantizer, dequantized_tensors, nf4_weights
from gym_lightning.quant import QuantizationArgs, nf4
from gym_lightning.quant import experts as nf4_experts
from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters

BOTH = QuantizationArgs(block_size=32)  # both expert weights of every tiny family in NF4
WEIGHTS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nf4-experts")
    return {family: make_family_folder(family, root / family) for family in MOE_FAMILIES}


@pytest.fixture(scope="module")
def sources(folders: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """Each folder's model as ``from_pretrained`` loads it: the fused 3-D expert weights."""
    return {family: AutoModelForCausalLM.from_pretrained(folder).state_dict() for family, folder in folders.items()}


def _experts_weights(model: torch.nn.Module) -> list[str]:
    """The model keys of every fused expert weight (``gate_up_proj``/``down_proj`` of a module that has both)."""
    return [
        f"{name}.{weight}"
        for name, module in model.named_modules()
        if all(isinstance(module._parameters.get(w), torch.Tensor) for w in WEIGHTS)
        for weight in WEIGHTS
    ]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_parts_are_the_quantisation_of_the_fused_weight(
    family: str, folders: dict[str, Path], sources: dict[str, dict[str, torch.Tensor]]
) -> None:
    model = build_causal_lm(str(folders[family]), quantization=BOTH)
    found = nf4_experts.nf4_expert_weights(model)
    assert sorted(found) == sorted(_experts_weights(model)) and found, "every fused expert weight is NF4"
    for key, (experts, name) in found.items():
        fused = sources[family][key]
        assert nf4_experts.logical_shape(experts, name) == tuple(fused.shape)
        expected = nf4.quantize(fused, BOTH.block_size, BOTH.double_quant)
        parts = nf4_experts.parts_of(experts, name)
        assert parts.keys() == expected.keys()
        for part, value in expected.items():
            assert torch.equal(parts[part], value), (key, part)
        whole = nf4.dequantize(expected, BOTH.dtype)
        for e in range(fused.shape[0]):
            assert torch.equal(nf4_experts.dequantize_expert(experts, name, e), whole[e]), (key, e)
    state = model.state_dict()
    for key, value in state.items():  # everything else (gpt-oss' expert biases included) as the source has it
        if key.endswith("_bias") or (key in sources[family] and key not in found and value.is_floating_point()):
            assert torch.equal(value, sources[family][key].to(value.dtype)), key


def test_a_weight_whose_width_does_not_divide_into_blocks_stays_16_bit(
    folders: dict[str, Path], sources: dict[str, dict[str, torch.Tensor]]
) -> None:
    model = build_causal_lm(str(folders["qwen3_moe"]), quantization=QuantizationArgs())  # block 64; down_proj 32 wide
    found = nf4_experts.nf4_expert_weights(model)
    assert found and all(name == "gate_up_proj" for _, name in found.values())
    key = "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(model.state_dict()[key], sources["qwen3_moe"][key])


@pytest.mark.parametrize(
    ("skip", "nf4_left"),
    [
        (["experts"], set()),
        (["experts.down_proj"], {"layers.0.gate_up_proj", "layers.1.gate_up_proj"}),
        (["model.layers.0.mlp.experts"], {"layers.1.gate_up_proj", "layers.1.down_proj"}),
    ],
)
def test_skip_modules_keep_experts_in_16_bits(
    skip: list[str], nf4_left: set[str], folders: dict[str, Path], sources: dict[str, dict[str, torch.Tensor]]
) -> None:
    args = QuantizationArgs(block_size=32, skip_modules=["lm_head", *skip])
    model = build_causal_lm(str(folders["mixtral"]), quantization=args)
    found = nf4_experts.nf4_expert_weights(model)
    short = {key.removeprefix("model.").replace(".mlp.experts", "") for key in found}
    assert short == nf4_left
    state = model.state_dict()
    for key in _experts_weights(model):
        if key not in found:
            assert torch.equal(state[key], sources["mixtral"][key]), key


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_no_16_bit_expert_weight_is_ever_made(family: str, folders: dict[str, Path]) -> None:
    """On the meta plan (gym_fsdp's) every expert part is integer and on meta; on a plan that builds with storage
    (ZeRO-3's, here outside ``zero.Init``) no 3-D floating tensor is made at all, where 16-bit experts make them."""
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(folders[family]), plan=plan, quantization=BOTH)
    found = nf4_experts.nf4_expert_weights(model)
    assert found
    for experts, name in found.values():
        for attr in nf4_experts.stored_components(name, nf4_experts.nf4_weights_of(experts)[name]):
            param = getattr(experts, attr)
            assert param.is_meta and not param.is_floating_point() and not param.requires_grad, attr
    for skip, made in (([], False), (["experts"], True)):
        args = QuantizationArgs(block_size=32, skip_modules=["lm_head", *skip])
        with FloatFactories() as factories:
            build_causal_lm(str(folders[family]), plan=BuildPlan(fill_pretrained=True), quantization=args)
        assert any(len(shape) == 3 for shape in factories.shapes) is made, (skip, factories.shapes)


def test_a_rank_reads_and_quantises_only_its_experts(
    folders: dict[str, Path], sources: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Experts 2..3 of a fused weight: made from those experts' own checkpoint tensors and nothing else, equal to
    those experts of the whole tensor's quantisation."""
    folder = folders["qwen3_moe"]
    model = build_causal_lm(str(folder), plan=BuildPlan(device=META), quantization=BOTH)
    reader = SafetensorsReader(folder)
    read: list[str] = []
    load = reader.load
    reader.load = lambda key: read.append(key) or load(key)  # type: ignore[method-assign]
    weights = nf4_weights(model)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert weights[key].rows == 8 and weights[key].codes == "gate_up_proj"
    quantizer = RowQuantizer(model, reader, checkpoint_sources(model, reader.where, weights), weights)
    expected = nf4.quantize(sources["qwen3_moe"][key], BOTH.block_size, BOTH.double_quant)
    for name, part in weights[key].names.items():
        assert torch.equal(quantizer.component(key, name, 2, 4), expected[part][2:4]), name
    assert sorted(read) == sorted(
        f"model.layers.1.mlp.experts.{e}.{proj}.weight" for e in (2, 3) for proj in ("gate_proj", "up_proj")
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_export_dequantises_experts_into_the_per_expert_layout(
    family: str, folders: dict[str, Path], sources: dict[str, dict[str, torch.Tensor]]
) -> None:
    """The exporter's view: each NF4 expert weight is its dequantised fused weight in fp32, which the checkpoint
    layout splits into the folder's own tensors (names and shapes of the source checkpoint)."""
    model = build_causal_lm(str(folders[family]), quantization=BOTH)
    state = model.state_dict()
    lazy = {key: LazyTensor(tuple(t.shape), t.dtype, lambda t=t: t) for key, t in state.items()}
    plain = dequantized_tensors(lazy)
    found = nf4_experts.nf4_expert_weights(model)
    assert not [key for key in plain if key.endswith(("_scales", "_scale_stats"))]
    for key in found:
        rounded = nf4.dequantize(nf4.quantize(sources[family][key], 32, True), torch.float32)
        assert plain[key].shape == tuple(rounded.shape) and torch.equal(plain[key].load(), rounded), key
    exported = checkpoint_layout(model, plain)
    stored = SafetensorsReader(folders[family]).where
    assert set(exported) == set(stored)
    assert {key: exported[key].load().shape for key in stored} == {key: _shape(folders[family], key) for key in stored}


def _shape(folder: Path, key: str) -> torch.Size:
    return SafetensorsReader(folder).load(key).shape


# ------------------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.slow
def test_two_rank_loads_and_resumes_give_one_process_codes(folders: dict[str, Path], tmp_path: Path) -> None:
    """gym_fsdp (dim-0 shards: 4 of Qwen3-MoE's 8 experts per rank) and ZeRO-3 (flat spans) load the codes one
    process loads, bit for bit; a checkpoint saved with every NF4 expert tensor's bit 0 flipped (a state no load
    gives) resumes to exactly that state; under ZeRO-3's ``zero.Init`` no 3-D floating tensor is made, where 16-bit
    experts make them (the control phase)."""
    strategies = {"zero3": {"class": "ZeROStrategy", "kwargs": {"stage": 3}}}
    if fsdp2_holds_integer_parameters():
        strategies["fsdp"] = {"class": "GymFSDPStrategy"}
    phases: list[dict[str, Any]] = []
    for name, strategy in strategies.items():
        phases += [
            {"name": name, "strategy": strategy},
            {"name": f"{name}-gpt_oss", "strategy": strategy, "folder": str(folders["gpt_oss"])},
            {"name": f"{name}-save", "strategy": strategy, "save": f"{name}.ckpt"},
            {"name": f"{name}-resume", "strategy": strategy, "resume": f"{name}.ckpt"},
        ]
    control = {"quantization": {"skip_modules": ["lm_head", "experts"]}}
    phases.append({"name": "zero3-16bit", "strategy": strategies["zero3"], **control})
    spec = {"out": str(tmp_path), "folder": str(folders["qwen3_moe"]), "quantization": {"block_size": 32}}
    (tmp_path / "spec.json").write_text(json.dumps({**spec, "phases": phases}))
    run_ranks([str(HELPERS / "nf4_experts_worker.py"), str(tmp_path / "spec.json")], timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    one = {
        family: build_causal_lm(str(folders[family]), quantization=BOTH, dtype="float32").state_dict()
        for family in ("qwen3_moe", "gpt_oss")
    }
    for phase in phases[:-1]:
        got = torch.load(tmp_path / f"{phase['name']}.pt")
        local = got.pop("__local__")
        reference = one["gpt_oss" if "gpt_oss" in phase["name"] else "qwen3_moe"]
        assert got and len(got) == len(local), phase["name"]
        flipped = "save" in phase or "resume" in phase
        for key, value in got.items():
            expected = reference[key] ^ 1 if flipped else reference[key]
            assert torch.equal(value, expected), (phase["name"], key)
            assert torch.Size(local[key]).numel() < value.numel(), (phase["name"], key, "each rank holds a part")
        assert results[phase["name"]]["made_3d_floats"] == [], phase["name"]
    assert results["zero3-16bit"]["made_3d_floats"], "16-bit experts are made as 3-D floats (the probe sees them)"


def _rounded(folder: Path, args: QuantizationArgs) -> torch.nn.Module:
    """The source model (transformers' eager per-expert loop) with every weight the 4-bit build quantises replaced by
    its NF4 rounding: the decoder's linear layers and the fused expert weights."""
    reference = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and module.in_features % args.block_size == 0:
            module.weight.data = nf4.dequantize(nf4.quantize(module.weight.data, args.block_size), args.dtype)
        for weight in WEIGHTS:
            fused = module._parameters.get(weight)
            if fused is not None and fused.dim() == 3 and fused.shape[-1] % args.block_size == 0:
                fused.data = nf4.dequantize(nf4.quantize(fused.data, args.block_size), args.dtype)
    return reference


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_4bit_moe_computes_what_the_rounded_source_computes(family: str, folders: dict[str, Path]) -> None:
    """The built model runs as it comes (gym's routed forward over the NF4 experts, ``models.experts``): its logits
    are the source model's with its weights rounded to NF4."""
    args = QuantizationArgs(block_size=32, compute_dtype="float32")
    model = build_causal_lm(str(folders[family]), quantization=args, dtype="float32")
    with torch.no_grad():
        got = model.eval()(input_ids=PROBE_IDS, use_cache=False).logits
        expected = _rounded(folders[family], args).float().eval()(input_ids=PROBE_IDS, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
