"""``HFExport``: write the trained model as a Hugging Face folder at the end of ``fit``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from gym_lightning.errors import GymUserError, raise_if_problems
from gym_lightning.hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    ExportDType,
    LoRAExport,
    export_from_trainer,
    export_problems,
    lora_scaling,
)


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


class HFExport(Callback):
    """At the end of ``fit``, write the trained model as a Hugging Face folder (``config.json``, sharded
    safetensors with an index, ``generation_config.json``, the tokenizer and its chat template) that
    ``AutoModelForCausalLM.from_pretrained`` loads, or a PEFT adapter folder. Works under every strategy: sharded
    parameters are gathered one tensor at a time and global rank 0 writes shard by shard, atomically (see
    ``gym_lightning.hf_folder``, which ``gym export`` of a checkpoint shares).

    What it needs from the LightningModule: the Hugging Face model as ``self.model`` (a transformers
    ``PreTrainedModel``, or a peft ``PeftModel`` whose LoRA adapters are merged into the exported weights), or
    failing that as the outermost submodule with ``save_pretrained``; and the tokenizer as ``self.tokenizer`` if it
    has one (without it the folder holds no tokenizer files). ``CausalLMModule`` fits this contract. The model is
    found at the start of ``fit``, so a module that does not fit fails before training, not after it.

    Args:
        output_dir: The folder to write (replaced if it exists); ``None`` exports nothing.
        lora: For a LoRA model, ``"merged"`` (the base weights with the adapters merged in, a plain transformers
            folder) or ``"adapter"`` (PEFT's ``adapter_model.safetensors`` + ``adapter_config.json``).
        dtype: ``"source"`` writes the dtype recorded in the config.json of the folder the run started from
            (float32 for presets), else ``"float32"``, ``"bfloat16"`` or ``"float16"``. Adapters keep their own
            dtype under ``"source"``.
        max_shard_size: Largest safetensors file, e.g. ``"5GB"``, ``"500MB"``.
    """

    def __init__(
        self,
        output_dir: str | None = None,
        lora: LoRAExport = "merged",
        dtype: ExportDType = "source",
        max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    ) -> None:
        problems = export_problems(lora, dtype, max_shard_size)
        if output_dir is not None and (not isinstance(output_dir, str) or not output_dir):
            problems.insert(0, f"output_dir must be a folder path or None, got {output_dir!r}.")
        raise_if_problems("HFExport", problems)
        self.output_dir, self.lora, self.dtype, self.max_shard_size = output_dir, lora, dtype, max_shard_size

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_dir is None:
            return
        model = find_hf_model(pl_module)  # these raise now rather than after training
        lora_scaling(model)
        if self.lora == "adapter" and not hasattr(model, "peft_config"):
            raise GymUserError("HFExport(lora='adapter') exports LoRA adapters, but the model has none; use 'merged'.")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_dir is None:
            return
        model = find_hf_model(pl_module)
        tokenizer: Any = getattr(pl_module, "tokenizer", None)
        export_from_trainer(
            trainer,
            model,
            tokenizer,
            self.output_dir,
            lora=self.lora,
            dtype=self.dtype,
            max_shard_size=self.max_shard_size,
        )


__all__ = ["HFExport", "find_hf_model", "lora_scaling"]
