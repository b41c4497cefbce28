"""``strategies.placement``: what no sharding engine manages goes to the compute device after set-up.

On a CPU rank the storage and compute devices are the same, so the meta device stands in for the compute device
here: every metric state, reset default and plain buffer must move there, parameters must not, and dtypes must be
the ones the metric had before the precision's ``convert_module``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from gym_lightning._compat import metric_state_defaults
from gym_lightning.strategies.placement import metric_dtypes, place_unmanaged_state, unmanaged_state_devices

META = torch.device("meta")


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)  # like the rotary embedding's
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.val_loss = MeanMetric()
        self.accuracy = MulticlassAccuracy(num_classes=3)  # integer states (tp, fp, ...)
        self.collected = SumMetric()


def test_metric_states_defaults_and_buffers_move_and_keep_their_dtypes() -> None:
    module = _Module()
    module.val_loss.update(torch.tensor([1.0, 2.0]))
    dtypes = metric_dtypes(module)
    module.to(torch.bfloat16)  # what bf16-true's convert_module does: metric float states become bf16 too
    assert module.val_loss.mean_value.dtype == torch.bfloat16

    place_unmanaged_state(module, META, dtypes)

    placed = unmanaged_state_devices(module)
    assert placed and all(device == "meta" for device, _ in placed.values()), placed
    assert module.val_loss.mean_value.dtype == torch.float32 and module.val_loss.dtype == torch.float32
    assert all(metric_state_defaults(module.val_loss)[key].is_meta for key in ("mean_value", "weight"))
    assert module.val_loss.device == META  # what torchmetrics reports (it checks inputs against it)
    assert module.accuracy.tp.dtype == torch.long  # integer states stay integer
    assert module.inv_freq.dtype == torch.bfloat16 and module.steps.dtype == torch.long  # buffers keep theirs
    assert "inv_freq" in module._non_persistent_buffers_set  # still a non-persistent buffer
    assert not module.linear.weight.is_meta  # parameters belong to the strategy


def test_nothing_moves_when_everything_is_already_there() -> None:
    module = _Module()
    before = module.inv_freq
    place_unmanaged_state(module, torch.device("cpu"), metric_dtypes(module))
    assert module.inv_freq is before
