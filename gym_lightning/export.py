"""Export a trained model as a Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``) that ``AutoModelForCausalLM.from_pretrained`` loads.

The full state dict comes from the strategy when it shards the model (``strategy.full_model_state_dict``, a
collective that returns the gathered weights on global rank 0), so the same export serves DDP, FSDP and ZeRO.
LoRA adapters are merged into the base weights on that state dict (``W + scale * B @ A``), leaving the training
model untouched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gym_lightning.atomic import atomic_directory

if TYPE_CHECKING:
    import lightning.pytorch as pl

_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.[^.]+\.weight$")


def merge_lora_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Turn a PEFT LoRA model's state dict into the plain base model's, with ``W + scaling * B @ A`` merged in."""
    plain = {key.removeprefix(_PEFT_PREFIX): value for key, value in state_dict.items()}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    for key, value in plain.items():
        match = _LORA_KEY.match(key)
        if match:
            factors.setdefault(match["module"], {})[match["which"]] = value
        else:
            merged[key.replace(".base_layer.", ".")] = value
    for module, pair in factors.items():
        weight_key = f"{module}.weight"
        if weight_key not in merged or set(pair) != {"A", "B"}:
            raise ValueError(f"Cannot merge LoRA weights of {module!r}: expected lora_A, lora_B and a base weight.")
        delta = (pair["B"].float() @ pair["A"].float()) * scaling
        merged[weight_key] = (merged[weight_key].float() + delta).to(merged[weight_key].dtype)
    return merged


def write_hf_folder(
    model: PreTrainedModel,
    state_dict: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase | None,
    output_dir: str | Path,
) -> Path:
    """Write ``state_dict`` with ``model``'s config and generation config, and ``tokenizer`` (if any), to
    ``output_dir``.

    The folder appears complete or not at all (see ``gym_lightning.atomic``).
    """
    with atomic_directory(output_dir) as staging:
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return Path(output_dir)


def full_state_dict(trainer: pl.Trainer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full CPU state dict on global rank 0 (``{}`` elsewhere); a collective under sharding strategies."""
    gather = getattr(trainer.strategy, "full_model_state_dict", None)
    if gather is not None:
        return gather(model)
    if not trainer.is_global_zero:
        return {}
    return {key: value.detach().cpu() for key, value in model.state_dict().items()}


def export_from_trainer(
    trainer: pl.Trainer,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    output_dir: str | Path,
    lora_scaling: float | None = None,
) -> None:
    """Gather ``model`` (an HF model or a PEFT LoRA model) and write it as an HF folder from global rank 0."""
    state_dict = full_state_dict(trainer, model)
    if trainer.is_global_zero:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if lora_scaling is not None:
            state_dict = merge_lora_state_dict(state_dict, lora_scaling)
        write_hf_folder(base, state_dict, tokenizer, output_dir)
    trainer.strategy.barrier("gym_lightning_export")
