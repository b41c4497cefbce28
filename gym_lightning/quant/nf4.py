"""NF4 (4-bit NormalFloat, QLoRA: Dettmers et al. 2023, https://arxiv.org/abs/2305.14314) as plain integer tensors
whose every row stands alone: pure functions, no module, no library state. bitsandbytes' FP4 is the same format with
another 16-value code book (``quant_type="fp4"``, :data:`FP4_VALUES`); everything below holds for both.

The first level is bitsandbytes' NF4 exactly (its 16-value code book, blocks of ``block_size`` consecutive inputs of
one output row scaled by their absolute maximum, two codes per byte with the first in the high nibble; equal codes
and scales to ``bitsandbytes.functional.quantize_4bit`` for the same blocks: tests/quant/test_nf4.py). What differs
is what sharding needs:

- **Row-local state.** bitsandbytes and torchao both quantise the block scales a second time ("double
  quantisation") around one mean of the *whole* tensor, so no slice of a weight can be quantised without reading
  all of it. Here the second level is per output row: the row's scales minus their mean, in int8 blocks of 256
  along the row (torchao's linear int8 scheme). Rows ``a:b`` of a quantised weight are then the quantisation of rows
  ``a:b`` of the weight alone, which is what lets every rank read and quantise only its shard's rows (FSDP2's
  ``Shard(0)``, a ZeRO-3 partition's span) and makes the quantised base the same whatever the rank count.
- **Integer storage only.** Every strategy casts *floating* parameters somewhere (``zero.Init`` to the training
  dtype, DeepSpeed's engine for ZeRO-1/2, Lightning's ``bf16-true``); none casts integers. So the fp32 scales are
  kept as their bits in int32 tensors, and no strategy can change a quantised value (bitsandbytes 1945: NF4 packed
  in bf16 corrupted by NaN canonicalisation; its ``quant_storage=bfloat16`` exists for flat-parameter wrappers,
  FSDP1 and DeepSpeed's flat buffers, which gym_lightning does not use: FSDP2 and ZeRO-3 shard per parameter).
- **Self-describing FP4.** An FP4 weight carries one more tensor, ``quant_type`` (uint8 ``[rows, 1]``, the index
  of its code book in :data:`QUANT_TYPES`): a checkpoint's tensors alone then say how to dequantise them (``gym
  export`` reads no hyper-parameters), and the row layout keeps it shardable like the others. NF4 weights have none,
  so their tensors are those of every earlier checkpoint.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

# The NF4 code book (QLoRA, Appendix E; bitsandbytes' ``get_4bit_type("nf4")``, torchao's ``NF4``): the quantiles
# of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# bitsandbytes' FP4 code book (``get_4bit_type("fp4")``), in code order: 1 sign, 2 exponent and 1 mantissa bits,
# the magnitudes 0, 0.0625, 8, 12, 4, 6, 2, 3 scaled by 1/12 to [-1, 1] in fp32 (code 8, "-0", is +0 there too).
FP4_VALUES = (
    0.0,
    0.0052083334885537624,
    0.6666666865348816,
    1.0,
    0.3333333432674408,
    0.5,
    0.1666666716337204,
    0.25,
    0.0,
    -0.0052083334885537624,
    -0.6666666865348816,
    -1.0,
    -0.3333333432674408,
    -0.5,
    -0.1666666716337204,
    -0.25,
)
# The code books by name; a weight's ``quant_type`` tensor holds the index of its own here.
QUANT_TYPES = ("nf4", "fp4")
CODE_BOOKS = {"nf4": NF4_VALUES, "fp4": FP4_VALUES}
# Scales of the second level: int8 blocks of this many scales along a row (torchao's scaler_block_size). Bits per
# weight: 4 + 32/64 = 4.5 with fp32 scales; 4 + 8/64 + 32·(1 + ceil(k/256))/in with the second level (k = in/64
# scales per row): 4.141 at 4,096 wide, 4.133 at 8,192 (bitsandbytes' global second level: 4.127).
SCALE_BLOCK = 256
# Elements (de)quantised at once: bounds the int64 index and fp32 temporaries of a call (about 17 MiB).
_CHUNK = 1 << 20


# Made at import, not per call: inside DeepSpeed's zero.Init every floating tensor a constructor makes is cast to the
# training dtype (a bf16 code book there changed the codes, measured by benchmarks/qlora_libs.py).
_TABLES = {name: torch.tensor(values, dtype=torch.float32) for name, values in CODE_BOOKS.items()}


def _sorted_bounds(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The midpoints of the sorted code book and the code of each sorted entry, for bucketize: bitsandbytes' own
    bounds (FP4's code book is in bit order, not value order; its two zeros sort as codes 0, 8, as there)."""
    order = torch.argsort(table, stable=True)
    return (table[order[:-1]] + table[order[1:]]) / 2, order.to(torch.uint8)


_BOUNDS = {name: _sorted_bounds(table) for name, table in _TABLES.items()}


@functools.cache
def _table(device: torch.device, quant_type: str = "nf4") -> torch.Tensor:
    """The code book on ``device``, copied there once (not a host-to-device copy per layer and pass)."""
    return _TABLES[quant_type].to(device)


@functools.cache
def _bounds(device: torch.device, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`_BOUNDS` of ``quant_type`` on ``device``, copied there once."""
    midpoints, order = _BOUNDS[quant_type]
    return midpoints.to(device), order.to(device)


def quant_type_of(parts: dict[str, torch.Tensor]) -> str:
    """The code book of quantised ``parts``: the one their ``quant_type`` tensor names, NF4 without one."""
    marker = parts.get("quant_type")
    if marker is None or not marker.numel():
        return "nf4"
    return QUANT_TYPES[int(marker.reshape(-1)[0])]


def quantized_shapes(
    out_features: int, in_features: int, block_size: int, double_quant: bool, quant_type: str = "nf4"
) -> dict[str, tuple]:
    """The shapes of the tensors :func:`quantize` returns for an ``[out, in]`` weight (all of them ``[out, ...]``)."""
    k = in_features // block_size
    shapes = {"codes": (out_features, in_features // 2), "scales": (out_features, k)}
    if double_quant:
        shapes["scale_stats"] = (out_features, 1 + math.ceil(k / SCALE_BLOCK))
    if quant_type != "nf4":
        shapes["quant_type"] = (out_features, 1)
    return shapes


def quantized_shapes_of(
    shape: tuple[int, ...], block_size: int, double_quant: bool, quant_type: str = "nf4"
) -> dict[str, tuple]:
    """:func:`quantized_shapes` of a weight of any ``shape [..., rows, in]`` (e.g. fused experts ``[E, R, C]``):
    every part keeps the leading dims and the rows, ``[..., rows, x]``."""
    *lead, width = shape
    flat = quantized_shapes(math.prod(lead), width, block_size, double_quant, quant_type)
    return {part: (*lead, part_shape[1]) for part, part_shape in flat.items()}


def quantize(
    weight: torch.Tensor, block_size: int = 64, double_quant: bool = True, quant_type: str = "nf4"
) -> dict[str, torch.Tensor]:
    """``weight [rows, in]`` in NF4 (or FP4): ``codes`` uint8 ``[rows, in/2]``, ``scales`` (int32 bits of the fp32
    block maxima ``[rows, in/block]``, or with ``double_quant`` their uint8 codes), ``scale_stats`` (int32 bits of
    each row's scale mean and per-256 int8 step) and, for FP4, ``quant_type`` (see the module docstring). Rows are
    quantised independently (a bounded number at a time, so the fp32 and index temporaries stay small); ``in`` must
    divide by ``block_size``. A weight with leading dims (``[E, rows, in]``, fused experts) is quantised as its
    ``[E * rows, in]`` rows and every part keeps the leading dims: part ``[e]`` is then the quantisation of
    ``weight[e]`` alone."""
    if weight.dim() != 2:
        parts = quantize(weight.reshape(-1, weight.shape[-1]), block_size, double_quant, quant_type)
        return {part: value.reshape(*weight.shape[:-1], value.shape[-1]) for part, value in parts.items()}
    rows, width = weight.shape
    step = max(1, _CHUNK // max(1, width))
    chunks = [_quantize_rows(weight[start : start + step], block_size, quant_type) for start in range(0, rows, step)]
    codes = torch.cat([c for c, _ in chunks]) if chunks else torch.empty(0, width // 2, dtype=torch.uint8)
    absmax = torch.cat([a for _, a in chunks]) if chunks else torch.empty(0, width // block_size)
    parts = {"codes": codes, "scales": absmax.view(torch.int32)}
    if double_quant:
        parts["scales"], parts["scale_stats"] = _quantize_scales(absmax)
    if quant_type != "nf4":
        marker = QUANT_TYPES.index(quant_type)
        parts["quant_type"] = torch.full((rows, 1), marker, dtype=torch.uint8, device=weight.device)
    return parts


def _quantize_rows(weight: torch.Tensor, block_size: int, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and fp32 block maxima of a few rows, with bitsandbytes' own arithmetic (its torch
    ``quantize_4bit``: scaled by the reciprocal of the maximum, clamped, the first midpoint above, mapped to the code
    of that entry), so that the codes are its codes for fp32 inputs too."""
    rows, width = weight.shape
    blocks = weight.detach().float().reshape(rows, width // block_size, block_size)
    absmax = blocks.abs().amax(dim=-1)
    normed = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
    midpoints, order = _bounds(weight.device, quant_type)
    index = order[torch.bucketize(normed.reshape(rows, width), midpoints)]
    return (index[:, 0::2] << 4) | index[:, 1::2], absmax


def _quantize_scales(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block maxima minus their mean, in symmetric int8 blocks of :data:`SCALE_BLOCK` (stored +128)."""
    rows, k = absmax.shape
    mean = absmax.mean(dim=1, keepdim=True)
    centred = absmax - mean
    padded = torch.nn.functional.pad(centred, (0, -k % SCALE_BLOCK)).reshape(rows, -1, SCALE_BLOCK)
    step = padded.abs().amax(dim=-1) / 127
    step = torch.where(step == 0, 1.0, step)
    q = torch.round(padded / step.unsqueeze(-1)).clamp(-127, 127).reshape(rows, -1)[:, :k]
    stats = torch.cat([mean, step], dim=1).contiguous()
    return (q + 128).to(torch.uint8), stats.view(torch.int32)


def block_scales(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 block maxima ``[rows, in/block]`` of quantised ``parts``."""
    scales = parts["scales"]
    if "scale_stats" not in parts:
        return scales.view(torch.float32)
    stats = parts["scale_stats"].view(torch.float32)
    k = scales.shape[1]
    step = stats[:, 1:].repeat_interleave(SCALE_BLOCK, dim=1)[:, :k]
    return (scales.float() - 128) * step + stats[:, :1]


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype, quant_type: str | None = None) -> torch.Tensor:
    """The ``[rows, in]`` weight in ``dtype``: each value computed in fp32 (code × block scale) and rounded once.
    ``quant_type``: the code book, where the caller knows it (a layer: no device read); else :func:`quant_type_of`.
    Parts with leading dims (``[E, rows, x]``, :func:`quantize` of fused experts) give ``[E, rows, in]``.

    With bitsandbytes installed (the ``qlora`` extra) its ``dequantize_4bit`` kernel does it, on our codes and our
    decoded block scales (the first level is its format; an order of magnitude faster than
    :func:`dequantize_reference`: docs/benchmarks-history.md, "bitsandbytes' NF4 dequantisation kernel"); the result
    is the same bit for bit (tests/quant/test_nf4.py), so a run does not depend on whether it is installed.
    """
    codes = parts["codes"]
    if codes.dim() != 2:  # leading dims (fused experts): every row stands alone, so dequantise the rows
        flat = {part: value.reshape(-1, value.shape[-1]) for part, value in parts.items()}
        return dequantize(flat, dtype, quant_type).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
    kernel = _bitsandbytes()
    block = 2 * codes.shape[1] // max(1, parts["scales"].shape[1])
    quant_type = quant_type or quant_type_of(parts)
    if kernel is None or block not in _KERNEL_BLOCKS or dtype not in _KERNEL_DTYPES or not codes.numel():
        return dequantize_reference(parts, dtype, quant_type)
    rows, half = codes.shape
    state = kernel.QuantState(
        absmax=block_scales(parts).reshape(-1).contiguous(),
        shape=torch.Size((rows, 2 * half)),
        code=_table(codes.device, quant_type),
        blocksize=block,
        quant_type=quant_type,
        dtype=dtype,
    )
    return kernel.dequantize_4bit(codes.reshape(-1, 1).contiguous(), state)


_KERNEL_BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' kernels take
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _bitsandbytes() -> ModuleType | None:
    """``bitsandbytes.functional`` where it is installed, else ``None`` (the pure-torch path then)."""
    try:
        import bitsandbytes.functional as functional
    except ImportError:
        return None
    return functional


def dequantize_reference(
    parts: dict[str, torch.Tensor], dtype: torch.dtype, quant_type: str | None = None
) -> torch.Tensor:
    """:func:`dequantize` in plain torch, a bounded number of rows at a time so that no fp32 copy of the weight
    exists (any device, any block size)."""
    codes = parts["codes"]
    rows, half = codes.shape
    scales = block_scales(parts)
    block = 2 * half // scales.shape[1]
    table = _table(codes.device, quant_type or quant_type_of(parts))
    out = torch.empty(rows, 2 * half, dtype=dtype, device=codes.device)
    step = max(1, _CHUNK // max(1, 2 * half))
    for start in range(0, rows, step):
        chunk = codes[start : start + step]
        index = torch.stack([chunk >> 4, chunk & 15], dim=-1).reshape(chunk.shape[0], -1).long()
        values = table[index].reshape(chunk.shape[0], -1, block) * scales[start : start + step].unsqueeze(-1)
        out[start : start + step] = values.reshape(chunk.shape[0], -1)
    return out


__all__ = [
    "CODE_BOOKS",
    "FP4_VALUES",
    "NF4_VALUES",
    "QUANT_TYPES",
    "SCALE_BLOCK",
    "block_scales",
    "dequantize",
    "dequantize_reference",
    "quant_type_of",
    "quantize",
    "quantized_shapes",
    "quantized_shapes_of",
]
