"""A 4-bit base in one process: built as NF4 from the start and quantised as read, equal to the source model with
its weights rounded to NF4; merged and adapter exports reloaded by transformers and peft; every misuse refused in
one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.families import PROBE_IDS, make_family_folder
from transformers import AutoModelForCausalLM

from gym_lightning import CausalLMModule, LoRAArgs
from gym_lightning.errors import GymUserError
from gym_lightning.hf_folder import live_source, write_export
from gym_lightning.lora import apply_lora
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.models.quantized import nf4_layers
from gym_lightning.quant import NF4Linear, QuantizationArgs, nf4

# A dense family, one with biases (Qwen2), tied embeddings (Gemma-3), a fused qkv (Phi-3), a mixture of experts.
FAMILIES = ("llama", "qwen2", "gemma3_text", "phi3", "qwen3_moe")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qlora-families")
    return {family: make_family_folder(family, root / family) for family in FAMILIES}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=PROBE_IDS, use_cache=False).logits.float()


def _rounded_reference(folder: Path, args: QuantizationArgs) -> torch.nn.Module:
    """The source model with every weight the 4-bit model quantises replaced by its NF4 rounding."""
    reference = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and module.in_features % args.block_size == 0:
            parts = nf4.quantize(module.weight.data, args.block_size, args.double_quant)
            module.weight.data = nf4.dequantize(parts, args.dtype).to(module.weight.dtype)
        for weight in ("gate_up_proj", "down_proj"):  # fused experts (quant.experts): the 3-D weight's rows alike
            fused = module._parameters.get(weight)
            if name.endswith("experts") and fused is not None and fused.shape[-1] % args.block_size == 0:
                parts = nf4.quantize(fused.data, args.block_size, args.double_quant)
                fused.data = nf4.dequantize(parts, args.dtype).to(fused.dtype)
    return reference


@pytest.mark.parametrize("family", FAMILIES)
def test_a_4bit_build_is_the_source_model_rounded_to_nf4(family: str, folders: dict[str, Path]) -> None:
    args = QuantizationArgs()
    model = build_causal_lm(str(folders[family]), quantization=args)
    layers = nf4_layers(model)
    assert layers and all(layer.weight.dtype == torch.uint8 for layer in layers.values())
    assert type(model.get_output_embeddings()) is torch.nn.Linear, "the LM head stays in 16 bits"
    assert model.get_output_embeddings().weight.is_floating_point()
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert torch.equal(_logits(model), _logits(_rounded_reference(folders[family], args)))


def test_skip_modules_keep_layers_in_16_bits(folders: dict[str, Path]) -> None:
    model = build_causal_lm(str(folders["llama"]), quantization=QuantizationArgs(skip_modules=["lm_head", "o_proj"]))
    kept = [name for name, m in model.named_modules() if name.endswith("o_proj")]
    assert kept and all(type(model.get_submodule(name)) is torch.nn.Linear for name in kept)
    assert any(isinstance(m, NF4Linear) for m in model.modules())


def test_merged_and_adapter_exports_reload_in_transformers_and_peft(folders: dict[str, Path], tmp_path: Path) -> None:
    """Merged: the dequantised base + B @ A in the source dtype, a plain transformers folder giving the trained
    model's logits. Adapter: PEFT's files, which load on the original (16-bit) base; merged there, they differ from
    the merged export by exactly the NF4 rounding of the base."""
    from peft import PeftModel

    folder = folders["llama"]
    model = apply_lora(build_causal_lm(str(folder), quantization=QuantizationArgs()), LoRAArgs(r=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.05)  # a trained adapter: B is no longer zero
    write_export(live_source(None, model, None), tmp_path / "merged", dtype="float32")
    write_export(live_source(None, model, None), tmp_path / "adapter", lora="adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    # The merged weight is rounded once to the source folder's bf16 (as a merge into a bf16 checkpoint is), where the
    # live model adds the fp32 adapter path to the bf16 base: the family matrix's bf16 tolerance (2 steps of [0.5, 1)).
    torch.testing.assert_close(_logits(merged), _logits(model.float()), rtol=0, atol=2**-6)

    on_source = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
    plain = on_source.merge_and_unload().state_dict()
    source = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    rounded = _rounded_reference(folder, QuantizationArgs()).state_dict()
    key = "model.layers.1.self_attn.q_proj.weight"
    gap = merged.state_dict()[key] - plain[key].float()
    torch.testing.assert_close(gap, (rounded[key] - source[key]).float(), rtol=0, atol=2e-3)


def _module(**changes: object) -> CausalLMModule:
    return CausalLMModule(**{"model": "tiny-llama", "lora": LoRAArgs(), "quantization": QuantizationArgs(), **changes})


def test_misuse_is_refused_in_one_message_each(folders: dict[str, Path]) -> None:
    with pytest.raises(GymUserError, match=r"quantization \(a 4-bit base\) needs lora") as full:
        _module(lora=None, quantization={"quant_storage": "int4", "block_size": 63})
    assert "quant_storage must be one of" in str(full.value) and "block_size must be an even" in str(full.value)
    with pytest.raises(GymUserError, match="unknown settings"):
        _module(quantization={"bits": 4})
    with pytest.raises(GymUserError, match="quant_type must be one of nf4, fp4"):
        _module(quantization={"quant_type": "int4"})
    with pytest.raises(GymUserError, match="quantises pretrained weights") as preset:
        build_causal_lm("tiny-llama", quantization=QuantizationArgs())
    assert "\n" not in str(preset.value)
    with pytest.raises(GymUserError, match="quantises pretrained weights"):
        build_causal_lm(str(folders["llama"]), pretrained=False, quantization=QuantizationArgs())


def test_strategies_that_cannot_hold_a_4bit_base_are_refused_in_one_line() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    from gym_lightning.quant.config import check_strategy
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

    for fine in (
        SingleDeviceStrategy("cpu"),
        DDPStrategy(),
        GymDDPStrategy(),
        GymFSDPStrategy(),
        ZeROStrategy(stage=3),
    ):
        check_strategy(fine)
    with pytest.raises(GymUserError, match="does not run under FSDPStrategy: use gym_lightning's strategies") as err:
        check_strategy(FSDPStrategy())
    assert "\n" not in str(err.value)
