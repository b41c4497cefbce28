"""A DataLoader that tells each micro-batch how many target tokens its optimizer step holds.

Lightning gives ``training_step`` one micro-batch at a time, so the module cannot know the token count of the
whole gradient-accumulation window by itself. This loader reads the window ahead (as the Hugging Face Trainer's
``get_batch_samples`` does) and attaches the local count to every batch of the window as ``step_target_tokens``.
The module sums that count over data-parallel ranks. Windows restart at every epoch and hold
``accumulate_grad_batches`` batches, exactly the grouping Lightning's loop uses to decide when to step.

It is a plain ``DataLoader`` subclass so that Lightning can still re-create it with a distributed sampler.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader

from gym_lightning.loss import count_target_tokens

STEP_TOKENS_KEY = "step_target_tokens"


class StepTokenDataLoader(DataLoader):
    """``DataLoader`` whose batches (dicts with ``labels``) carry ``step_target_tokens``.

    Args:
        *args: As for ``torch.utils.data.DataLoader``.
        accumulate_grad_batches: Micro-batches per optimizer step (the Trainer's ``accumulate_grad_batches``).
        **kwargs: As for ``torch.utils.data.DataLoader``.
    """

    def __init__(self, *args: Any, accumulate_grad_batches: int = 1, **kwargs: Any) -> None:
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise ValueError(
                f"accumulate_grad_batches must be a positive integer, got {accumulate_grad_batches!r}; "
                "set trainer.accumulate_grad_batches to 1 or more."
            )
        super().__init__(*args, **kwargs)
        self.accumulate_grad_batches = accumulate_grad_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        batches = super().__iter__()
        while window := list(islice(batches, self.accumulate_grad_batches)):
            total = torch.stack([count_target_tokens(batch["labels"]) for batch in window]).sum()
            for batch in window:
                batch[STEP_TOKENS_KEY] = total
                yield batch
