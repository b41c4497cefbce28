"""The planner's mixture-of-experts LoRA and QLoRA terms (pure formulas, no torch): which 3-D expert weights
``lora.target_parameters`` adapts, their adapters' tensors, and the NF4 expert weights of a QLoRA base.

transformers 5 holds one MoE layer's routed experts as two fused parameters (``models.shapes.ModelShape.
expert_numels``): ``experts.gate_up_proj`` ``[E, 2I, h]`` (in ``h``, out ``2I`` per expert) and ``experts.down_proj``
``[E, h, I]`` (in ``I``, out ``h``). peft's ``ParamWrapper`` (peft 0.17+, ``LoraConfig(target_parameters=...)``)
adapts each with ``lora_A [r E, in]`` and ``lora_B [out, r E]``: ``r E (in + out)`` trainable parameters per
targeted weight and layer, ``E`` rank-``r`` adapters, one per expert. gym's routed forward (``models.experts``) runs
expert ``e``'s adapter only on the tokens routed to ``e``, so its compute and saved activations follow the ``k``
routed experts of a token, not ``E``.

QLoRA stores each fused expert weight as NF4 (``quant.experts``): the codes, block scales and per-row statistics of
the ``E x out`` rows of ``in`` inputs each, exactly ``E`` times one ``[out, in]`` NF4Linear's
(``estimate.nf4_tensors``), expert dimension first (so FSDP2's dim-0 shards and ZeRO-3's partitions hold whole
experts' bytes); only a weight whose input width divides the 64-weight block is quantised, and
``quantization.skip_modules`` naming ``experts`` keeps them 16-bit. Forward and backward dequantise one routed
expert's weight at a time: the transient is one expert's ``[out, in]``, never the ``[E, out, in]`` stack.

The bundled MoE shapes (Qwen3-MoE, Mixtral) have no shared experts and no expert biases, so ``all-experts`` is the
two routed weights there; gym train's ``all-experts`` also adapts shared experts' linears (DeepSeek, Qwen2-MoE), which
the planner does not model (``models.shapes`` refuses those families).
"""

from __future__ import annotations

from collections.abc import Sequence

from gym_lightning.models.shapes import ModelShape, TensorGroup

# LoRAArgs' shorthand for every routed expert's weights (gym_lightning.lora.EXPERTS_SHORTHAND; not imported: the
# planner stays free of torch; tests/planner/test_experts.py checks that the two agree).
EXPERTS_SHORTHAND = "all-experts"
# The fused expert weights of the bundled MoE families, as peft names them under the MoE block.
EXPERT_WEIGHTS: tuple[str, ...] = ("gate_up_proj", "down_proj")


def expert_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of one expert's slice of each fused expert weight (empty for a dense model): ``gate_up_proj``
    ``h -> 2I``, ``down_proj`` ``I -> h``, whatever the storage layout.

    Args:
        shape: The model.
    """
    if not shape.is_moe:
        return {}
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    return {"gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}


def _targeted(name: str) -> str | None:
    """The expert weight a peft ``target_parameters`` entry names (peft matches the parameter's full name or a
    dot-separated suffix of it: ``down_proj``, ``experts.down_proj``, ``mlp.experts.down_proj``), else None."""
    *prefix, last = name.strip().split(".")
    if last not in EXPERT_WEIGHTS or (prefix and prefix[-1] != "experts"):
        return None
    return last


def target_parameter_problems(values: Sequence[str], shape: ModelShape | None, lora_r: int) -> list[str]:
    """Every reason ``values`` (``lora.target_parameters`` / ``--lora_target_parameters``) cannot be planned.

    Args:
        values: The names given (an empty sequence: no expert adapters).
        shape: The model, when known (None: the dense / MoE check is skipped).
        lora_r: The LoRA rank; expert adapters need ``r > 0``.
    """
    if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        return [f"lora_target_parameters must be a list of names, got {values!r}"]
    if not values:
        return []
    problems = []
    unknown = [v for v in values if v != EXPERTS_SHORTHAND and _targeted(v) is None]
    if unknown:
        problems.append(
            f"lora_target_parameters {', '.join(map(repr, unknown))} name no expert weight the planner models: "
            f"give {EXPERTS_SHORTHAND}, or peft names of the fused experts ({', '.join(_peft_names())})"
        )
    if lora_r == 0:
        problems.append("lora_target_parameters adds LoRA adapters to the experts: set lora_r > 0")
    if shape is not None and not shape.is_moe:
        problems.append(
            f"lora_target_parameters adapts a mixture of experts' expert weights, and {shape.name} is dense: "
            "leave it out (target_modules adapts its linear layers)"
        )
    return problems


def _peft_names() -> list[str]:
    return [f"experts.{name}" for name in EXPERT_WEIGHTS]


def targeted_weights(values: Sequence[str]) -> tuple[str, ...]:
    """The fused expert weights ``values`` adapt, in ``EXPERT_WEIGHTS`` order (``all-experts``: both).

    Args:
        values: ``lora.target_parameters``, already checked by :func:`target_parameter_problems`.
    """
    named = {_targeted(v) for v in values if v != EXPERTS_SHORTHAND}
    if EXPERTS_SHORTHAND in values:
        named |= set(EXPERT_WEIGHTS)
    return tuple(name for name in EXPERT_WEIGHTS if name in named)


def expert_adapter_groups(shape: ModelShape, lora_r: int, values: Sequence[str]) -> list[TensorGroup]:
    """The trainable adapter tensors of the targeted expert weights, one group per tensor and layer: peft's
    ``lora_A [r E, in]`` and ``lora_B [out, r E]`` (named ``lora.experts.<weight>.A`` / ``.B``).

    Args:
        shape: The model (none for a dense one).
        lora_r: LoRA rank ``r`` (0: none).
        values: ``lora.target_parameters``.
    """
    if lora_r <= 0 or not shape.is_moe:
        return []
    dims, rank = expert_dims(shape), lora_r * shape.num_experts
    groups = []
    for name in targeted_weights(values):
        fan_in, fan_out = dims[name]
        groups.append(TensorGroup(f"lora.experts.{name}.A", rank * fan_in, shape.num_layers, True))
        groups.append(TensorGroup(f"lora.experts.{name}.B", fan_out * rank, shape.num_layers, True))
    return groups


def expert_adapter_params(shape: ModelShape, lora_r: int, values: Sequence[str]) -> int:
    """Expert adapter parameters of the whole model: ``L r E (in + out)`` per targeted weight.

    Args:
        shape: The model.
        lora_r: LoRA rank.
        values: ``lora.target_parameters``.
    """
    return sum(g.numel * g.count for g in expert_adapter_groups(shape, lora_r, values))


def expert_adapter_activation_bytes(shape: ModelShape, lora_r: int, values: Sequence[str], a_b: int) -> int:
    """What the expert adapters save for backward per token and layer: for each of the token's ``k`` routed experts
    and each adapted weight, ``x A_e^T`` (``r`` values, B's weight gradient needs it); ``x`` itself is the expert's
    gathered input, saved already (``estimate.activation_bytes_per_layer``). Dropout (off by default) would add a
    dropped copy of ``x``; the planner does not model LoRA dropout.

    Args:
        shape: The model.
        lora_r: LoRA rank.
        values: ``lora.target_parameters``.
        a_b: Bytes of an activation (2 in bf16-mixed, 4 in fp32).
    """
    if lora_r <= 0 or not shape.is_moe:
        return 0
    return shape.experts_per_token * len(targeted_weights(values)) * lora_r * a_b


def skipped_expert_weights(skip_modules: Sequence[str]) -> tuple[str, ...]:
    """The fused expert weights ``quantization.skip_modules`` keeps in 16 bits, by ``quant.experts.skipped``'s rule
    (a name matches its full name, last component or a dotted suffix): ``experts`` / ``mlp.experts`` keeps both,
    ``experts.down_proj`` or ``down_proj`` one. Layer-specific names (``layers.3.mlp.experts``) count for every layer.

    Args:
        skip_modules: ``model.quantization.skip_modules``.
    """
    kept = []
    for weight in EXPERT_WEIGHTS:
        for skip in skip_modules:
            *prefix, last = skip.split(".")
            if last == "experts" or (last == weight and (not prefix or prefix[-1] == "experts")):
                kept.append(weight)
                break
    return tuple(kept)


def nf4_expert_dims(
    shape: ModelShape, quantized: bool, skipped: Sequence[str], block: int
) -> dict[str, tuple[int, int]]:
    """``(in, out)`` per expert of the fused expert weights QLoRA holds in NF4: those whose input width divides into
    ``block``-weight blocks and that ``skipped`` does not keep in 16 bits; none when ``quantized`` is False.

    Args:
        shape: The model.
        quantized: Whether the base is quantised (QLoRA).
        skipped: Expert weights kept 16-bit (:func:`skipped_expert_weights`).
        block: Weights per NF4 block scale (64).
    """
    if not quantized:
        return {}
    dims = expert_dims(shape).items()
    return {name: (i, o) for name, (i, o) in dims if i % block == 0 and name not in skipped}


__all__ = [
    "EXPERTS_SHORTHAND",
    "EXPERT_WEIGHTS",
    "expert_adapter_activation_bytes",
    "expert_adapter_groups",
    "expert_adapter_params",
    "expert_dims",
    "nf4_expert_dims",
    "skipped_expert_weights",
    "target_parameter_problems",
    "targeted_weights",
]
