"""What a LightningModule / LightningDataModule tells a strategy, through a small typed interface.

A DeepSpeed JSON full of ``"auto"`` needs numbers that only the module and the data know (the learning rate, the
micro-batch size, ...). The strategy asks for them through these protocols instead of reading a particular module's
hyper-parameters by name, so it works with any module, and the module is free to name its settings as it likes:

- ``ProvidesOptimizerFacts`` (on the LightningModule): ``optimizer_facts() -> OptimizerFacts``.
- ``ProvidesMicroBatchSize`` (on the LightningDataModule, or on a module that builds its own DataLoader):
  ``micro_batch_size``, the per-device training micro-batch.

Both are optional. Without them every optimizer fact is unknown (``None``): an ``"auto"`` that needs one is an error
naming the key, and an explicit JSON value is not checked. The micro-batch then comes from the training DataLoader's
``batch_size`` (unknown for a DataLoader that yields ready batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class OptimizerFacts:
    """The module's optimizer settings, as DeepSpeed's ``"auto"`` needs them; ``None`` means "not known".

    Args:
        lr: Peak learning rate.
        betas: Adam betas.
        eps: Adam epsilon.
        weight_decay: Weight decay.
        warmup_steps: Warm-up length in optimizer steps (> 0 wins over ``warmup_ratio``, as in the HF Trainer).
        warmup_ratio: Warm-up length as a fraction of the run's total optimizer steps.
        hidden_size: The model's hidden size (DeepSpeed's bucket sizes scale with it).
        layer_numel: Elements of the model's largest decoder layer (ZeRO-3's gathered-parameter limits scale with
            it: ``hf_deepspeed_config.stage3_limits``).
    """

    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    hidden_size: int | None = None
    layer_numel: int | None = None


@runtime_checkable
class ProvidesOptimizerFacts(Protocol):
    """A LightningModule that states its optimizer settings (see ``OptimizerFacts``)."""

    def optimizer_facts(self) -> OptimizerFacts: ...


@runtime_checkable
class ProvidesMicroBatchSize(Protocol):
    """A data module (or module) that states its per-device training micro-batch size."""

    @property
    def micro_batch_size(self) -> int: ...


def optimizer_facts_of(module: object) -> OptimizerFacts:
    """``module.optimizer_facts()`` when the module provides them, else all unknown."""
    return module.optimizer_facts() if isinstance(module, ProvidesOptimizerFacts) else OptimizerFacts()


def micro_batch_size_of(*providers: object) -> int | None:
    """The first ``micro_batch_size`` stated by one of ``providers`` (``None`` entries are skipped), else ``None``."""
    for provider in providers:
        if provider is None or not isinstance(provider, ProvidesMicroBatchSize):
            continue
        size = provider.micro_batch_size
        # A runtime-checkable protocol only checks that the attribute exists; None (or a bool) states nothing.
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


__all__ = [
    "OptimizerFacts",
    "ProvidesMicroBatchSize",
    "ProvidesOptimizerFacts",
    "micro_batch_size_of",
    "optimizer_facts_of",
]
