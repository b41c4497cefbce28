"""gym_lightning: a PyTorch Lightning plugin for finetuning Hugging Face causal language models."""

from __future__ import annotations

__version__ = "0.1.0"
