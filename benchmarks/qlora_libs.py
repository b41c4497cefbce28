"""QLoRA: which 4-bit library. torchao's ``NF4Tensor``, bitsandbytes' ``Params4bit`` and gym_lightning's own
``quant.nf4`` / ``NF4Linear``, side by side in one run on this CPU. gym_lightning's rows come twice: with
``nf4.dequantize`` on bitsandbytes' ``dequantize_4bit`` kernel (its default where bitsandbytes is installed) and on
its plain-torch path (``nf4.dequantize_reference``, what runs without bitsandbytes; forced here by making
``nf4._bitsandbytes`` answer ``None``). The two give the same weight bit for bit; only time and memory differ.

    python benchmarks/qlora_libs.py [--shapes 4096x4096 14336x4096 1024x1024] [--tokens 2048] [--repeats 3]
    python benchmarks/qlora_libs.py --skip-dist --shapes 1024x1024   # the 1-process part only, quickly

Needs bitsandbytes (the ``qlora`` extra) and torchao (no dependency of gym_lightning: ``pip install torchao`` for the
run). Prints one markdown table per part; docs/benchmarks.md's section "QLoRA: which 4-bit library" is kept by hand
from its output.

For each library and each ``out x in`` shape, one bf16 weight drawn from N(0, 0.02) (Llama's initialiser range; no
trained weight is used, so outliers are rarer than in a real model), NF4 with blocks of 64:

- quantise: median seconds of quantising the weight (``to_nf4``, ``bnb.functional.quantize_4bit``,
  ``nf4.quantize``, the same plain-torch function on both gym_lightning paths), 2 threads;
- bits per weight: every tensor the quantised weight consists of (codes, scales, second-level state, code books),
  bytes x 8 / numel, i.e. what a checkpoint of it holds;
- error: mean and max |dequantised - original| over the weight, in fp32;
- forward + backward: ``y = x @ W^T`` for ``x [tokens, in]`` bf16 with ``requires_grad`` and a frozen 4-bit ``W``,
  ``y.backward(g)``: median seconds over ``--repeats`` after one warm-up (2 threads), and the peak of bytes held by
  PyTorch's CPU allocator above the step's start (``torch.profiler`` with ``profile_memory``: allocations minus
  frees in time order, so temporaries that come and go count at their peak). It includes the step's own output
  ``y`` and ``x.grad``, which the bf16 reference row (no quantisation) shows alone; memory a library allocates
  outside PyTorch's allocator (native buffers, oneDNN scratch) is not seen.
- strategies: each library's 4-bit weight, in a block ``base(x) + lora_b(lora_a(x))`` (bf16 LoRA of rank 8,
  trainable), on 2 CPU processes (gloo, 1 thread each), each try its own job with a timeout: (i) FSDP2
  ``fully_shard`` of the block, (ii) DeepSpeed ZeRO-3, the block built under ``deepspeed.zero.Init`` then
  ``deepspeed.initialize`` (bf16, torch AdamW on the LoRA weights). One forward + backward; ``y``, ``x.grad`` and the
  LoRA gradients (gathered) are compared with the same block on one process without a wrapper (gym_lightning on
  both dequantisation paths). "works": every one
  within 1 % of the largest reference value (bf16 rounding); "wrong result": a difference above that; otherwise the
  first line of the error, or the timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BLOCK = 64  # QLoRA's first-level block: every library's default
MIB = 2**20
# The distributed tries: a small block whose rows split evenly into whole second-level blocks on 2 ranks (torchao
# shards an NF4Tensor only along whole 64 x 256 scaler blocks), so a failure is the library's, not the shape's.
DIST_OUT, DIST_IN, DIST_RANK, DIST_TOKENS = 512, 256, 8, 16
DIST_TIMEOUT_S = 240
STRATEGIES = ("fsdp2", "zero3")


# Loggers that chatter while torchao is imported: its own ("Failed to load .../_C_mxfp8...so", CUDA-only
# extensions) and torch's pytree ("<enum 'KernelPreference'> is an Enum subclass ...", on torchao's registrations).
# Importing gym_lightning already imports torchao where it is installed (through transformers).
_IMPORT_CHATTER = ("torchao", "torch.utils._pytree")


def _quiet_imports(torchao: bool = True) -> None:
    """Import the libraries once with their import-time chatter out of the table's way: torchao's loggers raised to
    ERROR and warnings ignored while gym_lightning, bitsandbytes and torchao are imported, gym_lightning's
    ``quiet_console`` applied before bitsandbytes is (it drops its "Failed to load CPU gemm_4bit_forward" notice)."""
    import logging

    loggers = [logging.getLogger(name) for name in _IMPORT_CHATTER]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            from gym_lightning.quiet import quiet_console

            quiet_console()
            import bitsandbytes  # noqa: F401

            if torchao:
                import torchao as _torchao  # noqa: F401
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


@contextlib.contextmanager
def plain_torch() -> Iterator[None]:
    """gym_lightning's ``nf4.dequantize`` on its plain-torch path (as without bitsandbytes) while inside."""
    from gym_lightning.quant import nf4

    kernel = nf4._bitsandbytes
    nf4._bitsandbytes = lambda: None
    try:
        yield
    finally:
        nf4._bitsandbytes = kernel


# ------------------------------------------------------------------------------------------------ the libraries
@dataclass
class Library:
    """One way of storing a frozen NF4 weight: how to quantise it, what it consists of, how to use it."""

    name: str
    double_quant: bool
    quantize: Callable[[torch.Tensor], Any]
    tensors: Callable[[Any], list[torch.Tensor]]
    dequantize: Callable[[Any], torch.Tensor]
    linear: Callable[[torch.Tensor, Any], torch.Tensor]
    # Entered around each of the library's measures (gym_lightning's plain-torch rows: ``plain_torch``).
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _gym(double_quant: bool, kernel: bool) -> Library:
    from gym_lightning.quant import nf4
    from gym_lightning.quant.linear import NF4Linear

    def layer(parts: dict[str, torch.Tensor]) -> NF4Linear:
        rows, half = parts["codes"].shape
        built = NF4Linear(2 * half, rows, bias=False, double_quant=double_quant, compute_dtype=torch.bfloat16)
        built.load_quantized(parts)
        return built

    def quantize(weight: torch.Tensor) -> NF4Linear:
        return layer(nf4.quantize(weight, BLOCK, double_quant))

    def timed(weight: torch.Tensor) -> Any:
        return nf4.quantize(weight, BLOCK, double_quant)

    path = "bitsandbytes kernel" if kernel else "plain torch"
    lib = Library(
        name=f"gym_lightning `NF4Linear`, {path}{'' if double_quant else ', no double quant'}",
        double_quant=double_quant,
        quantize=quantize,
        tensors=lambda q: list(q.parts().values()),
        dequantize=lambda q: q.dequantized(),
        linear=lambda x, q: q(x),
        context=contextlib.nullcontext if kernel else plain_torch,
    )
    lib.timed_quantize = timed  # type: ignore[attr-defined]  # the pure function, without building the module
    return lib


def _torchao() -> Library:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    def tensors(q: Any) -> list[torch.Tensor]:
        names, _ = q.__tensor_flatten__()
        return [getattr(q, name) for name in names]

    return Library(
        name="torchao `NF4Tensor` (double quant always)",
        double_quant=True,
        quantize=lambda w: to_nf4(w, BLOCK, 256),
        tensors=tensors,
        dequantize=lambda q: q.get_original_weight(),
        linear=lambda x, q: linear_nf4(x, q),
    )


def _bnb(double_quant: bool) -> Library:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return bnbf.quantize_4bit(weight, blocksize=BLOCK, compress_statistics=double_quant, quant_type="nf4")

    def tensors(q: tuple[torch.Tensor, Any]) -> list[torch.Tensor]:
        packed, state = q
        # What a checkpoint of the layer holds: the packed codes and the quant state's tensors (absmax, code books,
        # the nested absmax / offset of double quantisation); the packed JSON of the state is metadata, left out.
        kept = [t for k, t in state.as_dict(packed=True).items() if torch.is_tensor(t) and "bitsandbytes__" not in k]
        return [packed, *kept]

    return Library(
        name=f"bitsandbytes `Params4bit`{'' if double_quant else ', no double quant'}",
        double_quant=double_quant,
        quantize=quantize,
        tensors=tensors,
        dequantize=lambda q: bnbf.dequantize_4bit(q[0], q[1]),
        linear=lambda x, q: bnb.matmul_4bit(x, q[0].t(), quant_state=q[1]),
    )


def libraries() -> list[Library]:
    gym = [_gym(True, True), _gym(False, True), _gym(True, False), _gym(False, False)]
    return [*gym, _torchao(), _bnb(True), _bnb(False)]


# ------------------------------------------------------------------------------------------ 1-process measures
def _median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def allocator_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes held by PyTorch's CPU allocator above the start while ``fn`` runs (allocations minus frees, in
    time order, from the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def step_measures(
    linear: Callable[[torch.Tensor], torch.Tensor], inputs: int, tokens: int, repeats: int
) -> tuple[float, int]:
    """Median forward + backward seconds of ``linear`` and its allocator peak, for ``x [tokens, inputs]`` bf16."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, inputs, generator=generator, dtype=torch.bfloat16).requires_grad_()
    grad = None

    def step() -> None:
        nonlocal grad
        x.grad = None
        y = linear(x)
        if grad is None:  # drawn once, outside the timed steps after the warm-up
            grad = torch.randn(y.shape, generator=generator, dtype=y.dtype)
        y.backward(grad)

    seconds = _median_seconds(step, repeats)
    x.grad = None
    return seconds, allocator_peak(step)


def measure_shape(libs: list[Library], out: int, inputs: int, tokens: int, repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    weight = (torch.randn(out, inputs) * 0.02).to(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    seconds, peak = step_measures(lambda x: x @ weight.t(), inputs, tokens, repeats)
    rows.append({"library": "bf16 weight, no quantisation (reference)", "shape": f"{out}x{inputs}", "bits": 16.0})
    rows[-1] |= {"fwd_bwd_s": seconds, "peak_mib": peak / MIB}
    for lib in libs:
        quantize = getattr(lib, "timed_quantize", lib.quantize)
        with lib.context():
            quant_s = _median_seconds(lambda q=quantize: q(weight), repeats=max(1, repeats - 1), warmup=0)
            q = lib.quantize(weight)
            bits = sum(t.numel() * t.element_size() for t in lib.tensors(q)) * 8 / weight.numel()
            error = (lib.dequantize(q).float() - weight.float()).abs()
            seconds, peak = step_measures(lambda x, q=q, lib=lib: lib.linear(x, q), inputs, tokens, repeats)
        rows.append(
            {
                "library": lib.name,
                "shape": f"{out}x{inputs}",
                "quant_s": quant_s,
                "bits": bits,
                "mean_err": error.mean().item(),
                "max_err": error.max().item(),
                "fwd_bwd_s": seconds,
                "peak_mib": peak / MIB,
            }
        )
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        del q, error
    return rows


# ------------------------------------------------------------------------------------ 2-rank strategy tries
# (library key, label): gym_lightning on both dequantisation paths; bitsandbytes twice, since its storage dtype is the
# knob meant for sharded wrappers.
DIST_LIBS = {
    "gym": "gym_lightning `NF4Linear` (integer parameters), bitsandbytes kernel",
    "gym_torch": "gym_lightning `NF4Linear` (integer parameters), plain torch",
    "torchao": "torchao `NF4Tensor` parameter",
    "bnb_uint8": "bitsandbytes `Linear4bit`, quant_storage uint8",
    "bnb_bf16": "bitsandbytes `Linear4bit`, quant_storage bfloat16",
}


def quantized_weight(lib: str, weight: torch.Tensor) -> Any:
    """``weight`` in ``lib``'s 4-bit form (double quantisation on), as its own API makes it. Called outside
    ``zero.Init``: that context patches ``torch.tensor`` and friends to make floating tensors in the training dtype,
    which would change the quantisation itself (the code book in bf16), not test how the storage survives."""
    if lib.startswith("gym"):
        from gym_lightning.quant import nf4

        return nf4.quantize(weight, BLOCK, True)
    if lib == "torchao":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        return to_nf4(weight, BLOCK, 256)
    import bitsandbytes as bnb

    storage = torch.uint8 if lib == "bnb_uint8" else torch.bfloat16
    params = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_storage=storage)
    return params.to("cpu")  # Params4bit quantises on its first move to a device


def stored_tensors(lib: str, quantized: Any) -> list[torch.Tensor]:
    """Every tensor the quantised weight is made of (``quantized_weight``'s result, or the live layer's)."""
    if lib.startswith("gym"):
        return list(quantized.values())
    if lib == "torchao":
        return [getattr(quantized, name) for name in quantized.__tensor_flatten__()[0]]
    state = quantized.quant_state
    return [quantized.data, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]


def _change(now: torch.Tensor, built: torch.Tensor) -> str:
    """How a gathered tensor of the quantised weight differs from the one built (bit for bit); empty if it does not."""
    if now.dtype != built.dtype or now.shape != built.shape:
        return f"{built.dtype} {tuple(built.shape)} came back as {now.dtype} {tuple(now.shape)}"
    if built.is_floating_point():  # compare the bits: a NaN bit pattern is data here, not a number
        now, built = now.reshape(-1).view(torch.uint8), built.reshape(-1).view(torch.uint8)
    differ = (now != built).sum().item()
    return f"{differ} of {built.numel()} {built.dtype} bytes/values changed" if differ else ""


def _live(lib: str, block: nn.Module) -> Any:
    return block.base.parts() if lib.startswith("gym") else block.base.weight


def _base_layer(lib: str, quantized: Any, out: int, inputs: int) -> nn.Module:
    """The frozen 4-bit linear layer of ``lib`` holding ``quantized``, set inside the layer's ``__init__`` so that
    ``zero.Init`` partitions the quantised tensors as the layer is built."""
    if lib.startswith("gym"):
        from gym_lightning.quant.linear import NF4Linear

        class GymBase(NF4Linear):
            def __init__(self) -> None:
                super().__init__(inputs, out, bias=False, double_quant=True, compute_dtype=torch.bfloat16)
                self.load_quantized(quantized)

        return GymBase()
    if lib == "torchao":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        class TorchaoBase(nn.Module):  # torchtune's FrozenNF4Linear, reduced to what matters here
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(quantized, requires_grad=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return linear_nf4(x, self.weight)

        return TorchaoBase()
    import bitsandbytes as bnb

    class BnbBase(bnb.nn.Linear4bit):
        def __init__(self) -> None:
            storage = quantized.quant_storage
            super().__init__(inputs, out, bias=False, compute_dtype=torch.bfloat16, quant_storage=storage)
            self.weight = quantized
            # What Params4bit's own quantisation does for the layer it belongs to: the layer keeps the quant state
            # too, and puts it back on a weight that a wrapper replaced (bnb's FSDP recovery path).
            self.quant_state = quantized.quant_state

    return BnbBase()


class Adapter(nn.Module):
    """A trainable bf16 LoRA factor whose values are set inside ``__init__``: ``zero.Init`` partitions a module's
    parameters as its ``__init__`` returns, after which they can no longer be written in place."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(init.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class QLoRABlock(nn.Module):
    """``base(x) + lora_b(lora_a(x))``: a frozen 4-bit base with trainable bf16 adapters, as peft builds QLoRA."""

    def __init__(self, lib: str, quantized: Any, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        super().__init__()
        self.base = _base_layer(lib, quantized, lora_b.shape[0], lora_a.shape[1])
        self.lora_a, self.lora_b = Adapter(lora_a), Adapter(lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _inputs() -> dict[str, torch.Tensor]:
    """The weight, the LoRA factors, the input and the output gradient: the same on every rank. Drawn before any
    ``zero.Init``, which patches ``torch.randn`` to draw in the training dtype."""
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    # B is not zero (as peft's initialisation would have it), so that A has a gradient to compare too.
    return {
        "weight": draw(DIST_OUT, DIST_IN, scale=0.02),
        "lora_a": draw(DIST_RANK, DIST_IN, scale=0.05),
        "lora_b": draw(DIST_OUT, DIST_RANK, scale=0.05),
        "x": draw(DIST_TOKENS, DIST_IN),
        "grad": draw(DIST_TOKENS, DIST_OUT),
    }


def _block(lib: str, data: dict[str, torch.Tensor], quantized: Any = None) -> QLoRABlock:
    quantized = quantized_weight(lib, data["weight"]) if quantized is None else quantized
    return QLoRABlock(lib, quantized, data["lora_a"], data["lora_b"])


def _reference(lib: str) -> dict[str, torch.Tensor]:
    data = _inputs()
    block, grad = _block(lib, data), data["grad"]
    x = data["x"].clone().requires_grad_()
    y = block(x)
    y.backward(grad)
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        "lora_a.grad": block.lora_a.weight.grad,
        "lora_b.grad": block.lora_b.weight.grad,
    }


def _fsdp2_try(lib: str) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    data = _inputs()
    block, grad = _block(lib, data), data["grad"]
    fully_shard(block)
    x = data["x"].clone().requires_grad_()
    y = block(x)
    y.backward(grad)
    grads = {n: block.get_parameter(f"{n}.weight").grad for n in ("lora_a", "lora_b")}
    grads = {f"{n}.grad": g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    return {"y": y.detach(), "x.grad": x.grad, **grads}


def _zero3_try(lib: str) -> dict[str, torch.Tensor]:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    try:  # DeepSpeed's CPU collectives op, built once per machine (as gym_lightning's ZeROStrategy loads it)
        from gym_lightning.strategies.zero.ops import SHM_COMM, load_ops

        load_ops([SHM_COMM])
    except Exception:  # DeepSpeed then builds it itself: slower, same result
        pass
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": DIST_TOKENS,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    data = _inputs()
    quantized, grad = quantized_weight(lib, data["weight"]), data["grad"]
    original = [t.clone() for t in stored_tensors(lib, quantized)]  # zero.Init empties the tensors it partitions
    with deepspeed.zero.Init(config_dict_or_path=config):
        block = _block(lib, data, quantized)
    trainable = [p for p in block.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=int(os.environ["LOCAL_RANK"])),  # a CPU rank's device must be given
        model=block,
        model_parameters=trainable,
        optimizer=torch.optim.AdamW(trainable, lr=1e-4),
        config=config,
        dist_init_required=False,
    )
    x = data["x"].clone().requires_grad_()
    y = engine(x)
    engine.backward((y.float() * grad.float()).sum())  # the same gradient as y.backward(grad)
    grads = {f"{n}.grad": safe_get_full_grad(getattr(block, n).weight) for n in ("lora_a", "lora_b")}
    with deepspeed.zero.GatheredParameters(list(block.base.parameters())):
        stored = [t.clone() for t in stored_tensors(lib, _live(lib, block))]
    changed = [_change(a, b) for a, b in zip(stored, original, strict=True)]
    return {"y": y.detach(), "x.grad": x.grad, **grads, "stored_changes": [c for c in changed if c]}


def dist_rank_main(lib: str, strategy: str) -> None:
    """One rank of a 2-rank try: prints one JSON line ``{"status", "detail"}``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _quiet_imports(torchao=lib == "torchao")
    warnings.simplefilter("ignore")
    path = contextlib.ExitStack()
    try:
        if lib == "gym_torch":  # the whole try, the 1-process reference included
            path.enter_context(plain_torch())
        expected = _reference(lib)
        dist.init_process_group("gloo")
        got = _fsdp2_try(lib) if strategy == "fsdp2" else _zero3_try(lib)
        if got.get("stored_changes"):
            detail = "gathered 4-bit tensors differ from the ones built: " + "; ".join(got["stored_changes"])
            print(json.dumps({"status": "wrong result", "detail": detail}), flush=True)
            return
        differences = {}
        for key, ref in expected.items():
            value = got[key]
            if value is None or ref is None or value.shape != ref.shape:
                print(json.dumps({"status": "wrong result", "detail": f"{key}: missing or misshapen"}), flush=True)
                return
            differences[key] = ((value.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"differences / max reference: {differences}", file=sys.stderr)
        worst = max(differences, key=differences.__getitem__)
        status = "works" if differences[worst] <= 0.01 else "wrong result"
        detail = f"largest difference / max reference {differences[worst]:.2g} ({worst})"
        if differences[worst] == 0:
            detail = "y, x.grad and LoRA grads bit-identical to 1 process"
        print(json.dumps({"status": status, "detail": detail}), flush=True)
    except Exception as err:  # an error is this try's result
        traceback.print_exc()  # on stderr, for whoever reads a try's log; the table keeps the first line
        first = (str(err).strip().splitlines() or [""])[0][:160]
        print(json.dumps({"status": "error", "detail": f"{type(err).__name__}: {first}"}), flush=True)
        sys.exit(1)
    finally:
        path.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dist_try(lib: str, strategy: str, timeout: float = DIST_TIMEOUT_S) -> dict[str, Any]:
    """Both ranks of one try as two processes; a timeout, a crash or an error is the try's result."""
    port = _free_port()
    procs = []
    start = time.perf_counter()
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        command = [sys.executable, __file__, "--dist", lib, strategy]
        # Own sessions: a hung try is ended by its process ids, nothing else.
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs.append(subprocess.Popen(command, env=env, start_new_session=True, **pipes))
    outputs = []
    timed_out = False
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - start))))
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, 9)
            outputs.append(proc.communicate())
    results = []
    for rank, (stdout, stderr) in enumerate(outputs):
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if lines:
            results.append(json.loads(lines[-1]))
        elif procs[rank].returncode not in (0, None):
            tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
            results.append({"status": "error", "detail": f"exit {procs[rank].returncode}: {tail[0][:160]}"})
    seconds = time.perf_counter() - start
    for wanted in ("error", "wrong result"):  # the worst rank names the result
        found = [r for r in results if r["status"] == wanted]
        if found:
            return {**found[0], "seconds": seconds}
    if timed_out or len(results) < 2:
        return {"status": "error", "detail": f"timed out after {timeout:.0f} s (a rank hung)", "seconds": seconds}
    return {**results[0], "seconds": seconds}


# ----------------------------------------------------------------------------------------------- the report
def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render(rows: list[dict[str, Any]], dist: dict[str, dict[str, dict[str, Any]]], tokens: int) -> str:
    lines = [
        f"| library | weight (out x in) | quantise, s | bits / weight stored | mean abs error (1e-4) | max abs error "
        f"(1e-3) | fwd + bwd (x: {tokens} tokens), s | peak allocator MiB in fwd + bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        mean_err = None if "mean_err" not in row else row["mean_err"] * 1e4
        max_err = None if "max_err" not in row else row["max_err"] * 1e3
        lines.append(
            f"| {row['library']} | {row['shape']} | {_fmt(row.get('quant_s'), '.3f')} | {row['bits']:.3f} | "
            f"{_fmt(mean_err, '.4f')} | {_fmt(max_err, '.3f')} | {row['fwd_bwd_s']:.3f} | {row['peak_mib']:,.0f} |"
        )
    lines += ["", "| 4-bit weight (2 CPU ranks, gloo) | FSDP2 `fully_shard` | DeepSpeed ZeRO-3 (`zero.Init`) |"]
    lines.append("|---|---|---|")
    for lib, label in DIST_LIBS.items():
        cells = []
        for strategy in STRATEGIES:
            result = dist[lib][strategy]
            marks = {"works": "✅ works", "wrong result": "❌ wrong result", "not run": "not run"}
            mark = marks.get(result["status"], "❌ error")
            cells.append(f"{mark}: {result['detail'].replace('|', '/')} ({result['seconds']:.0f} s)")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096", "1024x1024"], help="out x in")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of x in the forward + backward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-dist", action="store_true", help="no 2-rank strategy tries")
    parser.add_argument("--dist", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dist:
        dist_rank_main(*args.dist)
        return
    started = time.perf_counter()
    _quiet_imports()
    libs = libraries()
    rows = []
    for shape in args.shapes:
        out, inputs = (int(v) for v in shape.split("x"))
        print(f"measuring {shape} ...", file=sys.stderr, flush=True)
        rows += measure_shape(libs, out, inputs, args.tokens, args.repeats)
    dist: dict[str, dict[str, dict[str, Any]]] = {}
    for lib in DIST_LIBS:
        for strategy in STRATEGIES:
            if args.skip_dist:
                result = {"status": "not run", "detail": "--skip-dist", "seconds": 0.0}
            else:
                result = dist_try(lib, strategy)
            dist.setdefault(lib, {})[strategy] = result
            print(f"  {lib} / {strategy}: {result}", file=sys.stderr, flush=True)
    table = render(rows, dist, args.tokens)
    command = " ".join(["python", "benchmarks/qlora_libs.py", *sys.argv[1:]])
    minutes = (time.perf_counter() - started) / 60
    print(table)
    print(f"\n`{command}` took {minutes:.1f} min")


if __name__ == "__main__":
    main()
