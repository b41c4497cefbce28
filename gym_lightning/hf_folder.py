"""The one exporter: a Hugging Face folder from a live run (``HFExport`` at the end of ``fit``, any strategy) or from
a checkpoint of any strategy (``gym export``, ``gym_lightning.checkpointing.reading``).

Both paths describe the model the same way, as an ``ExportSource``: its tensors as ``LazyTensor``s keyed like the
Hugging Face (or PEFT) model's ``state_dict``, the base model (config, generation config, tied weights; on the meta
device for a checkpoint), the LoRA config and scale, the tokenizer. :func:`write_export` writes it: LoRA merged or
kept as an adapter, tied weights dropped, ``save_pretrained``'s layout and dtype, safetensors streamed one tensor at
a time.

In a live run loading a sharded tensor is a collective (FSDP2's ``full_tensor``, ZeRO-3's ``GatheredParameters``), so
every rank walks the same shard plan and only global rank 0 keeps and writes.

Why not ``save_pretrained(state_dict=...)``: it needs the whole state dict in one process (280 GB in fp32 for a 70B
model). torch distributed checkpoint's Hugging Face storage writer writes each rank's own slices, but only for DTensor
state dicts (not ZeRO-3 partitions, nor a checkpoint on disk) and with neither LoRA merging nor a dtype choice; the
shard loop below is the small part none of them does.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from gym_lightning.atomic import atomic_directory
from gym_lightning.errors import GymUserError
from gym_lightning.lazy import LazyTensor, full_tensors_of
from gym_lightning.models.conversion import checkpoint_layout
from gym_lightning.models.quantized import dequantized_tensors

if TYPE_CHECKING:
    import lightning.pytorch as pl

LoRAExport = Literal["merged", "adapter"]
ExportDType = Literal["source", "float32", "bfloat16", "float16"]
LORA_EXPORTS: tuple[str, ...] = get_args(LoRAExport)
EXPORT_DTYPES: tuple[str, ...] = get_args(ExportDType)
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers 4's save_pretrained default: files most hosts and tools accept

_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class ParameterAdapter:
    """What one peft ``ParamWrapper`` adapts: its factors' keys name the wrapper, not the parameter.

    Args:
        parameter: The name of the adapted parameter in the module the wrapper holds (``gate_up_proj``,
            ``down_proj``, ``weight``): peft's ``ParamWrapper.parameter_name``.
        transposed: Whether that parameter stores each expert as ``[in, out]`` (gpt-oss's ``is_transposed``), so
            an expert's ``[out, in]`` delta is added transposed.
    """

    parameter: str
    transposed: bool = False


@dataclass
class ExportSource:
    """A model to export, however it is held.

    Args:
        tensors: The model's tensors keyed as the Hugging Face model's (or the PEFT model's) ``state_dict``.
        base: The Hugging Face model (PEFT's base model for LoRA); may live on the meta device.
        lora_config: The ``peft.LoraConfig`` of a LoRA run, else ``None``.
        lora_scaling: The scale to merge adapters with (``alpha / r``), else ``None``.
        tokenizer: Saved beside the weights when given.
        parameter_adapters: ``{peft ParamWrapper's name, keyed as tensors: what it adapts}``
            (:func:`parameter_adapters` of a model with the same LoRA applied); empty without parameter targets.
    """

    tensors: dict[str, LazyTensor]
    base: PreTrainedModel
    lora_config: Any | None
    lora_scaling: float | None
    tokenizer: PreTrainedTokenizerBase | None
    parameter_adapters: dict[str, ParameterAdapter] = field(default_factory=dict)


def parse_size(text: str | int) -> int:
    """``"2GB"`` -> 2e9 bytes, ``"500MiB"``, ``"1000"`` or ``1000`` (bytes)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _SIZE.match(str(text))
    unit = match[2].upper() if match else ""
    if not match or (unit not in _UNITS and unit + "B" not in _UNITS) or float(match[1]) <= 0:
        raise GymUserError(f"max_shard_size {text!r} is not a size; use e.g. 5GB, 500MB, 800MiB or a byte count.")
    return max(1, int(float(match[1]) * _UNITS.get(unit, _UNITS.get(unit + "B", 1))))


def export_problems(lora: str, dtype: str, max_shard_size: str | int) -> list[str]:
    """Everything wrong with export settings, for one message."""
    problems = []
    if lora not in LORA_EXPORTS:
        problems.append(f"lora={lora!r} is not one of {LORA_EXPORTS} (merge the adapters, or write a PEFT adapter).")
    if dtype not in EXPORT_DTYPES:
        problems.append(f"dtype={dtype!r} is not one of {EXPORT_DTYPES}.")
    try:
        parse_size(max_shard_size)
    except GymUserError as err:
        problems.append(str(err))
    return problems


# ------------------------------------------------------------------------------------------------ tensor names
_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")  # peft's infix, repeated where wrappers nest (experts: twice)


def parameter_adapters(model: nn.Module) -> dict[str, ParameterAdapter]:
    """``{name: what it adapts}`` of every peft ``ParamWrapper`` in ``model`` (names as ``model.state_dict()``'s
    keys start). Read from the wrappers themselves: which of an experts module's weights a factor pair adapts is
    the wrapper's ``parameter_name`` (the inner and outer wrappers' keys differ only by a ``base_layer``), never
    told by shapes (``gate_up_proj``'s ``lora_A [r * E, h]`` and ``down_proj``'s ``[r * E, I]`` are alike when
    ``I = h``, their ``lora_B`` when ``2I = h``)."""
    try:
        from peft.tuners.lora import ParamWrapper
    except ImportError:  # no peft: no adapters of any kind
        return {}
    from gym_lightning.models.experts import base_experts

    return {
        name: ParameterAdapter(module.parameter_name, bool(getattr(base_experts(module), "is_transposed", False)))
        for name, module in model.named_modules()
        if isinstance(module, ParamWrapper)
    }


def hf_tensors(source: ExportSource, lora: LoRAExport, dtype: torch.dtype | None = None) -> dict[str, LazyTensor]:
    """The tensors to write, under the names ``from_pretrained`` (or PEFT, for ``lora="adapter"``) expects; a 4-bit
    base (QLoRA) dequantised a layer at a time (written in the export's dtype, the source folder's by default).
    Merged LoRA weights come out in ``dtype``, the export's (default: fp32, or the weight's dtype if wider)."""
    tensors = dequantized_tensors(source.tensors)
    factors: dict[str, dict[str, LazyTensor]] = {}
    for key, value in tensors.items():
        if match := _LORA_KEY.match(key):
            factors.setdefault(match["module"], {})[match["which"]] = value
    if factors and lora == "adapter":
        # PEFT's adapter files name the factors without the adapter name ("...lora_A.weight").
        return {
            _LORA_KEY.sub(r"\g<module>.lora_\g<which>.weight", k): v for k, v in tensors.items() if _LORA_KEY.match(k)
        }
    if factors and source.lora_scaling is None:
        raise GymUserError("The model has LoRA adapters but no LoRA scale to merge them with (alpha / r).")
    out: dict[str, LazyTensor] = {}
    merged: set[str] = set()
    for key, value in tensors.items():
        if _LORA_KEY.match(key):
            continue
        name = _BASE_LAYER.sub("", key.removeprefix(_PEFT_PREFIX))
        adapters = _adapters_of(key, factors, source.parameter_adapters)
        merged.update(adapters)
        if adapters:
            scaling = float(source.lora_scaling or 0.0)
            out[name] = _merged(value, [factors[m] for m in adapters], adapters, scaling, dtype)
        else:
            out[name] = value
    _refuse_unmerged(sorted(set(factors) - merged))
    for target, tied_source in tied_weights(source.base).items():
        if tied_source in out:
            out.pop(target, None)  # save_pretrained keeps the tie's source only; from_pretrained re-ties
    return out


def _adapters_of(
    key: str, factors: dict[str, dict[str, LazyTensor]], wrappers: dict[str, ParameterAdapter]
) -> dict[str, ParameterAdapter]:
    """``{LoRA module: how it adapts}`` of the adapters to merge into the tensor ``key``: a LoRA layer's
    ``X.base_layer.weight`` takes ``X``'s factors; a parameter ``P`` held at ``X.base_layer[.base_layer...].P`` takes
    those of each wrapper ``X``, ``X.base_layer``, ... whose ``parameter_name`` is ``P``."""
    owner, _, parameter = key.rpartition(".")
    found: dict[str, ParameterAdapter] = {}
    while owner.endswith(".base_layer"):
        owner = owner.removesuffix(".base_layer")
        wrapper = wrappers.get(owner)
        adapts = wrapper.parameter if wrapper is not None else "weight"  # a LoRA layer (lora.Linear) adapts weight
        if owner in factors and parameter == adapts:
            found[owner] = wrapper or ParameterAdapter("weight")
    return found


def _refuse_unmerged(modules: list[str]) -> None:
    """Refuse to write a merged model that would silently lose the adapters of ``modules`` (factor pairs that no
    weight took: a ``ParamWrapper``'s, when the source does not say which parameter it adapts)."""
    if modules:
        shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
        raise GymUserError(
            f"Cannot merge the LoRA adapters of {shown}: no weight of the model is the one they adapt (adapters of a "
            "parameter, peft's target_parameters, need the model's ParamWrappers to tell which: "
            "ExportSource.parameter_adapters). Export them with lora='adapter', or give the source its "
            "parameter_adapters (hf_folder.parameter_adapters of the model with the same LoRA applied)."
        )


def _merged(
    weight: LazyTensor,
    pairs: list[dict[str, LazyTensor]],
    how: dict[str, ParameterAdapter],
    scaling: float,
    dtype: torch.dtype | None = None,
) -> LazyTensor:
    """``weight`` with each factor pair's delta added in fp32: ``scale * B @ A`` for a 2-D weight, per expert
    ``scale * B_e @ A_e`` (peft's layout: ``A_e = A.view(E, r, in)[e]``, ``B_e = B.view(out, r, E)[:, :, e]``) for
    a fused 3-D one, so no ``[E, out, in]`` delta is ever made beside the merged copy.

    The sum is rounded once, to ``dtype`` (the export's; default: fp32, or the weight's dtype if wider), never to
    the weight's own dtype: that made ``--dtype float32`` of a LoRA run on a bf16 folder (frozen bf16 base weights)
    write bf16-rounded merged weights, which the PEFT adapter applied to that folder does not have. A 16-bit export
    keeps the merged tensor 16-bit, so a fused expert group held for the layout conversion is no larger than before.
    The factors are read as fp32 (``load_cast``: a ZeRO run's fp32 masters, not its 16-bit module copies).
    """
    for pair in pairs:
        if set(pair) != {"A", "B"}:
            raise GymUserError(f"Cannot merge LoRA weights: found only lora_{''.join(pair)} for one layer.")
    transposed = [adapter.transposed for adapter in how.values()]
    merged_dtype = dtype or torch.promote_types(weight.dtype, torch.float32)

    def load() -> torch.Tensor:
        base = weight.load()
        if base.dim() == 2 and len(pairs) == 1:  # a linear layer: as before, one expression
            delta = (pairs[0]["B"].load_cast(torch.float32) @ pairs[0]["A"].load_cast(torch.float32)) * scaling
            return (base.float() + delta).to(merged_dtype)
        out = base.to(torch.float32, copy=True)  # never the (live) tensor itself
        for pair, flip in zip(pairs, transposed, strict=True):
            a, b = pair["A"].load_cast(torch.float32), pair["B"].load_cast(torch.float32)
            _add_expert_deltas(out, a, b, scaling, flip)
        return out.to(merged_dtype)

    return LazyTensor(weight.shape, merged_dtype, load)


def _add_expert_deltas(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, flip: bool) -> None:
    """``weight[e] += scaling * B_e @ A_e`` (``.T`` where ``flip``) for every expert of a fused ``[E, ...]`` weight
    (a 2-D weight is one expert)."""
    stack = weight if weight.dim() == 3 else weight.unsqueeze(0)
    experts = stack.shape[0]
    a_e = a.view(experts, -1, a.shape[-1])  # [E, r, in]
    b_e = b.view(b.shape[0], -1, experts)  # [out, r, E]
    for e in range(experts):
        delta = (b_e[:, :, e] @ a_e[e]) * scaling  # [out, in]
        stack[e] += delta.t() if flip else delta


def tied_weights(base: PreTrainedModel) -> dict[str, str]:
    """``{target: source}`` of the base model's tied weights (``lm_head.weight`` -> the input embeddings)."""
    return dict(getattr(base, "all_tied_weights_keys", None) or {})


# ------------------------------------------------------------------------------------------------ dtype
def source_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype the model's source folder (or hub repository) records in its config.json; float32 when there is
    none (presets, random initialisation) or it names no floating dtype.

    Read from the source, not from ``config.dtype``: ``from_pretrained(dtype=float32)`` rewrites the latter, so a
    bf16 checkpoint trained with fp32 weights would otherwise export as fp32, and a live export and the export of
    the same run's checkpoint would differ.
    """
    name = config.name_or_path
    value = None
    if name:
        try:
            values, _ = PretrainedConfig.get_config_dict(name)
            value = values.get("dtype") or values.get("torch_dtype")
        except (OSError, ValueError):
            value = None
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export_dtype(source: ExportSource, dtype: ExportDType, lora: LoRAExport) -> torch.dtype | None:
    """The dtype to write (``None``: keep each tensor's own, as PEFT does for adapters)."""
    if dtype != "source":
        return getattr(torch, dtype)
    if source.lora_config is not None and lora == "adapter":
        return None
    return source_dtype(source.base.config)


# ------------------------------------------------------------------------------------------------ writing
def plan_shards(tensors: dict[str, LazyTensor], max_shard_size: int, dtype: torch.dtype | None) -> list[list[str]]:
    """Keys grouped in order into shards of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.nbytes(dtype)
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return [shard for shard in shards if shard]


def write_shards(
    tensors: dict[str, LazyTensor], folder: Path | None, max_shard_size: int, stem: str, dtype: torch.dtype | None
) -> None:
    """Write ``<stem>.safetensors``, or ``<stem>-0000i-of-0000n.safetensors`` and their index, one tensor in memory
    at a time. With ``folder=None`` (ranks that do not write) every tensor is still loaded, in the same order and
    by the same call as the writing rank's (``load_cast``), because loading a sharded tensor is a collective: a
    ZeRO-3 master read (``load_cast``) beside a module gather (``load``) would pair different collectives."""
    shards = plan_shards(tensors, max_shard_size, dtype)
    weight_map: dict[str, str] = {}
    for index, keys in enumerate(shards, start=1):
        name = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{index:05d}-of-{len(shards):05d}.safetensors"
        if folder is None:
            for key in keys:
                tensors[key].load_cast(dtype or tensors[key].dtype)
        else:
            _stream_safetensors({key: tensors[key] for key in keys}, folder / name, dtype)
        weight_map.update(dict.fromkeys(keys, name))
    if folder is not None and len(shards) > 1:
        total = sum(tensor.nbytes(dtype) for tensor in tensors.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


# The safetensors format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length,
# a JSON header {name: {dtype, shape, data_offsets}} padded to 8 bytes, then the raw little-endian bytes. It is
# written by hand, tensor by tensor, because ``safetensors.torch.save_file`` takes a whole shard as a dict of tensors,
# so a shard (up to max_shard_size, 5 GB by default) would be in memory at once (docs/benchmarks-history.md,
# "Streaming the export's safetensors").
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def _safetensors_header(tensors: dict[str, LazyTensor], dtype: torch.dtype | None) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, tensor in tensors.items():
        stored = dtype or tensor.dtype
        if stored not in _SAFETENSORS_DTYPES:
            raise GymUserError(f"Cannot export {key!r}: safetensors has no dtype for {stored}.")
        end = offset + tensor.nbytes(dtype)
        entries[key] = {
            "dtype": _SAFETENSORS_DTYPES[stored],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _stream_safetensors(tensors: dict[str, LazyTensor], path: Path, dtype: torch.dtype | None) -> None:
    with open(path, "wb") as file:
        file.write(_safetensors_header(tensors, dtype))
        for key, lazy in tensors.items():
            tensor = lazy.load_cast(dtype or lazy.dtype).contiguous()
            if tuple(tensor.shape) != tuple(lazy.shape):
                raise RuntimeError(f"{key}: loaded shape {tuple(tensor.shape)}, expected {lazy.shape}")
            file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
        file.flush()
        os.fsync(file.fileno())


def write_export(
    source: ExportSource,
    output_dir: str | Path,
    *,
    writer: bool = True,
    lora: LoRAExport = "merged",
    dtype: ExportDType = "source",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``source`` as a Hugging Face folder (or a PEFT adapter folder) at ``output_dir``. Every rank of a live
    run calls it (``writer`` only on the one that writes). It

    - renames PEFT keys to the base model's and merges LoRA (``W + scale * B @ A``) one layer at a time, or keeps
      only the adapter, under the names and in the files PEFT's ``save_pretrained`` writes (``lora="adapter"``).
      Adapters of parameters (peft's ``ParamWrapper``: a mixture of experts' fused 3-D weights, shared experts
      targeted by parameter) merge into the parameter the wrapper names, which only the model knows
      (``ExportSource.parameter_adapters``), one expert at a time: ``W_e += scale * B_e @ A_e`` (transposed where
      the experts store ``[in, out]``, gpt-oss);
    - drops tied weights as ``save_pretrained`` does: the targets of the base model's ``all_tied_weights_keys``;
    - writes the checkpoint layout ``save_pretrained`` writes (``models.conversion.checkpoint_layout``: a mixture of
      experts' fused 3-D expert tensors go back to one tensor per expert), converting one layer's group at a time;
    - casts to the export dtype: by default (``"source"``) the dtype the source folder's config.json records (what
      the run started from: a bf16 checkpoint exports as bf16 even if training kept fp32 weights), float32 for
      presets and random initialisations; adapters keep their own dtype, as PEFT saves them;
    - streams safetensors files (with an index when there is more than one) tensor by tensor, so one tensor (as
      gathered and as cast) is in memory at a time, not a shard nor the model; then writes config.json,
      generation_config.json and the tokenizer with its chat template (adapter_config.json instead of the configs
      for an adapter), all inside ``atomic_directory``.
    """
    from gym_lightning.errors import raise_if_problems

    raise_if_problems("Export settings", export_problems(lora, dtype, max_shard_size))
    if lora == "adapter" and source.lora_config is None:
        raise GymUserError("lora='adapter' exports LoRA adapters, but this model has none; use lora='merged'.")
    limit, target = parse_size(max_shard_size), export_dtype(source, dtype, lora)
    adapter_only = source.lora_config is not None and lora == "adapter"
    tensors = hf_tensors(source, lora, target)
    if not adapter_only:
        tensors = checkpoint_layout(source.base, tensors)  # what save_pretrained writes (per-expert MoE tensors)
    if not writer:
        write_shards(tensors, None, limit, "", target)
        return Path(output_dir)
    with atomic_directory(output_dir) as staging:
        if adapter_only:
            write_shards(tensors, staging, limit, "adapter_model", target)
            _write_adapter_config(source, staging)
        else:
            write_shards(tensors, staging, limit, "model", target)
            _write_configs(source.base, staging, target or torch.float32)
        if source.tokenizer is not None:
            source.tokenizer.save_pretrained(staging)
    return Path(output_dir)


def _write_adapter_config(source: ExportSource, folder: Path) -> None:
    """PEFT's adapter_config.json, the same whichever path exported it: ``target_modules`` sorted (peft keeps them
    as a set, which it writes in the order of the process's string hashing), ``base_model_name_or_path`` the
    folder or hub name the run started from (``None`` for a preset, which no name loads) and ``inference_mode`` on,
    as ``PeftModel.save_pretrained`` writes it."""
    config = copy.copy(source.lora_config)
    if isinstance(config.target_modules, set | list | tuple):
        config.target_modules = sorted(config.target_modules)
    if isinstance(getattr(config, "target_parameters", None), set | list | tuple):
        config.target_parameters = sorted(config.target_parameters)
    config.base_model_name_or_path = source.base.config.name_or_path or None
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    config.save_pretrained(folder)


def _write_configs(base: PreTrainedModel, folder: Path, dtype: torch.dtype) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    config = copy.deepcopy(base.config)
    config.dtype = dtype
    if not config.architectures and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
    config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)


# ------------------------------------------------------------------------------------------------ live runs
def lora_scaling(model: nn.Module) -> float | None:
    """The LoRA scale (``alpha / r``) to merge a peft model's adapters with; ``None`` for a model without adapters.

    Read from the LoRA layers themselves (peft keeps ``scaling`` as ``{adapter: scale}`` on each), so it is right
    for any LightningModule, whoever built the adapters.
    """
    scales = {
        scale
        for module in model.modules()
        if isinstance(getattr(module, "scaling", None), dict)
        for scale in module.scaling.values()
    }
    if len(scales) > 1:
        raise GymUserError(
            f"The export merges LoRA adapters with one scale, but the layers use {sorted(scales)} (per-layer "
            "rank_pattern/alpha_pattern or several adapters); use one r and alpha for every adapted layer."
        )
    return scales.pop() if scales else None


def live_source(strategy: object, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> ExportSource:
    """The ``ExportSource`` of a model being trained (a transformers model or a peft ``PeftModel``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    peft_configs = getattr(model, "peft_config", None) or {}
    lora_config = next(iter(peft_configs.values()), None) if len(peft_configs) == 1 else None
    if len(peft_configs) > 1:
        raise GymUserError(f"The export writes one LoRA adapter; the model has {sorted(peft_configs)}.")
    tensors = full_tensors_of(strategy, model)
    return ExportSource(tensors, base, lora_config, lora_scaling(model), tokenizer, parameter_adapters(model))


def export_from_trainer(
    trainer: pl.Trainer,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    output_dir: str | Path,
    *,
    lora: LoRAExport = "merged",
    dtype: ExportDType = "source",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Export ``model`` (a transformers model or a peft model) as trained under ``trainer``'s strategy: every rank
    takes part (gathers are collectives), global rank 0 writes."""
    source = live_source(trainer.strategy, model, tokenizer)
    writer = trainer.is_global_zero
    write_export(source, output_dir, writer=writer, lora=lora, dtype=dtype, max_shard_size=max_shard_size)
    trainer.strategy.barrier("gym_lightning_export")


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "EXPORT_DTYPES",
    "LORA_EXPORTS",
    "ExportDType",
    "ExportSource",
    "LoRAExport",
    "ParameterAdapter",
    "export_from_trainer",
    "export_problems",
    "hf_tensors",
    "live_source",
    "lora_scaling",
    "parameter_adapters",
    "parse_size",
    "source_dtype",
    "write_export",
]
