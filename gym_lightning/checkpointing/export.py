"""``python -m gym_lightning export``: any gym_lightning checkpoint to a Hugging Face folder, one shard at a time.

Reads, without a process group and without building the model:

- a single file (DDP, single device, FSDP with ``save_distributed_checkpoint=False``): ``torch.load(mmap=True)``;
- an FSDP folder (torch distributed checkpoint, ``.metadata`` + ``*.distcp``): each tensor is read on its own;
- a DeepSpeed folder (``latest`` + ``<tag>/*_model_states.pt``): ZeRO-1/2 from the full module state in the model-
  states file, ZeRO-3 by re-assembling each parameter from the ranks' fp32 partitions (the layout of DeepSpeed's
  ``zero_to_fp32.py``), reading the files memory-mapped.

Tensors are materialised shard by shard (``--max_shard_size``) and written as safetensors with an index, so the
host memory held at once is about one shard (plus one LoRA-merged layer), not the model. Everything is loaded with
``weights_only=True``. The config comes from the checkpoint's hyper-parameters (model source + overrides), the
tokenizer from the model's (or the shipped one). The output folder appears complete or not at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from gym_lightning.atomic import atomic_directory
from gym_lightning.checkpointing.safe_load import (
    deepspeed_safe_globals,
    load_lightning_checkpoint,
    load_weights_only,
    refuse_unsafe_pickles,
)
from gym_lightning.errors import GymUserError

LoRAExport = Literal["merged", "adapter"]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.[^.]+\.weight$")


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2e9 bytes, ``"500MiB"``, ``"1000"`` (bytes)."""
    match = _SIZE.match(str(text))
    unit = match[2].upper() if match else ""
    if not match or (unit not in _UNITS and unit + "B" not in _UNITS):
        raise GymUserError(f"--max_shard_size {text!r} is not a size; use e.g. 2GB, 500MB, 800MiB or a byte count.")
    return max(1, int(float(match[1]) * _UNITS.get(unit, _UNITS.get(unit + "B", 1))))


@dataclass
class LazyTensor:
    """A tensor of the checkpoint that is read only when ``load()`` is called."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class CheckpointContents:
    """Model tensors (keys as in the LightningModule's ``state_dict``) and the Lightning metadata."""

    tensors: dict[str, LazyTensor]
    metadata: dict[str, Any]


# ------------------------------------------------------------------------------------------------ readers
def _from_tensors(state: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    return {k: LazyTensor(tuple(v.shape), v.dtype, lambda v=v: v.clone()) for k, v in state.items()}


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


def read_deepspeed_checkpoint(path: Path) -> CheckpointContents:
    tag = (path / "latest").read_text().strip()
    folder = path / tag
    model_files = sorted(folder.glob("*_model_states.pt"))
    states = _deepspeed_load(next(f for f in model_files if "rank_0_" in f.name or f.name.startswith("mp_rank")))
    module = states.pop("module")
    if not any(tensor.numel() == 0 for tensor in module.values()):  # ZeRO-1/2: the module holds the full weights
        return CheckpointContents(_from_tensors(module), states)
    optim_files = sorted(folder.glob("zero_pp_rank_*_optim_states.pt"), key=lambda f: int(f.name.split("_")[3]))
    flat = [_deepspeed_load(f)["optimizer_state_dict"]["fp32_flat_groups"] for f in optim_files]
    tensors: dict[str, LazyTensor] = {}
    for group, shapes in enumerate(states["param_shapes"]):
        offset = 0
        for name, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            part = -(-numel // len(flat))  # ceil: each rank holds one padded partition of every parameter

            def load(group: int = group, offset: int = offset, part: int = part, numel: int = numel, shape=shape):
                return torch.cat([ranks[group][offset : offset + part] for ranks in flat])[:numel].view(shape)

            tensors[name] = LazyTensor(tuple(shape), torch.float32, load)
            offset += part
    for alias, source in states.get("shared_params", {}).items():
        tensors.setdefault(alias, tensors[source])
    return CheckpointContents(tensors, states)


def read_checkpoint(path: str | Path) -> CheckpointContents:
    """Lazy contents of a checkpoint file or folder of any gym_lightning strategy."""
    path = Path(path)
    if path.is_dir() and (path / "last.ckpt").exists():
        path = (path / "last.ckpt").resolve()
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


# ------------------------------------------------------------------------------------------------ Hugging Face view
def hf_tensors(
    tensors: dict[str, LazyTensor], lora_scaling: float | None, lora: LoRAExport, tied: bool
) -> dict[str, LazyTensor]:
    """The module's tensors under Hugging Face names: LoRA merged lazily (``W + s * B @ A``) or adapters only."""
    plain = {key.removeprefix("model."): value for key, value in tensors.items() if key.startswith("model.")}
    factors: dict[str, dict[str, LazyTensor]] = {}
    for key, value in plain.items():
        if match := _LORA_KEY.match(key):
            factors.setdefault(match["module"], {})[match["which"]] = value
    if factors and lora == "adapter":
        # PEFT's adapter files name the factors without the adapter name ("...lora_A.weight").
        adapter = {k: v for k, v in plain.items() if _LORA_KEY.match(k)}
        return {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in adapter.items()}
    out: dict[str, LazyTensor] = {}
    for key, value in plain.items():
        if _LORA_KEY.match(key):
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        pair = factors.get(key.removesuffix(".base_layer.weight"))
        if pair is not None and key.endswith(".base_layer.weight") and lora_scaling is not None:
            out[name] = LazyTensor(value.shape, value.dtype, _merged_loader(value, pair, lora_scaling))
        else:
            out[name] = value
    if tied:
        out.pop("lm_head.weight", None)  # tied to the input embeddings: Hugging Face stores it once
    return out


def _merged_loader(weight: LazyTensor, pair: dict[str, LazyTensor], scaling: float) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        base = weight.load()
        delta = (pair["B"].load().float() @ pair["A"].load().float()) * scaling
        return (base.float() + delta).to(base.dtype)

    return load


def plan_shards(tensors: dict[str, LazyTensor], max_shard_size: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += tensor.nbytes
    return [shard for shard in shards if shard]


def write_safetensors_shards(tensors: dict[str, LazyTensor], folder: Path, max_shard_size: int, stem: str) -> None:
    """Write ``<stem>.safetensors`` or ``<stem>-0000i-of-0000n.safetensors`` + index, one shard in memory at a time."""
    shards = plan_shards(tensors, max_shard_size)
    weight_map: dict[str, str] = {}
    for index, keys in enumerate(shards, start=1):
        name = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({key: tensors[key].load().contiguous() for key in keys}, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    if len(shards) > 1:
        total = sum(tensor.nbytes for tensor in tensors.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


# ------------------------------------------------------------------------------------------------ export
def _model_config(hparams: dict[str, Any]) -> Any:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from gym_lightning.models.loading import load_model_config

    config = load_model_config(hparams["model"], hparams.get("config_overrides"), trust_remote_code=False)
    if not config.architectures and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
    return config


def _lora_config(hparams: dict[str, Any]) -> Any:
    from peft import LoraConfig

    lora = hparams["lora"]
    target = lora.target_modules
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if target == ["all-linear"] else target,
        task_type="CAUSAL_LM",
        base_model_name_or_path=hparams["model"],
    )


def export_checkpoint(
    checkpoint: str | Path, output_dir: str | Path, max_shard_size: str | int = "2GB", lora: LoRAExport = "merged"
) -> Path:
    """Write the model of ``checkpoint`` (any strategy) as a Hugging Face folder; see the module docstring."""
    from transformers import GenerationConfig

    from gym_lightning.module import resolve_tokenizer_source
    from gym_lightning.tokenizer import load_tokenizer

    if lora not in ("merged", "adapter"):
        raise GymUserError(f"--lora must be 'merged' or 'adapter', got {lora!r}.")
    limit = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    contents = read_checkpoint(checkpoint)
    hparams = dict(contents.metadata.get("hyper_parameters") or {})
    if "model" not in hparams:
        raise GymUserError(
            f"{str(checkpoint)!r} has no CausalLMModule hyper-parameters (model source): cannot tell its config."
        )
    config = _model_config(hparams)
    scaling = hparams["lora"].scaling if hparams.get("lora") is not None else None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = hf_tensors(contents.tensors, scaling, lora, tied)
    tokenizer = load_tokenizer(resolve_tokenizer_source(hparams["model"], hparams.get("tokenizer")), False)
    with atomic_directory(output_dir) as staging:
        if scaling is not None and lora == "adapter":
            write_safetensors_shards(tensors, staging, limit, "adapter_model")
            _lora_config(hparams).save_pretrained(staging)
        else:
            write_safetensors_shards(tensors, staging, limit, "model")
            config.save_pretrained(staging)
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return Path(output_dir)
