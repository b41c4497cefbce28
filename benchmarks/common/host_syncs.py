"""Count, on a CPU run, the host syncs a training step would make on CUDA (tests/test_host_syncs.py,
benchmarks/host_syncs.py); on CUDA, count the syncs torch itself flags (``counting_cuda_syncs``, tests/gpu).

On CUDA the host stops until the device has run everything queued before when it reads a device value (``item``,
``bool``, ``tolist``...), sizes a result by the data (``nonzero``, masked indexing, ``unique``...), copies host
data to the device without ``non_blocking`` (``torch.tensor(x, device=cuda)``, ``t.new_tensor(n)``: torch
synchronises the stream after a blocking copy) or waits explicitly (``torch.cuda.synchronize``, events, streams).

Why a ``TorchDispatchMode`` and not fake ``cuda`` tensors: a census of ``gym fit`` needs real numbers (losses,
Lightning's loops, DeepSpeed and gloo collectives), which ``FakeTensorMode`` cannot give, and this CPU build of
torch cannot move a fake tensor to ``cuda`` anyway (``new_tensor``, ``nonzero`` raise "not linked with support
for cuda devices"). A dispatch mode sees every aten op below autograd, from Python and from C++ (DDP's reducer,
the autograd engine, FSDP2), so it counts what the device would see:

- ``read``: ``aten._local_scalar_dense`` (every ``item``/``bool``/``int``/``float``), ``aten.equal``, and, by a
  ``TorchFunctionMode`` beside it, the reads that dispatch nothing on a CPU tensor (``tolist``, ``numpy``,
  ``cpu()``, ``to("cpu")``, formatting);
- ``data-dependent``: ``nonzero``, indexing or ``index_put`` with a boolean mask, ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size``, ``bincount``;
- ``host->device``: host data (Python numbers, lists, numpy) made a tensor for the device (``aten.lift_fresh``
  under ``torch.tensor(x, device=d)`` or ``t.new_tensor(n)``: a ``torch.device``, not the string ``"cpu"``, is the
  compute device, as ``self.device`` is on CUDA), and a host tensor entering a device op (it was copied first; a
  0-d one is a CPU scalar CUDA kernels take as an argument). Host tensors (host data without a device, and what is
  computed from host tensors only) are marked for the whole run; reading one back is no sync. Lightning's batch
  transfer turns the host batch into device tensors (``non_blocking`` from pinned memory on CUDA: not counted);
- ``wait``: ``torch.cuda.synchronize``, ``Event``/``Stream.synchronize`` and DeepSpeed's accelerator
  ``synchronize`` (a no-op on its CPU accelerator, ``torch.cuda.synchronize`` on CUDA), patched. DeepSpeed's
  ``.to(get_accelerator().device_name())`` (``"cpu"`` on CPU ranks) is a move to the device, not a copy to the host.

Recorded apart, not a sync (``host read``): DDP's reducer reading its host-side ``local_used_map_`` per parameter
under the static graph (reducer.cpp), recognised by its shape since it is made in C++.

What a CPU run still cannot show: ``.to(device)`` is a no-op here, so a factory tensor made on the host
(``torch.zeros(n)``) and read back counts as a device read, and a host buffer made with ``device=torch.device("cpu")``
as a device tensor (over-counts); only ``"cpu"`` spelled as a string counts as a copy to the host; streams, events
and pinned-memory copies do not exist (DeepSpeed's CPU accelerator has no ``Stream``/``Event``, so its CUDA-only
waits never run); what a sync costs. docs/testing-cuda-semantics.md says what each CUDA-claiming test can show.

Every event carries the op, the owner (the package of the innermost frame that is not torch's plumbing: the
autograd engine, ``torch.optim``, ``torch.distributed``, ``torch.nn.parallel`` and ``torch.amp`` are ``torch``'s
own) and its chain of ``file:line``. Host-side data work (collate, the loader's read-ahead, the batch transfer)
is left out by the frames it runs in.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
READ, DATA_DEPENDENT, HOST_TO_DEVICE, WAIT = "read", "data-dependent", "host->device", "wait"
KINDS = (READ, DATA_DEPENDENT, HOST_TO_DEVICE, WAIT)  # the syncs
HOST_READ = "host read"  # recorded, not a sync: a read of host memory on CUDA too (DDP's reducer's map)
OWNERS = ("gym_lightning", "lightning", "transformers", "peft", "deepspeed", "torch", "other")

# aten ops (overload packets) and the kind of sync each is on CUDA.
DISPATCH_SYNCS: dict[Any, str] = {
    aten._local_scalar_dense: READ,
    aten.equal: READ,
    aten.nonzero: DATA_DEPENDENT,
    aten.masked_select: DATA_DEPENDENT,
    aten._unique: DATA_DEPENDENT,
    aten._unique2: DATA_DEPENDENT,
    aten.unique_dim: DATA_DEPENDENT,
    aten.unique_consecutive: DATA_DEPENDENT,
    aten.bincount: DATA_DEPENDENT,
    aten.lift_fresh: HOST_TO_DEVICE,
    aten.lift_fresh_copy: HOST_TO_DEVICE,
}
SAME_DEVICE_OPS = frozenset({aten.cat, aten.stack, aten.index_put, aten.index_put_})  # no CPU-scalar operand
CREATIONS = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})  # host data -> tensor, with a target device
MASK_INDEXED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
# Tensor methods that read values on the host without dispatching an aten op on a CPU tensor.
FUNCTION_READS = frozenset({"tolist", "numpy", "__array__", "__repr__", "__str__", "__format__", "cpu"})
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
TORCH_OWN = tuple(  # torch frames that act on their own behalf (the owner), not as plumbing for their caller
    os.path.join(TORCH_DIR, part)
    for part in ("autograd" + os.sep, "optim" + os.sep, "distributed" + os.sep, "nn/parallel/", "amp" + os.sep)
)
HOST_DATA_FRAMES = (  # host-side data pipeline: host tensors, no device involved
    os.path.join("torch", "utils", "data") + os.sep,
    os.path.join("gym_lightning", "data") + os.sep,
    os.path.join("lightning", "pytorch", "loops", "fetchers.py"),
)
HOST_DATA_FUNCTIONS = frozenset({"move_data_to_device"})  # the batch transfer (Lightning's apply_func)
PLUMBING = tuple(  # the frames a mode is called through
    os.path.join("torch", *part)
    for part in (("_compile.py",), ("overrides.py",), ("_dynamo", "eval_frame.py"), ("utils", "_python_dispatch.py"))
)
PACKAGES = {"lightning_utilities": "lightning", "torchmetrics": "lightning"}
HOST_MARK = "_host_census_host"  # attribute set on tensors that live on the host on CUDA too


@dataclass
class SyncEvent:
    """One host sync: the op, its kind, its owner, the chain of ``file:line`` (outermost first), the step."""

    op: str
    kind: str
    owner: str
    step: int
    chain: tuple[str, ...] = ()
    detail: str = ""


@dataclass
class HostSyncCounter:
    """Records ``SyncEvent``s while ``counting`` is on; ``step`` is set by the caller (the global step)."""

    events: list[SyncEvent] = field(default_factory=list)
    counting: bool = False
    step: int = 0
    _inside_read: int = 0
    creating: list[str] = field(default_factory=list)  # targets of the tensor creations in progress
    seconds: list[float] = field(default_factory=list)  # wall time of each training batch

    def record(self, op: str, kind: str, detail: str = "") -> None:
        """Record ``op`` unless it runs inside the host data pipeline or inside a read already recorded."""
        if not self.counting or self._inside_read:
            return
        frames = _python_frames()
        if any(f.f_code.co_name in HOST_DATA_FUNCTIONS or _in_host_data(f.f_code.co_filename) for f in frames):
            return
        owner = owner_of([f.f_code.co_filename for f in frames])
        chain = tuple(f"{_short(f.f_code.co_filename)}:{f.f_lineno}" for f in reversed(frames[:10]))
        self.events.append(SyncEvent(op, kind, owner, self.step, chain, detail))

    def per_step(self) -> Counter[int]:
        """Optimizer step -> syncs made while it ran."""
        return Counter(event.step for event in self.events)


def _python_frames() -> list[Any]:
    """The Python frames of the current call, innermost first, without this module's own, the modes' plumbing and
    the warnings machinery (``counting_cuda_syncs`` records from inside it)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        own = frame.f_code.co_filename in (__file__, warnings.__file__)
        if not own and not frame.f_code.co_filename.endswith(PLUMBING):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _in_host_data(filename: str) -> bool:
    return any(part in filename for part in HOST_DATA_FRAMES)


def package_of(filename: str) -> str:
    """The top-level package a source file belongs to (``other`` for the standard library and scripts)."""
    parts = filename.replace(os.sep, "/").split("/")
    for name in reversed(parts[:-1]):
        if name in OWNERS or name in PACKAGES:
            return PACKAGES.get(name, name)
        if name in ("site-packages", "dist-packages"):
            break
    return "other"


def owner_of(filenames: list[str]) -> str:
    """Who made a call, from its frames' files (innermost first): the innermost frame outside torch, unless a torch
    frame that acts on its own behalf (``TORCH_OWN``: the autograd engine running backward, an optimizer, DDP,
    FSDP, the grad scaler) comes first."""
    for filename in filenames:
        if filename.startswith(TORCH_DIR):
            if filename.startswith(TORCH_OWN):
                return "torch"
            continue
        owner = package_of(filename)
        if owner != "other" or not filename.startswith(sys.prefix):  # a script's frame: the harness
            return owner
    return "torch"


def _short(path: str) -> str:
    for marker in (
        "site-packages" + os.sep,
        *(os.sep + name + os.sep for name in ("gym_lightning", "tests", "benchmarks")),
    ):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail if "site-packages" in marker else marker.strip(os.sep) + os.sep + tail
    return path


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def is_host(tensor: Any) -> bool:
    """Whether ``tensor`` was made from host data (or from such tensors only): a host tensor on CUDA too."""
    return isinstance(tensor, torch.Tensor) and getattr(tensor, HOST_MARK, False)


def _mark_host(value: Any) -> None:
    for tensor in _tensors(value):
        setattr(tensor, HOST_MARK, True)


def _mark_device(value: Any) -> Any:
    for tensor in _tensors(value):
        setattr(tensor, HOST_MARK, False)
    return value


def _in_batch_transfer() -> bool:
    """Whether the call runs inside Lightning's batch transfer (``move_data_to_device``): the copy of the host batch
    to the device, ``non_blocking`` from pinned memory on CUDA (Lightning's ``batch_to``)."""
    return any(f.f_code.co_name in HOST_DATA_FUNCTIONS for f in _python_frames())


def _mask_indexed(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def aten_sync_kind(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The kind of host sync aten op ``packet`` (an overload packet) makes on CUDA by itself, or ``None``: the one
    table of both censuses (this module's per step, ``sync_census``'s per call). Where its operands live and what
    it copies is the caller's to judge."""
    if packet in MASK_INDEXED and _mask_indexed(args):
        return DATA_DEPENDENT
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) == 1:
        return DATA_DEPENDENT  # repeat_interleave.Tensor(repeats) sizes its output by the repeats' sum
    return DISPATCH_SYNCS.get(packet)


class _DispatchCensus(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._census(func._overloadpacket, args, kwargs, out)  # between steps too: host tensors made there
        return out

    def _census(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Record ``packet``'s sync, if it makes one, and mark its outputs as host memory where they are."""
        counter = self.counter
        if packet in (aten.lift_fresh, aten.lift_fresh_copy):  # host data becoming a tensor
            if counter.creating and counter.creating[-1] == "device":
                counter.record(str(packet), HOST_TO_DEVICE, _describe(out))
            else:
                _mark_host(out)
            return
        inputs = _tensors((args, kwargs))
        host = [t for t in inputs if is_host(t)]
        if packet is aten.copy_:
            self._copy(args, kwargs)
            return
        kind = aten_sync_kind(packet, args, kwargs)
        if host and len(host) == len(inputs):
            _mark_host(out)  # host computation: no device involved on CUDA either
            return
        if kind == READ and _reducer_host_read(inputs):
            kind = HOST_READ
        if kind is not None:
            counter.record(str(packet), kind, _describe(inputs[0] if inputs else out))
        moved = [t for t in host if t.dim() > 0 or packet in SAME_DEVICE_OPS]  # 0-d: a CPU scalar CUDA ops accept
        if moved:  # a host tensor in a device op: it was copied to the device first
            counter.record(f"{packet} <- host tensor", HOST_TO_DEVICE, _describe(moved[0]))
            for tensor in moved:
                setattr(tensor, HOST_MARK, False)

    def _copy(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``dst.copy_(src)`` between the host and the device, blocking unless ``non_blocking``."""
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if is_host(src) and not is_host(dst) and (src.dim() > 0 or blocking):
            self.counter.record("aten.copy_ host->device", HOST_TO_DEVICE, _describe(src))
        elif is_host(dst) and not is_host(src) and blocking:
            self.counter.record("aten.copy_ device->host", READ, _describe(src))


def _reducer_host_read(inputs: list[torch.Tensor]) -> bool:
    """Whether a read is DDP's reducer reading its ``local_used_map_``: an ``int32`` CPU tensor with one entry per
    parameter, allocated on the host on CUDA too (reducer.cpp ``initialize_local_used_map``), read entry by entry in
    ``finalize_bucket_dense`` under ``static_graph`` or ``find_unused_parameters``. It is host memory, so the read
    does not wait for the device; only a parameter no rank used makes the reducer wait for the map's all-reduce and
    copy it back (counted as the read of a device tensor would be: the census cannot see that branch on CPU)."""
    base = inputs[0]._base if len(inputs) == 1 else None
    return (
        base is not None
        and inputs[0].dtype == base.dtype == torch.int32
        and inputs[0].dim() == 0
        and base.dim() == 1
        and _python_frames()[0].f_code.co_filename.endswith(os.path.join("autograd", "graph.py"))
    )


def _describe(tensor: Any) -> str:
    """``dtype[shape]`` of a tensor, and ``of dtype[shape]`` of the tensor it is a view of."""
    if not isinstance(tensor, torch.Tensor):
        return ""
    text = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
    return text if tensor._base is None else f"{text} of {_describe(tensor._base)}"


class _FunctionCensus(TorchFunctionMode):
    """The reads that dispatch nothing on a CPU tensor (``tolist``, ``numpy``, ``cpu()``, ``to("cpu")``, printing;
    ops they dispatch inside are not counted again), and where a tensor made from host data is meant to live."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in CREATIONS:
            self.counter.creating.append(_creation_target(name, args, kwargs))
            try:
                return func(*args, **kwargs)
            finally:
                self.counter.creating.pop()
        if name == "to" and is_host(args[0]) and _in_batch_transfer():
            return _mark_device(func(*args, **kwargs))  # the batch's copy to the device (a no-op on CPU)
        read = name in FUNCTION_READS or (name == "to" and _to_host(args, kwargs))
        if not read or not self.counter.counting or is_host(args[0] if args else None):
            return func(*args, **kwargs)
        self.counter.record(f"Tensor.{name}", READ, _describe(args[0]))
        self.counter._inside_read += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._inside_read -= 1


def _creation_target(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``"host"`` or ``"device"``: where ``torch.tensor``/``as_tensor``/``asarray``/``Tensor.new_tensor`` puts host
    data. No device (the default device, the host) or one spelled ``"cpu"``: the host; a ``torch.device`` object or
    another name: the compute device, on CUDA what code passing ``self.device`` gets; ``new_tensor`` without a
    device: where its tensor lives."""
    device = kwargs.get("device")
    if device is None:
        return "device" if name == "new_tensor" and not is_host(args[0]) else "host"
    return "host" if isinstance(device, str) and device.startswith("cpu") else "device"


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``Tensor.to("cpu", ...)`` without ``non_blocking``: spelled as a string, the one host target a CPU run can tell
    from ``.to(device)`` (whose device is ``cpu`` here)."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    host = isinstance(target, str) and not isinstance(target, ComputeDeviceName) and target.startswith("cpu")
    return host and not kwargs.get("non_blocking", False)


def _patched(counter: HostSyncCounter, owner: Any, name: str, label: str) -> Callable[[], None]:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter.record(label, WAIT)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


class ComputeDeviceName(str):
    """DeepSpeed's name of the compute device (``get_accelerator().device_name()``): ``"cuda"`` on CUDA, ``"cpu"`` on
    its CPU accelerator. Equal to ``"cpu"`` in every way, so DeepSpeed runs unchanged, but ``.to(name)`` with it is
    the move to the compute device it is on CUDA, not a copy to the host."""


def _named_compute_device(accelerator: Any, name: str) -> Callable[[], None]:
    original = getattr(accelerator, name)
    setattr(accelerator, name, lambda *args, **kwargs: ComputeDeviceName(original(*args, **kwargs)))
    return lambda: setattr(accelerator, name, original)


def _device_patches(counter: HostSyncCounter) -> list[Callable[[], None]]:
    """The explicit waits, counted, and DeepSpeed's compute-device name, marked."""
    restores = [
        _patched(counter, torch.cuda, "synchronize", "torch.cuda.synchronize"),
        _patched(counter, torch.cuda.Event, "synchronize", "Event.synchronize"),
        _patched(counter, torch.cuda.Stream, "synchronize", "Stream.synchronize"),
    ]
    try:  # DeepSpeed's accelerator: torch.cuda.synchronize on CUDA, a no-op on CPU
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    except ImportError:
        return restores
    restores.append(_patched(counter, CPU_Accelerator, "synchronize", "accelerator.synchronize"))
    restores += [_named_compute_device(CPU_Accelerator, n) for n in ("device_name", "current_device_name")]
    return restores


@contextmanager
def counting_host_syncs(counter: HostSyncCounter) -> Iterator[HostSyncCounter]:
    """Install both modes and the wait patches for the duration (``counter.counting`` still decides)."""
    restores = _device_patches(counter)
    try:
        with _FunctionCensus(counter), _DispatchCensus(counter):
            yield counter
    finally:
        for restore in restores:
            restore()


CUDA_SYNC = "cuda sync"  # the kind of what counting_cuda_syncs records: a sync torch itself flagged
# torch's message for every sync under set_sync_debug_mode("warn") (c10/cuda/CUDAFunctions.h, warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextmanager
def counting_cuda_syncs(counter: HostSyncCounter) -> Iterator[HostSyncCounter]:
    """On CUDA: every synchronisation torch flags under ``torch.cuda.set_sync_debug_mode("warn")`` (device reads,
    data-dependent shapes, blocking copies, ``synchronize``) recorded in ``counter`` with its owner and chain, kind
    ``CUDA_SYNC``, instead of printed (``counter.counting`` decides, as for the census). What the device really
    waits for, as torch sees it; a sync made inside backward's device threads is replayed by the autograd engine on
    the thread that called backward, so its chain ends at that call (owner ``torch``)."""
    previous = torch.cuda.get_sync_debug_mode()

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if SYNC_WARNING in str(message):
            counter.record("cuda sync", CUDA_SYNC)
        else:
            original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # each one, whatever PYTHONWARNINGS says
        original, warnings.showwarning = warnings.showwarning, show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def count_training_batches(counter: HostSyncCounter) -> Callable[[], None]:
    """Turn ``counter`` on for every training batch of any fit (Lightning's ``_TrainingEpochLoop.advance``, which
    runs the batch hooks, forward, backward, optimizer step and logging), off between them; returns the undo."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    original = _TrainingEpochLoop.advance

    def advance(loop: Any, *args: Any, **kwargs: Any) -> Any:
        counter.step, counter.counting = loop.trainer.global_step, True
        start = time.perf_counter()
        try:
            return original(loop, *args, **kwargs)
        finally:
            counter.counting = False
            counter.seconds.append(time.perf_counter() - start)

    _TrainingEpochLoop.advance = advance
    return lambda: setattr(_TrainingEpochLoop, "advance", original)


def quiet_steps(steps: int, log_every: int, checkpoint_every: int | None, busy: set[int]) -> set[int]:
    """Step indices (global step before the step) that neither log (the loggers, the progress bar, ``busy``: the
    callbacks' own reads) nor checkpoint, nor are the first one."""
    checkpoint_every = checkpoint_every or steps + 1
    return {i for i in range(1, steps) if (i + 1) % log_every and (i + 1) % checkpoint_every and i not in busy}


def print_report(counter: HostSyncCounter, file: Any = sys.stdout) -> None:
    """Per-step totals and the sites, for a person reading the output."""
    print("syncs per optimizer step:", dict(sorted(counter.per_step().items())), file=file)
    chains = Counter(f"{e.op} [{e.owner}] @ " + " <- ".join(reversed(e.chain)) for e in counter.events)
    for chain, n in chains.most_common():
        print(f"  {n:4d}  {chain}", file=file)
