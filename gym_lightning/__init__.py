"""gym_lightning: a PyTorch Lightning plugin for finetuning Hugging Face causal language models.

Importing the package registers its strategy names with Lightning (``Trainer(strategy="zero3")``) and quiets
console noise at its source (``gym_lightning.quiet``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from gym_lightning.quiet import quiet_console

quiet_console()  # before deepspeed is first imported (by the imports below): see gym_lightning/quiet.py

from gym_lightning.callbacks import (  # noqa: E402
    CurvesCallback,
    GymProgressBar,
    HFExport,
    MemoryCallback,
    NonFiniteGuard,
    NonFiniteLossError,
    ThroughputCallback,
)
from gym_lightning.checkpointing import StepCheckpoint  # noqa: E402
from gym_lightning.data.datamodule import CausalLMDataModule  # noqa: E402
from gym_lightning.data.loader import StepTokenDataLoader  # noqa: E402
from gym_lightning.generation import GenerationArgs  # noqa: E402
from gym_lightning.lora import LoRAArgs  # noqa: E402
from gym_lightning.module import CausalLMModule  # noqa: E402
from gym_lightning.strategies import (  # noqa: E402
    GymDDPStrategy,
    GymFSDPStrategy,
    ZeRO1Strategy,
    ZeRO2Strategy,
    ZeRO3Strategy,
    ZeROStrategy,
)
from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer  # noqa: E402

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
