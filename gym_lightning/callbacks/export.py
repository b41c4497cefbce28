"""``HFExport``: write the trained model as a Hugging Face folder at the end of ``fit``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from gym_lightning.errors import GymUserError
from gym_lightning.export import export_from_trainer


def find_hf_model(pl_module: pl.LightningModule) -> nn.Module:
    """The Hugging Face model a LightningModule trains: ``pl_module.model`` if it has ``save_pretrained``, else the
    outermost submodule that has (a peft ``PeftModel`` before the model it wraps)."""
    model = getattr(pl_module, "model", None)
    if isinstance(model, nn.Module) and hasattr(model, "save_pretrained"):
        return model
    for module in pl_module.modules():
        if module is not pl_module and hasattr(module, "save_pretrained"):
            return module
    raise GymUserError(
        f"HFExport found no Hugging Face model in {type(pl_module).__name__}: keep the model (a transformers "
        "PreTrainedModel or a peft PeftModel) as `self.model`, or as any submodule with `save_pretrained`."
    )


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
            f"HFExport merges LoRA adapters with one scale, but the layers use {sorted(scales)} (per-layer "
            "rank_pattern/alpha_pattern or several adapters); use one r and alpha for every adapted layer."
        )
    return scales.pop() if scales else None


class HFExport(Callback):
    """At the end of ``fit``, write the trained model as a Hugging Face folder (``config.json``,
    ``model.safetensors``, ``generation_config.json`` and the tokenizer's files) that
    ``AutoModelForCausalLM.from_pretrained`` loads. Works under every strategy (the strategy gathers sharded
    weights, see ``gym_lightning.export``); global rank 0 writes, atomically.

    What it needs from the LightningModule: the Hugging Face model as ``self.model`` (a transformers
    ``PreTrainedModel``, or a peft ``PeftModel`` whose LoRA adapters are merged into the exported weights), or
    failing that as the outermost submodule with ``save_pretrained``; and the tokenizer as ``self.tokenizer`` if it
    has one (without it the folder holds no tokenizer files). ``CausalLMModule`` fits this contract. The model is
    found at the start of ``fit``, so a module that does not fit fails before training, not after it.

    Args:
        output_dir: The folder to write (replaced if it exists); ``None`` exports nothing.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        if output_dir is not None and (not isinstance(output_dir, str) or not output_dir):
            raise GymUserError(f"HFExport: output_dir must be a folder path or None, got {output_dir!r}.")
        self.output_dir = output_dir

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_dir is not None:
            lora_scaling(find_hf_model(pl_module))  # raises now rather than after training

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_dir is None:
            return
        model = find_hf_model(pl_module)
        tokenizer: Any = getattr(pl_module, "tokenizer", None)
        export_from_trainer(trainer, model, tokenizer, self.output_dir, lora_scaling=lora_scaling(model))


__all__ = ["HFExport", "find_hf_model", "lora_scaling"]
