"""What the device check's processes share (benchmarks/gpu.sh: tests/gpu's checks and gpu_bench.py's runs): the
DeepSpeed JIT guard and the memoised random initialisation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

# The CPU accelerator's shared-memory collective: DeepSpeed loads it in every CPU process group (deepspeed.comm),
# so a CPU run cannot avoid it. Every other op (CPU Adam, fused Adam, async I/O) is refused.
CPU_ONLY_OPS = ("deepspeed_shm_comm",)


def refuse_jit_builds(allowed: Collection[str] = ()) -> list[dict[str, Any]]:
    """Make every DeepSpeed op build raise, except the ops named in ``allowed``; returns the (growing) list of the
    ops asked for: each allowed one loaded, with its load time, and each refused one (``"refused": True``: a code
    path that caught the error and went on still shows).

    A JIT build (``OpBuilder.jit_load``) compiles C++/CUDA for 30 s to minutes: the device check has 6 minutes, so
    a code path that would build one must fail at once and say which op, rather than eat the budget.
    """
    loads: list[dict[str, Any]] = []
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:  # no DeepSpeed: nothing can build
        return loads
    original = OpBuilder.jit_load

    def guarded(self: Any, verbose: bool = True) -> Any:
        name = getattr(self, "name", type(self).__name__)
        if name not in allowed:
            loads.append({"op": name, "refused": True})
            raise RuntimeError(f"refused to JIT-build DeepSpeed's {name} op (the device check builds no op)")
        start = time.perf_counter()
        module = original(self, verbose)
        loads.append({"op": name, "seconds": round(time.perf_counter() - start, 2)})
        return module

    OpBuilder.jit_load = guarded
    return loads


def memoise_cpu_draw(share: bool) -> dict[str, int]:
    """Draw each random initialisation once per process: ``gym_lightning.models.plan.draw_on_cpu`` (every gym
    strategy's random build: gym_ddp and ZeRO-1/2 draw the model with it, gym_fsdp and ZeRO-3 replay it into their
    shards) keeps its first model per config, options and CPU generator state, and hands later calls a copy with the
    same values; the generator is left where the draw would have left it. Returns the counts (``drawn``,
    ``reused``), which grow as runs build.

    Why: the draw runs on one CPU thread (16 ns a parameter measured on this project's 2-core machine, 27 s at the
    1.7B shape), once per gym run; a process of nine runs would spend minutes of the bench drawing the same values.
    What the device sees is unchanged: the same CPU tensors are moved or copied there by the same code. Inside an
    open ``deepspeed.zero.Init`` (Lightning's DeepSpeedStrategy builds there, partitioning as modules are made) the
    real draw runs.

    Args:
        share: Hand out copies whose parameters share the kept tensors' storage (no copy: for CUDA runs, which
            only read them, ``.to(cuda)`` makes new ones); ``False`` clones them (CPU runs train them in place).
    """
    from gym_lightning.models import loading, plan

    original = plan.draw_on_cpu
    kept: dict[str, tuple[Any, Any]] = {}
    counts = {"drawn": 0, "reused": 0}

    def draw(config: Any, options: dict[str, Any]) -> Any:
        if _zero_init_open():
            return original(config, options)
        import torch

        key = _draw_key(config, options, torch.get_rng_state())
        if key not in kept:
            model = original(config, options)
            kept[key] = (model, torch.get_rng_state())
            counts["drawn"] += 1
        else:
            counts["reused"] += 1
        model, after = kept[key]
        torch.set_rng_state(after)
        return _copy_model(model, share)

    plan.draw_on_cpu = loading.draw_on_cpu = draw  # loading imported the name; plan's own callers look it up
    return counts


def _zero_init_open() -> bool:
    """Whether a ``deepspeed.zero.Init`` context is open (DeepSpeed imported and its context counter above 0)."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return bool(module is not None and getattr(module, "zero_init_context", 0))


def _draw_key(config: Any, options: dict[str, Any], rng_state: Any) -> str:
    """The draw's identity: the config (less ``dtype``, which a build writes into it; ``options`` has the build's),
    the ``from_config`` options and the CPU generator's state."""
    fields = {k: v for k, v in config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    text = json.dumps(fields, sort_keys=True, default=str) + repr(sorted(options.items(), key=str))
    return hashlib.sha256(text.encode() + bytes(rng_state.numpy())).hexdigest()


def _copy_model(model: Any, share: bool) -> Any:
    """A new module tree over ``model``'s values: new ``Parameter`` objects (tied ones stay tied) whose tensors share
    ``model``'s storage (``share``) or are clones, so that moving or training the copy leaves ``model`` as drawn."""
    import torch

    make: Callable[[Any], Any] = (lambda t: t.detach()) if share else (lambda t: t.detach().clone())
    memo: dict[int, Any] = {
        id(p): torch.nn.Parameter(make(p), requires_grad=p.requires_grad) for p in model.parameters()
    }
    memo |= {id(b): make(b) for b in model.buffers()}
    return copy.deepcopy(model, memo)
