"""gym_lightning: a PyTorch Lightning plugin for finetuning Hugging Face causal language models."""

from __future__ import annotations

__version__ = "0.1.0"

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.loader import StepTokenDataLoader
from gym_lightning.generation import GenerationArgs
from gym_lightning.lora import LoRAArgs
from gym_lightning.module import CausalLMModule
from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer

__all__ = [
    "SHIPPED_TOKENIZER_DIR",
    "CausalLMDataModule",
    "CausalLMModule",
    "GenerationArgs",
    "LoRAArgs",
    "StepTokenDataLoader",
    "__version__",
    "load_tokenizer",
]
