"""The NF4 format (``quant.nf4``) and the layer that holds it (``quant.NF4Linear``): bitsandbytes' first level bit for
bit (NF4 and FP4), rows that quantise alone (what sharded loading needs), the double quantisation's size and error,
and a matmul whose backward dequantises again instead of keeping a 16-bit weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gym_lightning.quant import NF4Linear, QuantizationArgs, nf4
from gym_lightning.quant.linear import linears_built_as


def _weight(rows: int = 96, width: int = 512, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=generator) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_first_level_is_bitsandbytes_bit_for_bit(dtype: torch.dtype, quant_type: str) -> None:
    """Codes, scales and dequantised values equal bitsandbytes' on the CPU, for both of its 4-bit code books (FP4's
    is in bit order with two zeros: an exact 0 and values nearer 0 than its smallest step take its codes)."""
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = _weight().to(dtype)
    weight[3, :64] = 0  # an all-zero block
    weight[5, 64:128] = weight[5, 64:128].sign() * 1e-6  # a block of values below FP4's smallest step
    weight[5, 64] = 1.0
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type=quant_type)
    ours = nf4.quantize(weight, block_size=64, double_quant=False, quant_type=quant_type)
    assert torch.equal(functional.get_4bit_type(quant_type, device="cpu"), torch.tensor(nf4.CODE_BOOKS[quant_type]))
    assert torch.equal(ours["codes"].reshape(-1), packed.reshape(-1)), "same codes, same nibble order"
    assert torch.equal(ours["scales"].view(torch.float32).reshape(-1), state.absmax)
    reference = functional.dequantize_4bit(packed, state)
    assert torch.equal(nf4.dequantize_reference(ours, dtype), reference)
    assert torch.equal(nf4.dequantize(ours, dtype), reference), "bitsandbytes' kernel on our parts"
    assert nf4.quant_type_of(ours) == quant_type  # FP4 parts say so themselves (an export reads only tensors)


@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_bitsandbytes_kernel_and_plain_torch_dequantise_alike(block: int, dtype: torch.dtype) -> None:
    """``dequantize`` runs bitsandbytes' kernel where it is installed; a run must not depend on whether it is."""
    pytest.importorskip("bitsandbytes.functional")
    for double_quant in (False, True):
        parts = nf4.quantize(_weight(rows=70, width=1024), block, double_quant)
        assert torch.equal(nf4.dequantize(parts, dtype), nf4.dequantize_reference(parts, dtype))


@pytest.mark.parametrize("double_quant", [False, True])
def test_any_rows_quantise_alone_as_in_the_whole_weight(double_quant: bool) -> None:
    """Rows a:b of the quantised weight are the quantisation of rows a:b: a rank can read and quantise its own."""
    weight = _weight(rows=300, width=1024)  # 16 scales a row: the second level's block of 256 spans no row boundary
    whole = nf4.quantize(weight, 64, double_quant)
    for first, last in [(0, 1), (7, 150), (150, 300), (299, 300)]:
        part = nf4.quantize(weight[first:last], 64, double_quant)
        assert part.keys() == whole.keys()
        for name, tensor in part.items():
            assert torch.equal(tensor, whole[name][first:last]), f"rows {first}:{last} of {name}"


def test_double_quantisation_size_and_error() -> None:
    """4.14 bits a weight at a Llama-3-8B width (4 + 8/64 + 2 x 32/4096; bitsandbytes: 4.127), and the scales' own
    error far below NF4's."""
    weight = _weight(rows=64, width=4096)
    single, double = nf4.quantize(weight, 64, False), nf4.quantize(weight, 64, True)
    bits = sum(t.numel() * t.element_size() for t in double.values()) * 8 / weight.numel()
    assert bits == 4 + 8 / 64 + 2 * 32 / 4096
    assert sum(t.numel() * t.element_size() for t in single.values()) * 8 / weight.numel() == 4.5
    scales = nf4.block_scales(single)
    assert (nf4.block_scales(double) - scales).abs().max() <= scales.max() / 127
    nf4_error = (nf4.dequantize(single, torch.float32) - weight.float()).abs().mean()
    second_error = (nf4.dequantize(double, torch.float32) - nf4.dequantize(single, torch.float32)).abs().mean()
    assert second_error < nf4_error / 20


def test_a_zero_block_stays_zero() -> None:
    weight = _weight(rows=4, width=128)
    weight[1] = 0
    for double_quant in (False, True):
        values = nf4.dequantize(nf4.quantize(weight, 64, double_quant), torch.float32)
        assert torch.isfinite(values).all() and values[1].abs().max() < 1e-3


def _layer(width: int = 128, out: int = 64, bias: bool = True) -> tuple[NF4Linear, torch.Tensor]:
    layer = NF4Linear(width, out, bias=bias, dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    weight = _weight(rows=out, width=width)
    layer.load_quantized(nf4.quantize(weight, 64, True))
    if bias:
        layer.bias.data.copy_(torch.linspace(-0.1, 0.1, out))
    return layer, weight


def test_nf4_linear_is_the_dequantised_matmul_and_trains_nothing_itself() -> None:
    layer, _ = _layer()
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    reference_x = x.detach().clone().requires_grad_()
    reference = nn.functional.linear(reference_x, layer.dequantized(), layer.bias)
    assert torch.equal(y, reference)
    y.float().square().sum().backward()
    reference.float().square().sum().backward()
    assert torch.equal(x.grad, reference_x.grad)
    assert all(not p.requires_grad and p.grad is None for p in layer.parameters())
    assert isinstance(layer, nn.Linear), "peft wraps it as a linear layer"
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (64, 64)


def test_backward_keeps_no_16_bit_weight() -> None:
    """What autograd saves for backward is the input alone: the weight is dequantised again in backward."""
    layer, _ = _layer(width=512, out=256, bias=False)
    saved: list[torch.Tensor] = []
    x = torch.randn(2, 512, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert all(t.numel() < 256 * 512 for t in saved), [tuple(t.shape) for t in saved]


def test_fp4_layers_hold_their_code_book_and_rows_quantise_alone() -> None:
    """An FP4 weight's ``quant_type`` tensor is ``[rows, 1]`` like its other parts (FSDP2 shards it by rows, ZeRO-3
    partitions it), so rows a:b are still the quantisation of rows a:b; the layer dequantises with FP4's values."""
    weight = _weight(rows=40, width=256)
    whole = nf4.quantize(weight, 64, True, "fp4")
    assert whole.keys() == nf4.quantized_shapes(40, 256, 64, True, "fp4").keys()
    assert {k: tuple(v.shape) for k, v in whole.items()} == nf4.quantized_shapes(40, 256, 64, True, "fp4")
    for name, tensor in nf4.quantize(weight[7:19], 64, True, "fp4").items():
        assert torch.equal(tensor, whole[name][7:19]), name
    layer = NF4Linear(256, 40, bias=False, compute_dtype=torch.float32, quant_type="fp4")
    layer.load_quantized(whole)
    assert "fp4" in repr(layer) and layer.weight_quant_type.shape == (40, 1)
    codes = torch.stack([layer.weight >> 4, layer.weight & 15], dim=-1).reshape(40, -1).long()
    values = layer.dequantized().reshape(40, -1, 64) / nf4.block_scales(whole).unsqueeze(-1)
    torch.testing.assert_close(values.reshape(40, -1), torch.tensor(nf4.FP4_VALUES)[codes], rtol=1e-6, atol=0)
    assert not torch.equal(layer.dequantized(), nf4.dequantize(nf4.quantize(weight, 64, True), torch.float32))


def test_an_fp4_model_is_the_source_rounded_to_fp4_and_exports_from_its_tensors(tmp_path: Path) -> None:
    """``QuantizationArgs(quant_type="fp4")`` (``--bnb_4bit_quant_type fp4``): the 4-bit build computes the source
    model with its weights rounded to FP4, and the exporter's dequantisation of its state dict (``gym export`` reads
    only tensors) gives those weights back."""
    from helpers.families import PROBE_IDS, make_family_folder
    from transformers import AutoModelForCausalLM

    from gym_lightning.lazy import LazyTensor
    from gym_lightning.models.loading import build_causal_lm
    from gym_lightning.models.quantized import dequantized_tensors

    folder = make_family_folder("llama", tmp_path / "llama")
    args = QuantizationArgs(quant_type="fp4")
    model = build_causal_lm(str(folder), quantization=args)
    reference = AutoModelForCausalLM.from_pretrained(folder)  # bf16, as the folder
    expected = {}
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head" and module.in_features % args.block_size == 0:
            parts = nf4.quantize(module.weight.data, args.block_size, args.double_quant, "fp4")
            expected[f"{name}.weight"] = nf4.dequantize(parts, torch.float32)
            module.weight.data = nf4.dequantize(parts, args.dtype).to(module.weight.dtype)
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert layers and all(layer.quant_type == "fp4" for layer in layers)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=PROBE_IDS).logits, reference.eval()(input_ids=PROBE_IDS).logits)
    state = model.state_dict()
    lazy = {key: LazyTensor(tuple(t.shape), t.dtype, lambda t=t: t) for key, t in state.items()}
    exported = dequantized_tensors(lazy)
    assert expected and all(torch.equal(exported[key].load(), value) for key, value in expected.items())


def test_linears_built_as_puts_nn_linear_back_even_after_an_error() -> None:
    original = nn.Linear
    with pytest.raises(RuntimeError), linears_built_as(lambda i, o: None):
        assert nn.Linear is not original
        raise RuntimeError("a failed build")
    assert nn.Linear is original
    with linears_built_as(lambda i, o: NF4Linear if i % 64 == 0 else None):
        chosen, kept = nn.Linear(128, 8), nn.Linear(100, 8)
    assert type(chosen) is NF4Linear and type(kept) is original


def test_every_quant_storage_of_transformers_is_accepted_with_one_info_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--bnb_4bit_quant_storage`` / ``quantization.quant_storage`` take every name transformers' BitsAndBytesConfig
    does; the codes stay uint8 and a float or int8 storage says so once (not once per module or checkpoint load)."""
    from gym_lightning.errors import GymUserError
    from gym_lightning.quant import config

    said: list[str] = []
    monkeypatch.setattr(config, "rank_zero_info", said.append)
    config._storage_note.cache_clear()
    for storage in ("float16", "float32", "int8", "uint8", "float64", "bfloat16"):
        for _ in range(2):
            assert QuantizationArgs.from_value({"quant_storage": storage}).problems() == []
    assert len(said) == 5 and all("changes nothing here: the 4-bit codes stay uint8" in line for line in said)
    assert "bfloat16" in said[-1]
    with pytest.raises(GymUserError, match="quant_storage must be one of float16, float32, int8, uint8"):
        from gym_lightning import CausalLMModule, LoRAArgs

        CausalLMModule(lora=LoRAArgs(), quantization={"quant_storage": "int4"})
