"""Count the host syncs a ``Trainer.fit`` would make on CUDA, on a CPU run (tests/test_host_syncs.py).

On CUDA a call that reads a device tensor's value on the host (``item``, ``tolist``, ``bool``, ``float``, ``int``,
``numpy``, formatting), copies it to the host (``cpu()``, ``to("cpu")``), or sizes a result by its data
(``nonzero``, masked indexing, ``unique``) blocks the host until the GPU has run everything queued before it; the
next kernels are then launched late and the GPU idles. On a CPU run nothing blocks, but the calls are the same, so
counting them is a device-free invariant. ``HostSyncCounter`` counts them with a ``TorchFunctionMode`` (which sees
Tensor methods and dunders) and the explicit CUDA waits (``torch.cuda.synchronize``, ``Event``/``Stream``
``synchronize``) by patching, each with the first file:line outside torch that made it.

What it cannot see on CPU: a ``.to(device)`` whose device is ``torch.device("cpu")`` reads as host-to-host here, so
only ``.cpu()`` and ``.to("cpu"...)`` (a string) count as device-to-host copies; host-to-device copies are not
counted (the audit in the report reads them). Host-side data work (collate, the loader's window read-ahead, the
batch transfer) runs on host tensors and is left out by the frames it runs in.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods/functions that read values on the host or size a result by the data (each a sync on CUDA).
READS = frozenset(
    {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "numpy", "__repr__", "__str__"}
)
DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "nonzero_static"})
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
HOST_DATA_FRAMES = (  # host-side data pipeline: host tensors, no device involved
    os.path.join("torch", "utils", "data") + os.sep,
    os.path.join("gym_lightning", "data") + os.sep,
    os.path.join("lightning", "pytorch", "loops", "fetchers.py"),
)
HOST_DATA_FUNCTIONS = ("move_data_to_device",)  # the batch transfer (Lightning's apply_func): host -> device


@dataclass
class SyncEvent:
    """One host sync: the op, the first frame outside torch (``file:line``), and the optimizer step it fell in."""

    op: str
    site: str
    step: int
    chain: tuple[str, ...] = ()


@dataclass
class HostSyncCounter:
    """Records ``SyncEvent``s while ``counting`` is on; ``step`` is set by the caller (the global step)."""

    events: list[SyncEvent] = field(default_factory=list)
    counting: bool = False
    step: int = 0

    def record(self, op: str) -> None:
        """Record ``op`` unless it runs inside the host data pipeline."""
        if not self.counting:
            return
        frames = traceback.extract_stack()[:-2]
        if any(f.name in HOST_DATA_FUNCTIONS or any(part in f.filename for part in HOST_DATA_FRAMES) for f in frames):
            return
        outside = [f for f in frames if not f.filename.startswith(TORCH_DIR) and f.filename != __file__]
        chain = tuple(f"{_short(f.filename)}:{f.lineno}" for f in outside[-9:])
        self.events.append(SyncEvent(op, chain[-1] if chain else "?", self.step, chain))

    def per_step(self) -> Counter[int]:
        """Optimizer step -> syncs made while it ran."""
        return Counter(event.step for event in self.events)

    def sites(self, steps: set[int] | None = None) -> Counter[str]:
        """``op @ file:line`` -> count, over ``steps`` (all when ``None``)."""
        return Counter(f"{e.op} @ {e.site}" for e in self.events if steps is None or e.step in steps)


def _short(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "work" + os.sep + "main" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _is_sync(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The op's name if calling ``func(*args, **kwargs)`` makes a host sync on CUDA, else ``None``."""
    name = getattr(func, "__name__", "")
    if name in READS or name in DATA_DEPENDENT:
        return name
    if name == "repeat_interleave" and "output_size" not in kwargs and not isinstance(args[1:2], int):
        return name if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
    if name == "cpu":
        return name
    if name == "to":
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, str) and target.startswith("cpu") and not kwargs.get("non_blocking", False):
            return "to(cpu)"
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return "masked __getitem__"
    return None


class _Mode(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (op := _is_sync(func, args, kwargs)) is not None:
            self.counter.record(op)
        return func(*args, **kwargs)


def _patched(counter: HostSyncCounter, owner: Any, name: str, label: str) -> Callable[[], None]:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter.record(label)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


@contextmanager
def counting_host_syncs(counter: HostSyncCounter) -> Iterator[HostSyncCounter]:
    """Install the mode and the CUDA-wait patches for the duration (``counter.counting`` still decides)."""
    restores = [
        _patched(counter, torch.cuda, "synchronize", "torch.cuda.synchronize"),
        _patched(counter, torch.cuda.Event, "synchronize", "Event.synchronize"),
        _patched(counter, torch.cuda.Stream, "synchronize", "Stream.synchronize"),
    ]
    try:
        with _Mode(counter):
            yield counter
    finally:
        for restore in restores:
            restore()


def count_training_batches(counter: HostSyncCounter) -> Callable[[], None]:
    """Turn ``counter`` on for every training batch of any fit (Lightning's ``_TrainingEpochLoop.advance``, which
    runs the batch hooks, forward, backward, optimizer step and logging), off between them; returns the undo."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    original = _TrainingEpochLoop.advance

    def advance(loop: Any, *args: Any, **kwargs: Any) -> Any:
        counter.step, counter.counting = loop.trainer.global_step, True
        try:
            return original(loop, *args, **kwargs)
        finally:
            counter.counting = False

    _TrainingEpochLoop.advance = advance
    return lambda: setattr(_TrainingEpochLoop, "advance", original)


def print_report(counter: HostSyncCounter, file: Any = sys.stdout) -> None:
    """Per-step totals and the sites, for a person reading the output."""
    print("syncs per optimizer step:", dict(sorted(counter.per_step().items())), file=file)
    chains = Counter(f"{e.op} @ " + " <- ".join(reversed(e.chain)) for e in counter.events)
    for chain, n in chains.most_common():
        print(f"  {n:4d}  {chain}", file=file)
