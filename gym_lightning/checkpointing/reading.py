"""``gym export``'s side of the one exporter (``gym_lightning.hf_folder``): any gym_lightning checkpoint as an
``ExportSource``, read lazily, without a process group and without building the model's weights.

- a single file (DDP, single device, FSDP with ``save_distributed_checkpoint=False``): ``torch.load(mmap=True)``;
- an FSDP folder (torch distributed checkpoint, ``.metadata`` + ``*.distcp``): each tensor is read on its own;
- a DeepSpeed folder (``latest`` + ``<tag>/*_model_states.pt``): ZeRO-1/2 from the full module state in the model-
  states file; ZeRO-3 by re-assembling each trainable parameter from the ranks' fp32 partitions and each frozen one
  (LoRA's base weights) from the ranks' ``frozen_param_fragments`` (the layouts of DeepSpeed's ``zero_to_fp32.py``),
  reading the files memory-mapped.

Everything is loaded with ``weights_only=True``. The base model (config, generation config, tied weights) is built
on the meta device from the checkpoint's hyper-parameters (model source + overrides), with the run's LoRA applied
there too (its adapter config, and which parameter each of peft's ``ParamWrapper``s adapts: a mixture of experts'
fused weights); the tokenizer is the model's (or the shipped one). Writing, LoRA merging, dtype and sharding are
``gym_lightning.hf_folder.write_export``'s.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gym_lightning.checkpointing.manifest import verify_checkpoint
from gym_lightning.checkpointing.safe_load import (
    deepspeed_safe_globals,
    load_lightning_checkpoint,
    load_weights_only,
    refuse_unsafe_pickles,
)
from gym_lightning.errors import GymUserError
from gym_lightning.hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    ExportDType,
    ExportSource,
    LoRAExport,
    parameter_adapters,
    write_export,
)
from gym_lightning.lazy import LazyTensor

_MODULE_PREFIX = "model."  # CausalLMModule keeps the Hugging Face (or PEFT) model as ``self.model``


@dataclass
class CheckpointContents:
    """Model tensors (keys as in the LightningModule's ``state_dict``) and the Lightning metadata."""

    tensors: dict[str, LazyTensor]
    metadata: dict[str, Any]


# ------------------------------------------------------------------------------------------------ readers
def _from_tensors(state: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    return {k: LazyTensor(tuple(v.shape), v.dtype, lambda v=v: v) for k, v in state.items()}


def read_single_file(path: Path) -> CheckpointContents:
    checkpoint = load_lightning_checkpoint(path)
    return CheckpointContents(_from_tensors(checkpoint.pop("state_dict")), checkpoint)


def read_distributed_checkpoint(path: Path) -> CheckpointContents:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "state_dict."

    def reader(key: str, meta: TensorStorageMetadata) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            out = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
            dcp.load(out, checkpoint_id=path, no_dist=True)
            return out[key]

        return load

    entries = FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        key.removeprefix(prefix): LazyTensor(tuple(meta.size), meta.properties.dtype, reader(key, meta))
        for key, meta in entries.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    return CheckpointContents(tensors, load_weights_only(path / "meta.pt"))


def _deepspeed_load(path: Path) -> Any:
    with torch.serialization.safe_globals(deepspeed_safe_globals()), refuse_unsafe_pickles(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# [bf16_]zero_pp_rank_<r>_mp_rank_00_{model,optim}_states.pt: DeepSpeed's bf16 optimizer prefixes its files.
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


def _rank_of(file: Path) -> int:
    match = _RANK_FILE.search(file.name)
    if match is None:
        raise GymUserError(f"{file} is not a DeepSpeed rank file (zero_pp_rank_<rank>_...).")
    return int(match[1])


def read_deepspeed_checkpoint(path: Path) -> CheckpointContents:
    tag = (path / "latest").read_text().strip()
    folder = path / tag
    model_files = sorted(folder.glob("*_model_states.pt"))
    rank_files = sorted((f for f in model_files if f.name.startswith("zero_pp_rank_")), key=_rank_of)
    states = _deepspeed_load(rank_files[0] if rank_files else model_files[0])
    module = states.pop("module")
    if not any(tensor.numel() == 0 for tensor in module.values()):  # ZeRO-1/2: the module holds the full weights
        return CheckpointContents(_from_tensors(module), states)
    optim_files = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
    if not optim_files:
        raise GymUserError(
            f"The ZeRO-3 checkpoint {folder} has no optimizer partition files (*zero_pp_rank_*_optim_states.pt), "
            "which hold its trained weights: copy the whole checkpoint folder, or export another checkpoint."
        )
    flat = [_deepspeed_load(f)["optimizer_state_dict"]["fp32_flat_groups"] for f in optim_files]
    # Buffers are whole in the module state; partitioned parameters are empty there and rebuilt below.
    tensors = _from_tensors({k: v for k, v in module.items() if v.numel() > 0})
    tensors.update(_zero3_trainable(states["param_shapes"], flat))
    frozen = [_deepspeed_load(f).get("frozen_param_fragments") or {} for f in rank_files]
    tensors.update(_zero3_frozen(states.get("frozen_param_shapes") or {}, frozen))
    for alias, source in states.get("shared_params", {}).items():
        tensors.setdefault(alias, tensors[source])
    return CheckpointContents(tensors, states)


def _zero3_trainable(param_shapes: list[dict[str, Any]], flat: list[list[torch.Tensor]]) -> dict[str, LazyTensor]:
    """Trainable parameters from the ranks' flat fp32 groups: each rank holds one padded partition of each."""
    tensors: dict[str, LazyTensor] = {}
    for group, shapes in enumerate(param_shapes):
        offset = 0
        for name, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            part = -(-numel // len(flat))  # ceil

            def load(group: int = group, offset: int = offset, part: int = part, numel: int = numel, shape=shape):
                return torch.cat([ranks[group][offset : offset + part] for ranks in flat])[:numel].view(shape)

            tensors[name] = LazyTensor(tuple(shape), torch.float32, load)
            offset += part
    return tensors


def _zero3_frozen(shapes: dict[str, Any], fragments: list[dict[str, torch.Tensor]]) -> dict[str, LazyTensor]:
    """Frozen parameters (``requires_grad=False``, e.g. LoRA's base weights) from each rank's fragment of them."""
    tensors: dict[str, LazyTensor] = {}
    for name, shape in shapes.items():
        missing = [rank for rank, parts in enumerate(fragments) if name not in parts]
        if missing:
            raise GymUserError(f"The ZeRO-3 checkpoint lacks the frozen parameter {name!r} on ranks {missing}.")
        numel = int(torch.Size(shape).numel())

        def load(name: str = name, numel: int = numel, shape: Any = shape) -> torch.Tensor:
            return torch.cat([parts[name].flatten() for parts in fragments])[:numel].view(shape)

        tensors[name] = LazyTensor(tuple(shape), fragments[0][name].dtype, load)
    return tensors


def read_checkpoint(path: str | Path) -> CheckpointContents:
    """Lazy contents of a checkpoint file or folder of any gym_lightning strategy."""
    path = Path(path)
    if path.is_dir() and (path / "last.ckpt").exists():
        path = (path / "last.ckpt").resolve()
    verify_checkpoint(path)  # every file, against the manifest the run wrote
    if path.is_file():
        return read_single_file(path)
    if (path / ".metadata").is_file():
        return read_distributed_checkpoint(path)
    if (path / "latest").is_file():
        return read_deepspeed_checkpoint(path)
    raise GymUserError(
        f"{str(path)!r} is not a gym_lightning checkpoint: expected a .ckpt file (DDP), a folder with .metadata "
        "(FSDP, torch distributed checkpoint), a folder with a 'latest' file (DeepSpeed) or a folder with last.ckpt."
    )


# ------------------------------------------------------------------------------------------------ export
def _meta_base_model(hparams: dict[str, Any]) -> Any:
    """The base model on the meta device (no memory): its config, generation config and tied weights."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from gym_lightning.models.loading import load_model_config
    from gym_lightning.models.presets import is_preset

    config = load_model_config(hparams["model"], hparams.get("config_overrides"), trust_remote_code=False)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    if not is_preset(hparams["model"]):  # a preset has no folder (and asking the hub for one would go online)
        with contextlib.suppress(OSError, ValueError):  # the source folder's own settings, as in a live run
            base.generation_config = GenerationConfig.from_pretrained(hparams["model"])
    return base


def checkpoint_source(checkpoint: str | Path) -> ExportSource:
    """The ``ExportSource`` of a ``CausalLMModule`` checkpoint of any strategy."""
    from gym_lightning.lora import LoRAArgs
    from gym_lightning.models.presets import resolve_tokenizer_source
    from gym_lightning.tokenizer import load_tokenizer

    contents = read_checkpoint(checkpoint)
    hparams = dict(contents.metadata.get("hyper_parameters") or {})
    if "model" not in hparams:
        raise GymUserError(
            f"{str(checkpoint)!r} has no CausalLMModule hyper-parameters (model source): cannot tell its config."
        )
    tensors = {
        key.removeprefix(_MODULE_PREFIX): value
        for key, value in contents.tensors.items()
        if key.startswith(_MODULE_PREFIX)
    }
    lora = LoRAArgs.from_value(hparams.get("lora"))
    source = resolve_tokenizer_source(hparams["model"], hparams.get("tokenizer"))
    tokenizer = load_tokenizer(source, False, hparams.get("special_tokens"))
    base = _meta_base_model(hparams)
    if lora is None:
        return ExportSource(tensors, base, None, None, tokenizer)
    peft_model = _meta_peft_model(base, lora)
    lora_config = peft_model.peft_config["default"]
    wrappers = parameter_adapters(peft_model)
    return ExportSource(tensors, peft_model.get_base_model(), lora_config, lora.scaling, tokenizer, wrappers)


def _meta_peft_model(base: Any, lora: Any) -> Any:
    """``base`` (on the meta device) with the run's LoRA applied as the run applied it: the same ``LoraConfig``
    (``all-experts`` resolved against this model's experts, ``lora.lora_config_for``) and peft's own targeting with
    its transformers 4 -> 5 rewrite off (``lora.apply_lora``'s way), so its ``ParamWrapper``s nest as the run's did
    and tell which parameter each adapter pair adapts. Not ``apply_lora`` itself: that draws every adapter on the
    CPU (about 1.2e9 numbers for Qwen3-235B-A22B's experts at r=8), while the meta ones are all that is needed."""
    from peft import get_peft_model

    from gym_lightning._compat import peft_v4_target_conversion_off
    from gym_lightning.lora import lora_config_for
    from gym_lightning.models.experts import expert_targets

    config = lora_config_for(base, lora, expert_targets(base))
    with peft_v4_target_conversion_off():
        return get_peft_model(base, config)


def export_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    lora: LoRAExport = "merged",
    dtype: ExportDType = "source",
) -> Path:
    """Write the model of ``checkpoint`` (any strategy) as a Hugging Face folder (or a PEFT adapter folder)."""
    from gym_lightning.errors import raise_if_problems
    from gym_lightning.hf_folder import export_problems

    raise_if_problems("gym export", export_problems(lora, dtype, max_shard_size))
    return write_export(
        checkpoint_source(checkpoint), output_dir, lora=lora, dtype=dtype, max_shard_size=max_shard_size
    )
