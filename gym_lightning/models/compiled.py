"""Regional compilation: ``torch.compile`` of each decoder layer's forward, the opt-in fast path.

Why per layer and not the whole model: a decoder is the same layer N times, so compiling one layer's forward and
reusing it N times compiles once, where a whole-model compile of a billion-parameter model takes minutes
(docs/benchmarks-history.md, "Regional compilation"). torchtitan compiles per block for the same reason (+16 % on
Llama-3.1-8B, 8 x H100) and PyTorch's recipe "Reducing torch.compile cold start compilation time with regional
compilation" says the same. Why the instance's ``forward`` and not ``module.compile()``: :func:`compile_layers`.

Under DDP each compiled layer stays one graph (``CompileArgs.ddp_buckets``): dynamo's DDP optimizer, torch's default
inside a ``DistributedDataParallel`` forward, would split it at DDP's gradient-bucket boundaries, a design for
whole-model graphs, whose gradients would otherwise all come ready at the end of the backward. A compiled layer is
already the unit of that overlap: its gradients come ready when its backward ends and DDP reduces them during the
next layer's backward (docs/benchmarks.md, "gym_ddp + compile").

Sequence lengths vary from batch to batch (the data module pads each batch to its longest row), so layers are
compiled with dynamic shapes from the first call (``dynamic=True``): one graph, no recompilation per length.
Calls with a KV cache (generation) run the eager forward: a cache is Python state dynamo guards on per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from gym_lightning._compat import set_dynamo_ddp_mode
from gym_lightning.models.decoder_layers import decoder_layers

COMPILE_MODES: tuple[str | None, ...] = (
    None,
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)


@dataclass(frozen=True)
class CompileArgs:
    """How each decoder layer is compiled (``torch.compile``'s arguments of the same names).

    Args:
        backend: ``inductor`` (generated Triton/C++ kernels: fuses RMSNorm, SwiGLU and RoPE's elementwise work),
            ``aot_eager`` (autograd tracing only, a debugging step), or any registered dynamo backend.
        mode: ``None``/``default``, ``max-autotune-no-cudagraphs`` (autotuned matmuls, longer compile),
            ``reduce-overhead``/``max-autotune`` (CUDA graphs: refused, they do not mix with variable lengths and
            the strategies' hooks).
        dynamic: Compile for symbolic sequence lengths from the first call (``True``, one graph for every length),
            or let dynamo decide (``None``: static first, then dynamic after one recompilation).
        fullgraph: Require each layer to compile as one graph (an error on a graph break) instead of splitting it.
        ddp_buckets: Under DDP, let dynamo's DDP optimizer split each layer into one graph per DDP gradient bucket
            (``torch._dynamo.config.optimize_ddp = "ddp_optimizer"``, torch's default: a bucket's all-reduce may
            start before the layer's whole backward ends). ``False`` (default): one graph per layer, whose gradients
            are reduced during the next layer's backward (the module docstring).
    """

    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = True
    fullgraph: bool = False
    ddp_buckets: bool = False

    @classmethod
    def from_value(cls, value: bool | dict[str, Any] | CompileArgs | None) -> CompileArgs | None:
        """``CompileArgs`` from a module argument: ``True`` (the defaults), ``False``/``None`` (off), a mapping
        (YAML, a checkpoint's hyperparameters) or an instance."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, dict):
            return cls(**value)
        return value

    def problems(self) -> list[str]:
        """What is wrong with these settings, one sentence each."""
        problems = []
        if self.mode not in COMPILE_MODES:
            problems.append(f"compile.mode must be one of {COMPILE_MODES}, got {self.mode!r}")
        elif self.mode in ("reduce-overhead", "max-autotune"):
            problems.append(
                f"compile.mode={self.mode!r} records CUDA graphs, which need fixed shapes and no hooks between "
                "layers; use 'max-autotune-no-cudagraphs' or the default"
            )
        if not isinstance(self.backend, str) or not self.backend:
            problems.append(f"compile.backend must be a dynamo backend name such as 'inductor', got {self.backend!r}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _eager_with_cache(eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    """The layer's forward: the compiled one, the eager one when the call carries a KV cache (generation)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    forward.__wrapped__ = eager  # type: ignore[attr-defined]  # inspect.signature sees the layer's own arguments
    return forward


def compile_layers(model: nn.Module, args: CompileArgs) -> int:
    """Compile the forward of every decoder layer of ``model`` in place; returns how many layers it compiled.

    Each layer's instance ``forward`` becomes the compiled one (compilation itself happens on the first call), so
    it must run after anything that replaces submodules (LoRA) or forwards inside the layer (fused ops): those are
    traced on the first call, whatever the order they were applied in.

    Why the instance's ``forward`` and not ``module.compile()`` / ``torch.compile(module)``:

    - the module's hooks stay outside the compiled region: FSDP2's unshard/reshard hooks and DeepSpeed's gather
      hooks on the layer run eagerly around it, as they do without compile;
    - the module, its class and its parameter names are unchanged (``torch.compile(module)`` wraps it in an
      ``OptimizedModule`` whose state-dict keys gain ``_orig_mod.``): checkpoints, exports, LoRA targets and the
      strategies see the same model;
    - one compiled code object serves every layer: compiling the layer as a module guards on each layer object and
      stops at dynamo's cache limit (8: the 9th and later layers run eagerly), the bound method's forward gives one
      graph for all the layers.
    """
    layers = decoder_layers(model)
    # transformers >= 5 checkpoints activations inside the layer's forward, and its hub-kernels wrapper sets a context
    # variable around the attention call: a side effect inside the checkpoint, which dynamo refuses to replay in the
    # recompute (a graph break that leaves the whole layer eager). The variable is reset when the call
    # returns, so not replaying it is exact; likewise transformers' output recorders should record once per step.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # Process-wide too, as the flag above: dynamo reads it when it compiles a frame inside a DDP forward (set around
    # each layer call instead, it would cost a config write per call). One graph per layer unless asked.
    set_dynamo_ddp_mode("ddp_optimizer" if args.ddp_buckets else "no_optimization")
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(
            eager, backend=args.backend, mode=args.mode, dynamic=args.dynamic, fullgraph=args.fullgraph
        )
        layer.forward = _eager_with_cache(eager, compiled)
    return len(layers)


__all__ = ["COMPILE_MODES", "CompileArgs", "compile_layers"]
