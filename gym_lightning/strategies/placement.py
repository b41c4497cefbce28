"""Where the module state that no sharding engine manages lives after a strategy's set-up: on the compute device.

A strategy decides where the *parameters* live: DDP on the device, FSDP2 in shards (on the host under
``cpu_offload``), ZeRO-3 in partitions (on the host or NVMe under offload). Everything else the LightningModule holds
(torchmetrics states and the defaults ``reset()`` restores, buffers, non-persistent buffers such as the rotary
``inv_freq``) is used where the computation runs, and no engine moves it there:

- ZeRO-3: DeepSpeed never moves a ``zero.Init`` model (the engine skips ``module.to``) and Lightning never calls
  ``model_to_device`` for it, so metrics and buffers made in ``__init__`` stayed on the CPU; on a GPU the first
  ``val_loss.update`` failed with torchmetrics' "Encountered different devices in metric calculation";
- FSDP2 with ``cpu_offload``: ``to_empty(device=<shard storage>)`` put the whole LightningModule's buffers and metric
  states in host memory with the shards;
- ``bf16-true``: the precision's ``convert_module`` (``module.to(torch.bfloat16)``) casts torchmetrics' float states
  too (``Metric._apply`` only guards ``.half()``/``.float()``/...), so running means accumulated in bf16.

:func:`placed_after` wraps a strategy's set-up: :func:`metric_dtypes` is read before it, :func:`place_unmanaged_state`
applied after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torchmetrics import Metric

from gym_lightning._compat import DTensor, apply_to_metric, metric_state_defaults


def metric_dtypes(module: nn.Module) -> dict[int, torch.dtype]:
    """The floating-point dtype of every torchmetrics metric in ``module`` (by ``id``), as the set-up found them."""
    return {id(m): m.dtype for m in module.modules() if isinstance(m, Metric)}


def place_unmanaged_state(module: nn.Module, device: torch.device, dtypes: dict[int, torch.dtype]) -> None:
    """Put every torchmetrics state and default and every plain buffer of ``module`` on ``device``.

    Metric float states get back the dtype ``dtypes`` recorded for their metric (torchmetrics keeps all float states
    of a metric in one dtype); integer states keep theirs. Buffers keep their dtype. ``DTensor`` buffers belong to
    a sharding engine and parameters are never touched.
    """
    for sub in module.modules():
        if isinstance(sub, Metric):
            _place_metric(sub, device, dtypes.get(id(sub), sub.dtype))
            continue
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer is not None and not isinstance(buffer, DTensor) and buffer.device != device:
                setattr(sub, name, buffer.to(device))  # a registered name: stays a (non-)persistent buffer


@contextmanager
def placed_after(module: nn.Module | None, device: torch.device) -> Iterator[None]:
    """Around a strategy's set-up of ``module`` (the LightningModule; ``None``: nothing to do): afterwards, what no
    engine manages is on ``device`` and every metric in the dtype it had before (:func:`place_unmanaged_state`)."""
    dtypes = metric_dtypes(module) if module is not None else {}
    yield
    if module is not None:
        place_unmanaged_state(module, device, dtypes)


def _place_metric(metric: Metric, device: torch.device, dtype: torch.dtype) -> None:
    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)

    # torchmetrics' own traversal: states, reset defaults, cached results, and the device/dtype the metric reports.
    apply_to_metric(metric, place)


def unmanaged_state_devices(module: nn.Module) -> dict[str, tuple[str, str]]:
    """``{name: (device, dtype)}`` of every metric state and plain buffer of ``module`` (for tests and reports)."""
    found: dict[str, tuple[str, str]] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, Metric):
            for key in metric_state_defaults(sub):
                value = getattr(sub, key)
                for i, tensor in enumerate(value if isinstance(value, list) else [value]):
                    found[f"{prefix}.{key}[{i}]"] = (str(tensor.device), str(tensor.dtype))
            continue
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and not isinstance(buffer, DTensor):
                found[f"{prefix}.{name}"] = (str(buffer.device), str(buffer.dtype))
    return found


__all__ = ["metric_dtypes", "place_unmanaged_state", "placed_after", "unmanaged_state_devices"]
