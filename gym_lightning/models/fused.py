"""Fused ops of the opt-in fast path: RMSNorm, SwiGLU, RoPE and the LM head's cross-entropy, each switchable.

Every replacement is per instance, like ``models.tiling.tile_mlps``: a module's ``forward`` is set on the instance,
its class, parameters and parameter names stay, so checkpoints, LoRA targets and the strategies' hooks (FSDP2,
ZeRO-3 gathers, DDP buckets) see the same model. Weights stay where the precision plugin keeps them (fp32 master
weights and optimizer state under bf16-mixed); the ops compute in the dtypes eager transformers code does under the
same autocast, so they change what autograd saves, not the arithmetic a step does.

``kernels="torch"`` (no extra dependency, runs on every device, eagerly and inside a per-decoder-layer
``torch.compile``): autograd Functions that save less than eager autograd for RMSNorm (:class:`RMSNormFunction`) and
SwiGLU (:class:`SiLUMulFunction`); RoPE and the linear cross-entropy are not replaced here (:class:`FusedOps` says
why). ``kernels="liger"`` (``pip install 'gym-lightning[liger]'``, CUDA and Triton): Liger-Kernel's per-family
patches (:func:`apply_fused_ops`; RoPE's is process-global) and :func:`liger_summed_linear_cross_entropy`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from gym_lightning.errors import GymUserError, raise_if_problems
from gym_lightning.settings import settings_from

Kernels = Literal["torch", "liger"]
KERNELS: tuple[str, ...] = get_args(Kernels)
LIGER_INSTALL = "pip install 'gym-lightning[liger]'"
# The liger-kernel release whose patches and functional API this file was checked against (its source: the targets of
# apply_liger_kernel_to_llama/qwen3/qwen2/mistral exist in transformers 5.17.0 and 5.25.0 modeling files).
LIGER_CHECKED = "0.8.5"


@dataclass(frozen=True)
class FusedOps:
    """Which fused ops the fast path uses.

    Args:
        rms_norm: Replace Llama-style RMSNorms (:class:`RMSNormFunction` says which count as such).
        swiglu: Replace ``down(silu(gate(x)) * up(x))`` MLPs (:class:`SiLUMulFunction`).
        rope: Liger's RoPE kernel (process-global patch); nothing with ``kernels="torch"``, where RoPE is left to
            inductor inside the compiled decoder layer: transformers' attention calls its modeling file's
            module-level ``apply_rotary_pos_emb``, so replacing it per instance is impossible without a
            process-global patch, and there is nothing to save: ``q * cos + rotate_half(q) * sin`` saves only ``cos``
            and ``sin`` in eager autograd (the slices, ``neg`` and ``cat`` of ``rotate_half`` save nothing;
            ``tests/models/test_fused.py`` checks it). Inside the compiled decoder layer inductor fuses it into one
            kernel.
        linear_cross_entropy: Never hold ``[tokens, vocab]`` logits: the chunked LM head + cross-entropy with
            ``kernels="torch"`` (``loss.chunked_summed_cross_entropy``: the module maps this switch onto its loss
            chunking; nothing in this file), Liger's fused linear cross-entropy with ``kernels="liger"``.
        kernels: ``torch`` (autograd Functions in this file) or ``liger`` (Liger-Kernel's Triton kernels).
    """

    rms_norm: bool = True
    swiglu: bool = True
    rope: bool = True
    linear_cross_entropy: bool = True
    kernels: Kernels = "torch"

    def problems(self) -> list[str]:
        """Every wrong setting, one sentence each (empty when all are right)."""
        found = [
            f"fused_ops.{spec.name} must be true or false, got {getattr(self, spec.name)!r}"
            for spec in fields(self)
            if spec.name != "kernels" and not isinstance(getattr(self, spec.name), bool)
        ]
        if self.kernels not in KERNELS:
            found.append(
                f"fused_ops.kernels must be one of {', '.join(KERNELS)} (liger needs {LIGER_INSTALL}), "
                f"got {self.kernels!r}"
            )
        return found

    @classmethod
    def from_value(cls, value: FusedOps | Mapping[str, Any] | None) -> FusedOps | None:
        """``value`` as ``FusedOps``: as given, or built from a mapping of its fields (YAML, a checkpoint's
        hyper-parameters); ``None`` stays ``None`` (no fused ops)."""
        return settings_from(cls, value, "fused_ops", "fused op switches (rms_norm, swiglu, rope, ...)")


# ------------------------------------------------------------------------------------------------- RMSNorm


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``, saving ``x`` and ``rstd`` only.

    The math of transformers' ``LlamaRMSNorm`` (normalise in fp32, cast back to the input dtype, multiply by the
    weight) with a closed-form backward, saving the input and the ``[..., 1]`` fp32 ``rstd``. Eager autograd saves the
    fp32 input, ``rstd`` and the normalised input (one more ``[tokens, hidden]`` tensor; two more for a bf16 input,
    whose fp32 copy it keeps too). Only norms whose ``forward`` is, as source text, the one verified here
    (``LlamaRMSNorm``'s, which Qwen2/Qwen3/Mistral/... copy) are replaced (:func:`is_llama_rms_norm`); Gemma's
    ``x * (1 + w)`` norms, which also cast after the weight, and Olmo2's ``(w * x).to(dtype)`` are left alone.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Args: ``ctx`` autograd's context; ``x`` ``[..., hidden]``; ``weight`` ``[hidden]``; ``eps`` added to the
        mean square. The same ops as ``LlamaRMSNorm.forward``, so the output (and its dtype) is the same."""
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        """Args: ``ctx`` with ``x, weight, rstd``; ``grad`` the output's gradient. With ``n = x * rstd`` (fp32):
        ``dw = sum(dy * n)``, ``dx = rstd * (g - n * mean(g * n))`` where ``g = dy * w`` (RMSNorm's Jacobian)."""
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(torch.float32) * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            # the cast to x.dtype is part of the forward: dw sees the rounded normalised input, as in eager
            rows = (grad.to(torch.float32) * normed.to(x.dtype).to(torch.float32)).reshape(-1, weight.shape[-1])
            grad_w = rows.sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).to(torch.float32)
            grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def _rms_norm_forward(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, norm.weight, norm.variance_epsilon)


# ------------------------------------------------------------------------------------------------- SwiGLU


class SiLUMulFunction(torch.autograd.Function):
    """``silu(gate) * up``, saving ``gate`` and ``up`` and recomputing ``silu(gate)`` in backward.

    Eager autograd saves ``silu(g)`` as well, one ``[tokens, intermediate]`` tensor more. The MLP's projections are
    still called as modules (``down(silu(gate(x)) * up(x))``), so peft's LoRA layers and the strategies' hooks run.
    """

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Args: ``ctx`` autograd's context; ``gate``, ``up`` the two projections' outputs (same shape). The same ops
        as eager ``act_fn(gate) * up``, so the same values and dtype."""
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: ``ctx`` with ``gate, up``; ``grad`` the output's gradient. ``silu'(g) = s * (1 + g * (1 - s))``
        with ``s = sigmoid(g)``, computed in fp32 as PyTorch's ``silu_backward`` does for 16-bit inputs."""
        gate, up = ctx.saved_tensors
        g = gate.to(torch.float32)
        sig = torch.sigmoid(g)
        silu = (g * sig).to(gate.dtype)  # the forward's rounded activation, which the up gradient multiplied
        grad_up = grad * silu
        grad_gate = (grad * up).to(torch.float32) * (sig * (1.0 + g * (1.0 - sig)))
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def _swiglu_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(SiLUMulFunction.apply(mlp.gate_proj(x), mlp.up_proj(x)))


# ----------------------------------------------------------------------------------------- which modules


def _body(function: Callable[..., Any]) -> str:
    """The source of ``function`` without its ``def`` line, whitespace collapsed ('' when there is none)."""
    try:
        lines = inspect.getsource(function).splitlines()
    except (OSError, TypeError):
        return ""
    return " ".join(" ".join(lines[1:]).split())


# The forwards whose math the Functions above were checked against (transformers 5.17.0 and 5.25.0, LlamaRMSNorm and
# LlamaMLP; Qwen2, Qwen3, Mistral, Phi-3's norm, DeepSeek-V3 ... are "Copied from" them, the same text).
_LLAMA_RMS_NORM = (
    "input_dtype = hidden_states.dtype hidden_states = hidden_states.to(torch.float32) variance = "
    "hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * torch.rsqrt(variance + "
    "self.variance_epsilon) return self.weight * hidden_states.to(input_dtype)"
)
_LLAMA_MLP = "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) return down_proj"


@cache
def _forward_body(cls: type) -> str:
    return _body(cls.forward)


def _untouched(module: nn.Module) -> bool:
    """No ``forward`` set on the instance yet (by an earlier call, ``tile_mlps``, Liger): that one is kept."""
    return "forward" not in module.__dict__


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm with ``LlamaRMSNorm``'s math (``RMSNormFunction`` computes the same)."""
    return _forward_body(type(module)) == _LLAMA_RMS_NORM and isinstance(getattr(module, "weight", None), torch.Tensor)


def is_swiglu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is ``down(silu(gate(x)) * up(x))``: ``LlamaMLP``'s forward with a SiLU activation."""
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and _forward_body(type(module)) == _LLAMA_MLP


# ----------------------------------------------------------------------------------------------- apply


def apply_fused_ops(model: nn.Module, ops: FusedOps) -> dict[str, int]:
    """Replace the ``forward`` of every module of ``model`` that ``ops`` fuses; returns how many of each it replaced.

    Works on a peft-wrapped model (the MLP's projections stay module calls, so LoRA layers run) and on a
    meta-device model (nothing is allocated). Call it before ``tile_mlps``: a module whose instance already has its
    own ``forward`` is left as it is, and so is one with math not verified here (Gemma's norms, GeGLU MLPs).

    Args:
        model: A transformers causal LM, or a peft model wrapping one.
        ops: The switches; ``kernels="liger"`` needs liger-kernel (``pip install 'gym-lightning[liger]'``).

    Returns:
        ``{"rms_norm": n, "swiglu": n, "rope": n}``: modules (or, for RoPE, modeling modules) replaced.
    """
    raise_if_problems("Invalid fused_ops settings", ops.problems())
    if ops.kernels == "liger":
        return _apply_liger(model, ops)
    counts = {"rms_norm": 0, "swiglu": 0, "rope": 0}
    for module in model.modules():
        if ops.rms_norm and _untouched(module) and is_llama_rms_norm(module):
            module.forward = types.MethodType(_rms_norm_forward, module)
            counts["rms_norm"] += 1
        elif ops.swiglu and _untouched(module) and is_swiglu_mlp(module):
            module.forward = types.MethodType(_swiglu_forward, module)
            counts["swiglu"] += 1
    return counts


# ------------------------------------------------------------------------------------------------ Liger


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (Liger's patch reads ``model.model.layers``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _liger_apply_fn(model: nn.Module) -> Callable[..., None]:
    """Liger's ``apply_liger_kernel_to_<family>`` for ``model``'s family; a ``GymUserError`` when it has none."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise GymUserError(f"fused_ops.kernels='liger' needs liger-kernel: {LIGER_INSTALL}.") from err
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise GymUserError(
            f"Liger-Kernel has no kernels for model type {model_type!r}; set fused_ops.kernels to 'torch' "
            f"(it supports {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})."
        )
    return MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]


def _apply_liger(model: nn.Module, ops: FusedOps) -> dict[str, int]:
    """Liger's instance patch on ``model``; its process-global class swaps undone (RoPE's function stays).

    Liger-Kernel's per-family ``apply_liger_kernel_to_<family>(..., model=model)`` patches the instances (RMSNorm,
    SwiGLU) and, for RoPE, the modeling module's ``apply_rotary_pos_emb``: a process-global patch that every model of
    that family built later in the process shares. Liger also swaps the modeling module's norm and MLP classes
    (``modeling_llama.LlamaMLP = LigerSwiGLUMLP``, whose ``__init__`` drops ``mlp_bias``); those are put back, so only
    the RoPE function stays patched.
    """
    import transformers

    raise_if_problems("liger-kernel does not fit this transformers", liger_problems(transformers.__version__))
    base = _base_model(model)
    apply_fn = _liger_apply_fn(base)
    modeling = sys.modules[type(base).__module__]
    before = dict(vars(modeling))
    forwards = {id(m): m.__dict__.get("forward") for m in base.modules()}
    kwargs = {"rope": ops.rope, "rms_norm": ops.rms_norm, "swiglu": ops.swiglu}
    apply_fn(**kwargs, cross_entropy=False, fused_linear_cross_entropy=False, model=base)
    rope = vars(modeling).get("apply_rotary_pos_emb")
    for name, value in before.items():
        if name != "apply_rotary_pos_emb" and vars(modeling).get(name) is not value:
            setattr(modeling, name, value)
    if ops.rope and (rope is None or rope is before.get("apply_rotary_pos_emb")):
        raise GymUserError(
            f"Liger-Kernel {_liger_version()} did not replace {modeling.__name__}.apply_rotary_pos_emb (transformers "
            f"{transformers.__version__} may have renamed it); set fused_ops.rope to false or use the checked "
            f"liger-kernel {LIGER_CHECKED}."
        )
    changed = [m for m in base.modules() if m.__dict__.get("forward") is not forwards.get(id(m))]
    mlps = sum(hasattr(m, "down_proj") for m in changed)  # Liger's SwiGLU patch; the rest are its norms
    return {"rms_norm": len(changed) - mlps, "swiglu": mlps, "rope": int(ops.rope)}


def liger_summed_linear_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    shifted: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The summed token cross-entropy of ``hidden @ lm_head_weight.T (+ bias)`` against ``labels`` (``-100``:
    not a target), from Liger's fused linear cross-entropy, which never holds the ``[tokens, vocab]`` logits: the
    same contract as ``loss.chunked_summed_cross_entropy``.

    Args:
        hidden: ``[batch, seq, hidden]`` final hidden states (after the last norm).
        lm_head_weight: ``[vocab, hidden]`` LM head weight (gathered: Liger reads the tensor, not the module).
        labels: ``[batch, seq]``; aligned with the inputs, or already the next-token targets when ``shifted``.
        shifted: ``labels`` are already the next-token targets of each position (``shift_labels``).
        bias: The LM head's bias, if it has one.
    """
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:
        raise GymUserError(f"fused_ops.kernels='liger' needs liger-kernel: {LIGER_INSTALL}.") from err
    states = hidden if shifted else hidden[:, :-1, :]
    targets = (labels if shifted else labels[:, 1:]).to(hidden.device)
    flat = states.reshape(-1, hidden.size(-1))
    return liger_fused_linear_cross_entropy(
        flat, lm_head_weight, targets.reshape(-1), bias=bias, ignore_index=-100, reduction="sum"
    )


# --------------------------------------------------------------------------------- transformers coupling

# liger-kernel's monkey_patch.py refuses transformers below this constant (5.0.0 in 0.8.5) at import.
_MIN_TRANSFORMERS = re.compile(r'MIN_SUPPORTED_TRANSFORMERS_VERSION\s*=\s*version\.parse\(\s*["\']([^"\']+)["\']')


def _liger_version() -> str:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def liger_problems(transformers_version: str, distribution: importlib.metadata.Distribution | None = None) -> list[str]:
    """Why the installed liger-kernel does not fit ``transformers_version`` (empty: it fits, as far as it says).

    Read without importing liger-kernel (its import needs Triton): its version against :data:`LIGER_CHECKED`, the
    ``transformers`` requirements in its metadata (0.8.5: ``transformers>=5.0.0`` for its tests), and the
    ``MIN_SUPPORTED_TRANSFORMERS_VERSION`` its monkey_patch.py refuses to import below.

    Args:
        transformers_version: The transformers version to check against (``transformers.__version__``).
        distribution: liger-kernel's distribution; the installed one when ``None`` (tests pass an unpacked one).
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    if distribution is None:
        try:
            distribution = importlib.metadata.distribution("liger-kernel")
        except importlib.metadata.PackageNotFoundError:
            return [f"liger-kernel is not installed: {LIGER_INSTALL}"]
    found, have, want = [], distribution.version, Version(transformers_version)
    if Version(have) < Version(LIGER_CHECKED):
        found.append(f"liger-kernel {have} is older than {LIGER_CHECKED}, the release checked: {LIGER_INSTALL} -U")
    for line in distribution.requires or []:
        req = Requirement(line)
        if req.name == "transformers" and not req.specifier.contains(want, prereleases=True):
            found.append(f"liger-kernel {have} requires transformers{req.specifier}, found {transformers_version}")
    source = distribution.locate_file("liger_kernel/transformers/monkey_patch.py")
    text = source.read_text() if source.is_file() else ""  # type: ignore[union-attr]
    if (match := _MIN_TRANSFORMERS.search(text)) and want < Version(match.group(1)):
        found.append(
            f"liger-kernel {have} refuses transformers below {match.group(1)} (its monkey_patch.py), found "
            f"{transformers_version}"
        )
    return found


__all__ = [
    "KERNELS",
    "LIGER_CHECKED",
    "FusedOps",
    "RMSNormFunction",
    "SiLUMulFunction",
    "apply_fused_ops",
    "is_llama_rms_norm",
    "is_swiglu_mlp",
    "liger_problems",
    "liger_summed_linear_cross_entropy",
]
