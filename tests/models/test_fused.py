"""The fused ops of the fast path (``models.fused``): the same losses and gradients as eager transformers in fp32
over a few optimizer steps (eagerly, inside a per-decoder-layer ``torch.compile``, with LoRA), the same dtypes under
bf16 autocast, less saved for backward, the same model (classes, parameter names), and Liger's transformers
coupling read from its metadata."""

from __future__ import annotations

import copy
import importlib.metadata
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.families import COMMON, FAMILIES
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from gym_lightning.errors import GymUserError
from gym_lightning.lora import LoRAArgs, apply_lora
from gym_lightning.loss import chunked_summed_cross_entropy
from gym_lightning.models.fused import (
    FusedOps,
    RMSNormFunction,
    SiLUMulFunction,
    apply_fused_ops,
    liger_problems,
    liger_summed_linear_cross_entropy,
)

LIGER_085 = Path(__file__).resolve().parents[1] / "fixtures" / "liger" / "liger_kernel-0.8.5.dist-info"
IDS = (torch.arange(2 * 16).reshape(2, 16) * 7 + 3) % 256
# fp32 losses and gradients agree to 4.3e-7 (relative) in the first step (the closed-form backwards sum in another
# order than eager autograd) and to 2.0e-6 after 3 AdamW steps at lr 1e-3 (tiny llama/qwen3, measured). At lr 1e-2
# Adam's normalised update amplifies the rounding of near-zero gradients to 2.3e-5 by step 3, in either direction.
RTOL = 1e-5
# Per decoder layer: llama's 2 norms; qwen3's 2 plus q_norm and k_norm. One final norm each.
COUNTS = {"llama": {"rms_norm": 5, "swiglu": 2, "rope": 0}, "qwen3": {"rms_norm": 9, "swiglu": 2, "rope": 0}}


def tiny(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny fp32 ``family`` model (hidden 64, 2 layers, vocabulary 256: fast) with weights from ``seed``."""
    config = AutoConfig.for_model(family, vocab_size=256, **{**COMMON, **FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train(model: nn.Module, steps: int = 3) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each step's loss and the gradients of every trainable parameter, AdamW stepping in between."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
        loss.backward()
        yield loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()


def assert_same_training(fused: nn.Module, eager: nn.Module) -> None:
    """Losses and every gradient (norm of the difference / norm) within ``RTOL`` over 3 AdamW steps."""
    for (loss, grads), (ref_loss, ref_grads) in zip(train(fused), train(eager), strict=True):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            ref = ref_grads[name]
            assert (grad - ref).norm() <= RTOL * ref.norm() + 1e-12, name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_training_matches_eager(family: str) -> None:
    eager = tiny(family)
    fused = copy.deepcopy(eager)
    assert apply_fused_ops(fused, FusedOps()) == COUNTS[family]
    assert type(fused.model.norm) is type(eager.model.norm)
    assert fused.state_dict().keys() == eager.state_dict().keys()
    assert_same_training(fused, eager)


def test_fused_training_matches_eager_in_compiled_layers() -> None:
    torch._dynamo.reset()
    eager = tiny("qwen3")
    fused = copy.deepcopy(eager)
    apply_fused_ops(fused, FusedOps())
    for layer in fused.model.layers:  # as models.compiled does: each decoder layer's forward, dynamic shapes
        layer.forward = torch.compile(layer.forward, dynamic=True)
    torch._dynamo.utils.counters.clear()
    assert_same_training(fused, eager)
    assert not torch._dynamo.utils.counters["graph_break"]  # the Functions trace into the layer's one graph


def test_fused_training_with_lora_matches_eager() -> None:
    args = LoRAArgs(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    eager = apply_lora(tiny("llama"), args)
    fused = apply_lora(tiny("llama"), args)  # the same adapters: apply_lora draws them from the seeded generator
    assert apply_fused_ops(fused, FusedOps()) == COUNTS["llama"]
    assert fused.state_dict().keys() == eager.state_dict().keys()
    assert_same_training(fused, eager)
    # the adapters ran in the fused MLPs: peft starts lora_B at zero, the steps moved every one of them
    lora_b = {n: p for n, p in fused.named_parameters() if "lora_B" in n and "mlp" in n}
    assert len(lora_b) == 6 and all(p.abs().sum() > 0 for p in lora_b.values())


def test_switches_and_kept_forwards() -> None:
    model = tiny("llama")
    assert apply_fused_ops(model, FusedOps(rms_norm=False)) == {"rms_norm": 0, "swiglu": 2, "rope": 0}
    assert "forward" not in model.model.norm.__dict__
    # a second call keeps what is there (the MLPs' forwards, as tile_mlps would have wrapped them)
    assert apply_fused_ops(model, FusedOps()) == {"rms_norm": 5, "swiglu": 0, "rope": 0}


def test_gemma_norms_and_gelu_mlps_are_left_alone() -> None:
    """Gemma3RMSNorm is ``(x * (1 + w)).to(dtype)`` and Gemma3MLP a GeGLU: math not verified here, kept."""
    model = tiny("gemma3_text")
    assert apply_fused_ops(model, FusedOps()) == {"rms_norm": 0, "swiglu": 0, "rope": 0}
    assert not any("forward" in module.__dict__ for module in model.modules())


def test_a_silu_mlp_with_another_forward_is_left_alone() -> None:
    class OtherMLP(modeling_llama.LlamaMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    model = tiny("llama")
    model.model.layers[0].mlp = OtherMLP(model.config)
    assert apply_fused_ops(model, FusedOps())["swiglu"] == 1


def test_meta_device_model_allocates_nothing() -> None:
    config = AutoConfig.for_model("qwen3", vocab_size=256, **COMMON)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert apply_fused_ops(model, FusedOps()) == COUNTS["qwen3"]
    assert all(p.is_meta for p in model.parameters())


def module_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The output dtype of every norm and MLP in a forward and backward under CPU bf16 autocast, and each
    parameter's gradient dtype."""
    seen: dict[str, torch.dtype] = {}
    for name, module in model.named_modules():
        if name.endswith(("norm", "mlp")):
            module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    return seen | {f"grad {n}": p.grad.dtype for n, p in model.named_parameters()}


def test_dtypes_under_bf16_autocast_are_eager_dtypes() -> None:
    eager = tiny("qwen3")
    fused = copy.deepcopy(eager)
    apply_fused_ops(fused, FusedOps())
    dtypes = module_dtypes(fused)
    assert dtypes == module_dtypes(eager)
    assert dtypes["model.layers.0.mlp"] == torch.bfloat16  # the autocast matmuls ran in bf16
    # and a bf16 input into an fp32 weight, as a norm after a bf16 residual: the gradients' dtypes too
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    norm = modeling_llama.LlamaRMSNorm(64)
    expected = norm(x)
    got = RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == expected.dtype == torch.float32
    assert [g.dtype for g in torch.autograd.grad(got.sum(), (x, norm.weight))] == [torch.bfloat16, torch.float32]


def saved_numel(fn: Callable[[], torch.Tensor], parameters: tuple[torch.Tensor, ...] = ()) -> int:
    """Elements of the distinct non-parameter tensors autograd saves for backward while ``fn`` runs."""
    saved: dict[tuple[int, int, tuple[int, ...]], int] = {}
    skip = {p.untyped_storage().data_ptr() for p in parameters}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


def test_fused_norm_and_swiglu_save_less_than_eager() -> None:
    x = torch.randn(4, 8, 64, requires_grad=True)
    norm = modeling_llama.LlamaRMSNorm(64)
    eager_norm = saved_numel(lambda: norm(x), (norm.weight,))
    fused_norm = saved_numel(lambda: RMSNormFunction.apply(x, norm.weight, 1e-6), (norm.weight,))
    assert (eager_norm, fused_norm) == (2 * x.numel() + 32, x.numel() + 32)  # eager keeps the normalised x too
    gate, up = torch.randn(32, 128, requires_grad=True), torch.randn(32, 128, requires_grad=True)
    eager_mlp = saved_numel(lambda: F.silu(gate) * up)
    assert (eager_mlp, saved_numel(lambda: SiLUMulFunction.apply(gate, up))) == (3 * 32 * 128, 2 * 32 * 128)


def test_eager_rope_saves_only_cos_and_sin() -> None:
    """Why ``kernels="torch"`` leaves RoPE alone: autograd keeps no q- or k-sized tensor for it."""
    q, k = torch.randn(2, 4, 16, 16, requires_grad=True), torch.randn(2, 2, 16, 16, requires_grad=True)
    cos, sin = torch.randn(2, 16, 16), torch.randn(2, 16, 16)
    numel = saved_numel(lambda: modeling_llama.apply_rotary_pos_emb(q, k, cos, sin))
    assert numel == 2 * cos.numel()  # cos and sin unsqueezed: one view each, shared by q and k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functions_backward_matches_autograd(dtype: torch.dtype) -> None:
    """Against transformers' own LlamaRMSNorm (fp32 weight, as under bf16-mixed) and ``silu(g) * u``."""
    x = torch.randn(3, 7, 32, dtype=dtype, requires_grad=True)
    norm = modeling_llama.LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    grad = torch.randn(3, 7, 32)
    eager, ours = norm(x), RMSNormFunction.apply(x, norm.weight, 1e-6)
    torch.testing.assert_close(ours, eager, rtol=0, atol=0)  # the same ops in the same order
    ours_grads = torch.autograd.grad(ours, (x, norm.weight), grad)
    pairs = zip(ours_grads, torch.autograd.grad(eager, (x, norm.weight), grad), strict=True)
    for a, b in pairs:
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    grad = grad.to(dtype)
    up = torch.randn_like(x, requires_grad=True)
    ours, eager = SiLUMulFunction.apply(x, up), F.silu(x) * up
    torch.testing.assert_close(ours, eager, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(ours, (x, up), grad), torch.autograd.grad(eager, (x, up), grad), strict=True):
        torch.testing.assert_close(a, b, **tol)


# ------------------------------------------------------------------------------------------------ settings


def test_from_value_and_problems() -> None:
    assert FusedOps.from_value(None) is None
    assert FusedOps.from_value({"rope": False, "kernels": "liger"}) == FusedOps(rope=False, kernels="liger")
    ops = FusedOps(swiglu=True)
    assert FusedOps.from_value(ops) is ops
    with pytest.raises(GymUserError, match=r"unknown settings.*'ropes'"):
        FusedOps.from_value({"ropes": True})
    with pytest.raises(GymUserError, match=r"2 problem\(s\)") as err:
        apply_fused_ops(tiny("llama"), FusedOps(rms_norm="yes", kernels="triton"))  # type: ignore[arg-type]
    assert "fused_ops.rms_norm must be true or false, got 'yes'" in str(err.value)
    assert "fused_ops.kernels must be one of torch, liger" in str(err.value)


# ----------------------------------------------------------------------------------------------- Liger


def test_liger_0_8_5_fits_transformers_5_17_and_not_4() -> None:
    """liger-kernel 0.8.5's own metadata and monkey_patch.py (excerpt), unpacked in tests/fixtures/liger."""
    dist = importlib.metadata.PathDistribution(LIGER_085)
    assert dist.version == "0.8.5"
    assert liger_problems("5.17.0", dist) == []
    assert liger_problems("5.25.0", dist) == []
    problems = liger_problems("4.57.1", dist)
    assert len(problems) == 2, problems
    assert "requires transformers>=5.0.0, found 4.57.1" in problems[0]
    assert "refuses transformers below 5.0.0 (its monkey_patch.py)" in problems[1]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_liger_kernels_without_liger_say_how_to_install() -> None:
    assert liger_problems("5.17.0") == ["liger-kernel is not installed: pip install 'gym-lightning[liger]'"]
    with pytest.raises(GymUserError, match=r"pip install 'gym-lightning\[liger\]'"):
        apply_fused_ops(tiny("llama"), FusedOps(kernels="liger"))
    with pytest.raises(GymUserError, match=r"pip install 'gym-lightning\[liger\]'"):
        liger_summed_linear_cross_entropy(torch.zeros(1, 2, 4), torch.zeros(8, 4), torch.zeros(1, 2), False)


def fake_liger_fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    chunk_mem_const: int = 1,
) -> torch.Tensor:
    """liger-kernel 0.8.5's ``liger_fused_linear_cross_entropy`` signature, computed in torch."""
    assert input.dim() == 2 and target.dim() == 1
    logits = F.linear(input, weight, bias).float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.mark.parametrize("shifted", [False, True])
def test_liger_linear_cross_entropy_is_the_summed_token_loss(monkeypatch: pytest.MonkeyPatch, shifted: bool) -> None:
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fake_liger_fused_linear_cross_entropy  # type: ignore[attr-defined]
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 9, 16), nn.Linear(16, 40, bias=True)
    labels = torch.randint(0, 40, (2, 9))
    labels[0, :3] = -100
    got = liger_summed_linear_cross_entropy(hidden, head.weight, labels, shifted, bias=head.bias)
    expected = chunked_summed_cross_entropy(hidden, head, labels, chunk_tokens=5, shifted=shifted)
    torch.testing.assert_close(got, expected)


def test_liger_patch_keeps_only_its_rope_global(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's per-family patch (mimicked: it swaps the modeling module's RoPE function and classes and binds
    forwards on the instances) on a peft model: its base model is patched, the classes are put back, counts."""
    original_rope, original_mlp = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaMLP
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", original_rope)  # undone after the test

    def fake_apply(rope: bool, rms_norm: bool, swiglu: bool, model: nn.Module, **flags: bool) -> None:
        assert flags == {"cross_entropy": False, "fused_linear_cross_entropy": False}
        assert type(model).__name__ == "LlamaForCausalLM"  # the base model, not the peft wrapper
        modeling_llama.apply_rotary_pos_emb = lambda *args, **kwargs: original_rope(*args, **kwargs)
        modeling_llama.LlamaMLP = modeling_llama.LlamaRMSNorm = nn.Identity
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(type(layer.mlp).forward, layer.mlp)
            layer.input_layernorm.forward = types.MethodType(type(layer.input_layernorm).forward, layer.input_layernorm)

    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": fake_apply}  # type: ignore[attr-defined]
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", monkey_patch)
    monkeypatch.setattr("gym_lightning.models.fused.liger_problems", lambda version: [])
    model = apply_lora(tiny("llama"), LoRAArgs(r=4, target_modules=["gate_proj"]))
    assert apply_fused_ops(model, FusedOps(kernels="liger")) == {"rms_norm": 2, "swiglu": 2, "rope": 1}
    assert modeling_llama.LlamaMLP is original_mlp and modeling_llama.LlamaRMSNorm is not nn.Identity
    assert modeling_llama.apply_rotary_pos_emb is not original_rope  # the one process-global patch
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN["llama"] = lambda **kwargs: None  # type: ignore[attr-defined]
    with pytest.raises(GymUserError, match=r"did not replace .*apply_rotary_pos_emb"):
        apply_fused_ops(tiny("llama"), FusedOps(kernels="liger"))
    with pytest.raises(GymUserError, match="no kernels for model type 'gemma3_text'"):
        apply_fused_ops(tiny("gemma3_text"), FusedOps(kernels="liger"))
