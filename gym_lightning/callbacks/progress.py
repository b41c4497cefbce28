"""``GymProgressBar``: Lightning's tqdm progress bar without the logger's version number."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class GymProgressBar(TQDMProgressBar):
    """A ``TQDMProgressBar`` that does not show ``v_num``.

    ``v_num`` is the logger's version folder (``version_0`` shows as ``v_num: 0.000``): the same on every step, it
    takes room from the loss and ``tok/s`` and reads like a metric. tqdm rather than Rich: Lightning's Rich bar can
    fail inside Jupyter (see the notebooks), and one bar everywhere keeps the console the same in both.
    """

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
