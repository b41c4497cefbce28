"""The tiny Llama shape and Lightning project the callback tests share (Ψ is hand-counted in metrics/test_flops.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import transformers

from gym_lightning.loss import count_target_tokens, summed_cross_entropy

TINY = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class TinyLM(pl.LightningModule):
    """A plain Lightning project around a TINY Llama: mean token cross-entropy, AdamW.

    ``lazy=True`` builds the model in ``configure_model``, inside a strategy's sharding context (ZeRO-3 partitions it
    as it is made); otherwise it is built at once, so a test can read ``TinyLM().model`` before any Trainer.
    """

    def __init__(self, lazy: bool = False) -> None:
        super().__init__()
        self.model: transformers.PreTrainedModel | None = None
        if not lazy:
            self.model = self._build()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()

    @staticmethod
    def _build() -> transformers.PreTrainedModel:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return summed_cross_entropy(logits, batch["labels"]) / count_target_tokens(batch["labels"]).clamp(min=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
