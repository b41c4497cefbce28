"""NF4 storage of the fused 3-D expert weights of a mixture of experts (QLoRA on the experts).

transformers 5 holds a MoE layer's routed experts as fused 3-D parameters of one experts module (the classes its
``use_experts_implementation`` decorates: ``gate_up_proj [E, 2I, h]``, ``down_proj [E, h, I]``; gpt-oss transposed,
``[E, h, 2I]`` and ``[E, I, h]``). Under ``model.quantization`` each such weight ``name`` whose last dim (its input
width in the stored layout) divides into blocks is held as integer parameters named like ``NF4Linear``'s, with
``name`` in place of ``weight``: ``name`` (uint8 codes ``[E, R, C/2]``), ``name_scales``, ``name_scale_stats``
(double quantisation) and ``name_quant_type`` (FP4 only), each with the expert dim first. ``quant.nf4`` keeps every
row's state to itself, so part ``[e]`` of each is the quantisation of expert e alone: FSDP2's dim-0 shards and a
loader's dim-0 "rows" are whole experts, and a rank quantises only the experts it holds, to the same codes as one
process (``models.quantized.RowQuantizer``).

The experts module records which of its weights are NF4, with their settings, in the attribute :data:`ATTRIBUTE`
(``{name: NF4ExpertWeight}``; not a parameter or buffer, so checkpoints hold only the integer tensors, as for
``NF4Linear``). gym's routed forward (``models.experts``) dequantises one routed expert at a time through
:func:`dequantize_expert`.

Building: the 16-bit expert weights are never made. :func:`experts_built_as_nf4` wraps the experts classes'
``__init__`` for one model build (``quant.linear.linears_built_as`` does the same for ``nn.Linear``): while the
modeling code's ``__init__`` runs, tensors it creates without a device are made on the meta device, and the
parameters it assigns are replaced at assignment, before DeepSpeed's ``zero.Init`` partitions the module after its
``__init__``: an NF4 weight by its integer parts, any other (gpt-oss' biases, a weight whose width does not divide
into blocks) by a tensor made as the build would have made it. A Qwen3-30B-A3B layer's experts are 604M parameters,
1.2 GB in bf16: without this, every rank would hold that once per layer under ``zero.Init`` before partitioning.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gym_lightning.quant import nf4
from gym_lightning.quant.config import QuantizationArgs
from gym_lightning.quant.linear import SUFFIXES

# The fused expert weights stored in NF4 (transformers 5's names, every MoE family's); gpt-oss' ``*_bias`` tensors
# and any other parameter of an experts module stay as they are.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# The experts module's record of its NF4 weights: ``{name: NF4ExpertWeight}``.
ATTRIBUTE = "gym_nf4_experts"
# The dtype each quantised part is stored in (integers only: no strategy casts them, ``quant.nf4``); the parts'
# parameters are named as ``quant.linear.SUFFIXES`` says, after the weight's name.
_PART_DTYPES = {"codes": torch.uint8, "scale_stats": torch.int32, "quant_type": torch.uint8}
# The tensor constructors the modeling code's ``__init__`` may call for its weights: made on the meta device there.
_CONSTRUCTORS = ("empty", "zeros", "ones")


@dataclass(frozen=True)
class NF4ExpertWeight:
    """How one fused expert weight is stored in NF4.

    Args:
        shape: The 16-bit weight's shape ``[E, R, C]`` (the stored layout; ``C`` the quantised width).
        block_size: Weights per scale along a row.
        double_quant: Whether the scales are quantised too (``name_scale_stats`` exists).
        quant_type: ``nf4`` or ``fp4``.
        compute_dtype: The dtype an expert is dequantised to.
    """

    shape: tuple[int, ...]
    block_size: int
    double_quant: bool
    quant_type: str
    compute_dtype: torch.dtype


def components(name: str) -> dict[str, str]:
    """``{parameter name: nf4 part}`` of the quantised weight ``name`` (every possible part; an NF4 weight without
    double quantisation has no ``name_scale_stats``, one in NF4 no ``name_quant_type``)."""
    return {name + suffix: part for suffix, part in SUFFIXES.items()}


def nf4_weights_of(experts: nn.Module) -> dict[str, NF4ExpertWeight]:
    """``{name: NF4ExpertWeight}`` of the NF4 weights of one experts module (empty for any other module)."""
    return experts.__dict__.get(ATTRIBUTE, {})


def is_nf4(experts: nn.Module, name: str) -> bool:
    """Whether the weight ``name`` of the experts module ``experts`` is stored in NF4."""
    return name in nf4_weights_of(experts)


def logical_shape(experts: nn.Module, name: str) -> tuple[int, ...]:
    """The shape ``[E, R, C]`` of the 16-bit weight the NF4 weight ``name`` stands for."""
    return nf4_weights_of(experts)[name].shape


def compute_dtype(experts: nn.Module, name: str) -> torch.dtype:
    """The dtype the NF4 weight ``name`` is dequantised to."""
    return nf4_weights_of(experts)[name].compute_dtype


def stored_components(name: str, spec: NF4ExpertWeight) -> dict[str, str]:
    """:func:`components` of the NF4 weight ``name`` that ``spec``'s settings store."""
    absent = {"scale_stats"} if not spec.double_quant else set()
    absent |= {"quant_type"} if spec.quant_type == "nf4" else set()
    return {attr: part for attr, part in components(name).items() if part not in absent}


def parts_of(experts: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The quantised parts of the NF4 weight ``name`` as ``nf4.dequantize`` takes them (``[E, R, x]`` each)."""
    spec = nf4_weights_of(experts)[name]
    return {part: getattr(experts, attr) for attr, part in stored_components(name, spec).items()}


def dequantize_expert(experts: nn.Module, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s weight ``name`` ``[R, C]`` in the stored layout and the compute dtype (a new tensor), from
    that expert's codes and scales alone (views ``[e]`` of the parts: each row is quantised on its own)."""
    spec = nf4_weights_of(experts)[name]
    parts = {part: tensor[e] for part, tensor in parts_of(experts, name).items()}
    return nf4.dequantize(parts, spec.compute_dtype, spec.quant_type)


def nf4_expert_weights(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{model key of the codes: (experts module, weight name)}`` for every NF4 expert weight of ``model`` (keys as
    ``named_parameters`` gives them, peft's wrapper names included)."""
    found: dict[str, tuple[nn.Module, str]] = {}
    for prefix, module in model.named_modules():
        for name in nf4_weights_of(module):
            found[f"{prefix}.{name}" if prefix else name] = (module, name)
    return found


def skipped(name: str, skip_modules: Iterable[str]) -> bool:
    """Whether ``quantization.skip_modules`` names ``name`` (a module or weight): its full name, its last name or a
    dotted suffix of it (``experts``, ``experts.down_proj``), as for linear layers (``models.quantized``)."""
    last = name.rpartition(".")[2]
    return any(skip in (name, last) or name.endswith(f".{skip}") for skip in skip_modules)


# ------------------------------------------------------------------------------------------------ building
def experts_classes(model_class: type) -> list[type[nn.Module]]:
    """The experts classes (``use_experts_implementation``'s) of the modeling module that defines ``model_class``."""
    module = sys.modules.get(model_class.__module__)
    found = vars(module).values() if module is not None else ()
    return [cls for cls in found if isinstance(cls, type) and issubclass(cls, nn.Module) and _is_experts_class(cls)]


def _is_experts_class(cls: type[nn.Module]) -> bool:
    """Whether ``cls`` is decorated by ``use_experts_implementation``: its ``forward`` or (under ``zero.Init``'s
    wrapper, through ``__wrapped__``) its ``__init__`` is the decorator's own code."""
    init_code, forward_code = _decorator_code()
    if getattr(cls.__dict__.get("forward"), "__code__", None) is forward_code:
        return True
    init = cls.__dict__.get("__init__")
    while init is not None:
        if getattr(init, "__code__", None) is init_code:
            return True
        init = getattr(init, "__wrapped__", None)
    return False


@functools.cache
def _decorator_code() -> tuple[Any, Any]:
    """The code objects of the ``__init__`` and ``forward`` that ``use_experts_implementation`` installs (shared
    by every class it decorates), from a probe class decorated once."""
    from transformers.integrations.moe import use_experts_implementation

    probe = use_experts_implementation(type("_Probe", (nn.Module,), {"forward": lambda self, x: x}))
    return probe.__dict__["__init__"].__code__, probe.__dict__["forward"].__code__


@dataclass
class _Build:
    """One experts module being built: its settings, the weights kept in 16 bits, the tensor constructors that
    were current when its ``__init__`` began (``zero.Init``'s, or torch's)."""

    module: nn.Module
    args: QuantizationArgs
    keep: frozenset[str]
    makers: dict[str, Callable[..., torch.Tensor]]


_building: list[_Build] = []  # a stack: the experts module whose ``__init__`` is running (builds are one thread)


@contextmanager
def experts_built_as_nf4(
    classes: Iterable[type[nn.Module]], args: QuantizationArgs, keep: Iterable[str] = ()
) -> Iterator[None]:
    """While open, every experts module of ``classes`` is built with its weights :data:`EXPERT_WEIGHTS` in NF4
    (those of ``keep`` and those whose last dim does not divide by ``args.block_size`` in 16 bits), its 16-bit
    weights never made (the module docstring).

    Args:
        classes: The experts classes (:func:`experts_classes`).
        args: The quantisation settings.
        keep: Weight names built in 16 bits.
    """
    classes = list(dict.fromkeys(classes))
    saved = [(cls, cls.__dict__.get("__init__"), cls.__dict__.get("__setattr__")) for cls in classes]
    kept = frozenset(keep)
    for cls, init, _ in saved:
        cls.__init__ = _nf4_init(init or cls.__init__, args, kept)
        cls.__setattr__ = _placing_setattr
    try:
        yield
    finally:
        for cls, init, setattr_ in saved:
            for attr, value in (("__init__", init), ("__setattr__", setattr_)):
                if value is None:
                    delattr(cls, attr)
                else:
                    setattr(cls, attr, value)


def _nf4_init(init: Callable[..., None], args: QuantizationArgs, keep: frozenset[str]) -> Callable[..., None]:
    """``init`` run with device-less tensor constructors on the meta device and this module's parameters placed by
    :func:`_placing_setattr` (``init`` may be ``zero.Init``'s wrapper: it partitions once everything is placed)."""

    @functools.wraps(init)
    def __init__(self: nn.Module, *args_: Any, **kwargs: Any) -> None:
        makers = {name: getattr(torch, name) for name in _CONSTRUCTORS}
        _building.append(_Build(self, args, keep, makers))
        for name, maker in makers.items():
            setattr(torch, name, functools.partial(_on_meta, maker))
        try:
            init(self, *args_, **kwargs)
        finally:
            for name, maker in makers.items():
                setattr(torch, name, maker)
            _building.pop()

    return __init__


def _on_meta(maker: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``maker(...)`` on the meta device unless the caller names a device (DeepSpeed's partitioning does, and must
    get real storage)."""
    if kwargs.get("device") is None:
        kwargs["device"] = "meta"
    return maker(*args, **kwargs)


def _placing_setattr(self: nn.Module, name: str, value: Any) -> None:
    """``nn.Module.__setattr__``, except that a parameter assigned by the ``__init__`` of an experts module being
    built becomes its NF4 parts (whatever device the modeling code gave it) or, made on the meta device by
    :func:`_on_meta`, a 16-bit tensor made by the build's own constructors."""
    build = _building[-1] if _building else None
    if build is None or build.module is not self or not isinstance(value, nn.Parameter):
        nn.Module.__setattr__(self, name, value)
    elif _quantized(name, value, build):
        _register_nf4(self, name, tuple(value.shape), build)
    elif value.is_meta:
        made = build.makers["empty"](tuple(value.shape), dtype=value.dtype)
        nn.Module.__setattr__(self, name, nn.Parameter(made, requires_grad=value.requires_grad))
    else:
        nn.Module.__setattr__(self, name, value)


def _quantized(name: str, value: torch.Tensor, build: _Build) -> bool:
    return (
        name in EXPERT_WEIGHTS
        and name not in build.keep
        and value.dim() == 3
        and value.shape[-1] % build.args.block_size == 0
    )


def _register_nf4(module: nn.Module, name: str, shape: tuple[int, ...], build: _Build) -> None:
    """The integer parts of the NF4 weight ``name`` (shape ``shape`` in 16 bits) as parameters of ``module``, made
    where the build makes tensors (meta, or ``zero.Init``'s device), and its record in :data:`ATTRIBUTE`."""
    args = build.args
    shapes = nf4.quantized_shapes_of(shape, args.block_size, args.double_quant, args.quant_type)
    dtypes = {**_PART_DTYPES, "scales": torch.uint8 if args.double_quant else torch.int32}
    for attr, part in components(name).items():
        if part in shapes:  # the parts nf4.quantize makes with these settings (stored_components)
            param = nn.Parameter(build.makers["empty"](shapes[part], dtype=dtypes[part]), requires_grad=False)
            param._is_hf_initialized = True  # transformers' init must not draw into integer codes
            nn.Module.__setattr__(module, attr, param)
    record = dict(nf4_weights_of(module))
    record[name] = NF4ExpertWeight(shape, args.block_size, args.double_quant, args.quant_type, args.dtype)
    module.__dict__[ATTRIBUTE] = record


def restore_skipped_experts(model: nn.Module, args: QuantizationArgs, dtype: torch.dtype) -> None:
    """Each experts module of ``model`` with an NF4 weight that ``args.skip_modules`` names (the module, or the
    weight: ``model.layers.3.mlp.experts``, ``experts.down_proj``) built again where it was (the meta device, or
    partitioned under ``zero.Init``) with those weights in 16 bits (``dtype``), its weights left to the loader."""
    for prefix, module in list(model.named_modules()):
        nf4_names = nf4_weights_of(module)
        whole_module = skipped(prefix, args.skip_modules)
        keep = {name for name in nf4_names if whole_module or skipped(f"{prefix}.{name}", args.skip_modules)}
        if not keep:
            continue
        parent, _, attr = prefix.rpartition(".")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # as from_config builds: the model's dtype is the default during its build
        try:
            with experts_built_as_nf4([type(module)], args, keep):
                fresh = type(module)(module.config)
        finally:
            torch.set_default_dtype(previous)
        setattr(model.get_submodule(parent) if parent else model, attr, fresh)


__all__ = [
    "ATTRIBUTE",
    "EXPERT_WEIGHTS",
    "SUFFIXES",
    "NF4ExpertWeight",
    "components",
    "compute_dtype",
    "dequantize_expert",
    "experts_built_as_nf4",
    "experts_classes",
    "is_nf4",
    "logical_shape",
    "nf4_expert_weights",
    "nf4_weights_of",
    "parts_of",
    "restore_skipped_experts",
    "skipped",
    "stored_components",
]
