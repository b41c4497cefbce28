"""The NF4 format (``quant.nf4``) and the layer that holds it (``quant.NF4Linear``): bitsandbytes' first level bit for
bit, rows that quantise alone (what sharded loading needs), the double quantisation's size and error, and a matmul
whose backward dequantises again instead of keeping a 16-bit weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gym_lightning.quant import NF4Linear, nf4
from gym_lightning.quant.linear import linears_built_as


def _weight(rows: int = 96, width: int = 512, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=generator) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_first_level_is_bitsandbytes_nf4_bit_for_bit(dtype: torch.dtype) -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = _weight().to(dtype)
    weight[3, :64] = 0  # an all-zero block
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type="nf4")
    ours = nf4.quantize(weight, block_size=64, double_quant=False)
    assert torch.equal(functional.get_4bit_type("nf4", device="cpu"), torch.tensor(nf4.NF4_VALUES))
    assert torch.equal(ours["codes"].reshape(-1), packed.reshape(-1)), "same codes, same nibble order"
    assert torch.equal(ours["scales"].view(torch.float32).reshape(-1), state.absmax)
    assert torch.equal(nf4.dequantize_reference(ours, dtype), functional.dequantize_4bit(packed, state))


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


def test_linears_built_as_puts_nn_linear_back_even_after_an_error() -> None:
    original = nn.Linear
    with pytest.raises(RuntimeError), linears_built_as(lambda i, o: None):
        assert nn.Linear is not original
        raise RuntimeError("a failed build")
    assert nn.Linear is original
    with linears_built_as(lambda i, o: NF4Linear if i % 64 == 0 else None):
        chosen, kept = nn.Linear(128, 8), nn.Linear(100, 8)
    assert type(chosen) is NF4Linear and type(kept) is original
