"""``NF4Linear``: a frozen linear layer whose weight is stored in NF4 (``quant.nf4``) and dequantised layer by layer
in forward and again in backward, so that no 16-bit copy of a weight outlives its matmul (QLoRA's scheme; bitsandbytes'
``MatMul4Bit`` and torchao's ``linear_nf4`` do the same).

The quantised weight is three ordinary integer parameters of the module (``weight`` codes, ``weight_scales``,
``weight_scale_stats``; an FP4 weight a fourth, ``weight_quant_type``, see ``quant.nf4``), all ``[out_features,
...]``: FSDP2 shards them along their rows, ZeRO-3 partitions them, checkpoints save them and gathers bring them back
like any frozen weight. Nothing lives beside the parameters, so
nothing can be lost when a wrapper replaces them (axolotl PR 2992: bitsandbytes' quant state lost under FSDP2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from gym_lightning.quant import nf4

# The suffix each part's parameter adds to the quantised weight's name (``quant.experts`` names fused expert weights'
# parts the same way, after ``gate_up_proj``/``down_proj``).
SUFFIXES = {"": "codes", "_scales": "scales", "_scale_stats": "scale_stats", "_quant_type": "quant_type"}
# The parameter names of an NF4Linear's quantised weight, after ``weight`` (the codes): their checkpoint tensor is
# the layer's ``weight``.
COMPONENTS = {f"weight{suffix}": part for suffix, part in SUFFIXES.items()}


class _NF4Matmul(torch.autograd.Function):
    """``x @ W.T + b`` with ``W`` dequantised in forward and again in backward (only the codes are saved)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: NF4Linear) -> torch.Tensor:
        weight = layer.dequantized()
        ctx.layer, ctx.input_dtype = layer, x.dtype
        dtype = weight.dtype
        out = nn.functional.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        weight = ctx.layer.dequantized()
        return (grad.to(weight.dtype) @ weight).to(ctx.input_dtype), None, None


class NF4Linear(nn.Linear):
    """A frozen ``nn.Linear`` with its weight in NF4 or FP4 (an ``nn.Linear`` to peft, which wraps it with LoRA
    adapters).

    Args:
        in_features: Input width; must divide by ``block_size``.
        out_features: Output width.
        bias: Whether the layer has a (frozen, unquantised) bias.
        device: Where its tensors are created (``meta`` for a deferred load).
        dtype: The bias dtype.
        block_size: Inputs per NF4 scale (64 in QLoRA).
        double_quant: Quantise the scales too (about 0.37 bits per weight less).
        compute_dtype: The dtype the weight is dequantised to and the matmul runs in.
        quant_type: The 4-bit code book: ``nf4`` or bitsandbytes' ``fp4``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        block_size: int = 64,
        double_quant: bool = True,
        compute_dtype: torch.dtype = torch.bfloat16,
        quant_type: str = "nf4",
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the full-precision weight
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.double_quant, self.compute_dtype = block_size, double_quant, compute_dtype
        self.quant_type = quant_type
        shapes = nf4.quantized_shapes(out_features, in_features, block_size, double_quant, quant_type)
        dtypes = {"codes": torch.uint8, "quant_type": torch.uint8}
        dtypes["scales"] = torch.uint8 if double_quant else torch.int32
        for name, part in COMPONENTS.items():
            if part in shapes:
                tensor = torch.empty(shapes[part], dtype=dtypes.get(part, torch.int32), device=device)
                self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        for name in COMPONENTS:
            if (param := getattr(self, name, None)) is not None:
                param._is_hf_initialized = True  # transformers' init must not draw into integer codes

    def parts(self) -> dict[str, torch.Tensor]:
        """The quantised weight as ``nf4.dequantize`` takes it."""
        return {part: getattr(self, name) for name, part in COMPONENTS.items() if hasattr(self, name)}

    def load_quantized(self, parts: dict[str, torch.Tensor]) -> None:
        """Copy quantised ``parts`` (``nf4.quantize``'s output for this layer's weight) into the parameters."""
        for name, part in COMPONENTS.items():
            if hasattr(self, name):
                getattr(self, name).data.copy_(parts[part])

    def dequantized(self) -> torch.Tensor:
        """The full weight ``[out, in]`` in the compute dtype (a new tensor)."""
        return nf4.dequantize(self.parts(), self.compute_dtype, self.quant_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NF4Matmul.apply(x, self.bias, self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.quant_type} block_size={self.block_size}, double_quant={self.double_quant}, "
            f"compute_dtype={self.compute_dtype}"
        )


@contextmanager
def linears_built_as(choose: Callable[[int, int], Callable[..., nn.Module] | None]) -> Iterator[None]:
    """While open, ``nn.Linear(in, out, ...)`` builds what ``choose(in, out)`` returns (a factory taking
    ``nn.Linear``'s arguments), or an ``nn.Linear`` when it returns ``None``.

    Why at construction: ZeRO-3 partitions each module as ``zero.Init`` finishes its ``__init__``, so a layer built
    as ``nn.Linear`` and swapped afterwards would first hold its 16-bit weight (1/N of the model per rank, four times
    the 4-bit base). transformers' modeling code creates its layers as ``nn.Linear(...)`` through ``torch.nn``, which
    is what is replaced here, for the duration of one model build. ``isinstance(x, nn.Linear)`` inside that build
    sees the stand-in class: transformers' constructors do not ask it.
    """
    original = nn.Linear

    class _Chooser(original):  # type: ignore[misc, valid-type]
        def __new__(cls, in_features: int, out_features: int, *args: Any, **kwargs: Any) -> nn.Module:
            factory = choose(in_features, out_features) or original
            return factory(in_features, out_features, *args, **kwargs)

    nn.Linear = _Chooser  # type: ignore[misc]
    try:
        yield
    finally:
        nn.Linear = original  # type: ignore[misc]


__all__ = ["COMPONENTS", "SUFFIXES", "NF4Linear", "linears_built_as"]
