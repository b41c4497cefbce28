"""gym_lightning: a PyTorch Lightning plugin for finetuning Hugging Face causal language models.

Importing the package registers its strategy names with Lightning (``Trainer(strategy="zero3")``) and allow-lists
its hyper-parameter classes for ``weights_only`` checkpoint loading (``gym_lightning.registration``); it changes
nothing else in the process. The command line also quiets console noise (``gym_lightning.quiet``), and
``CausalLMModule`` applies the patches the installed libraries need (``gym_lightning.patches``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from gym_lightning.callbacks import (
    CurvesCallback,
    GymProgressBar,
    HFExport,
    MemoryCallback,
    NonFiniteGuard,
    NonFiniteLossError,
    ThroughputCallback,
)
from gym_lightning.checkpointing import StepCheckpoint
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.loader import StepTokenDataLoader
from gym_lightning.generation import GenerationArgs
from gym_lightning.lora import LoRAArgs
from gym_lightning.module import CausalLMModule
from gym_lightning.quant import QuantizationArgs
from gym_lightning.registration import register
from gym_lightning.strategies import (
    GymDDPStrategy,
    GymFSDPStrategy,
    ZeRO1Strategy,
    ZeRO2Strategy,
    ZeRO3Strategy,
    ZeROStrategy,
)
from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer

register()

__all__ = [
    "SHIPPED_TOKENIZER_DIR",
    "CausalLMDataModule",
    "CausalLMModule",
    "CurvesCallback",
    "GenerationArgs",
    "GymDDPStrategy",
    "GymFSDPStrategy",
    "GymProgressBar",
    "HFExport",
    "LoRAArgs",
    "MemoryCallback",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "QuantizationArgs",
    "StepCheckpoint",
    "StepTokenDataLoader",
    "ThroughputCallback",
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "ZeROStrategy",
    "__version__",
    "load_tokenizer",
]
