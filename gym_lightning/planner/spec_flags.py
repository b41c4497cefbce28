"""The run description's leaves as ``gym plan`` flags and as values to check (pure): each leaf's flag, default and
choices come from its field in ``planner.spec``, so the parser and the checks never repeat them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import MISSING, fields
from typing import Any, get_args

from gym_lightning.errors import GymUserError
from gym_lightning.planner.spec import (
    LEAVES,
    SECTIONS,
    STAGES,
    Accelerator,
    Attention,
    GradientCompression,
    Kernels,
    LoraTargets,
    LossChunking,
    Optimizer,
    Precision,
    Quantization,
    ReferenceDtype,
    RunSpec,
    StageName,
)


def flag_fields() -> Iterator[tuple[str, Any]]:
    """``(flag name, field)`` of every leaf ``gym plan`` takes as a flag, in section order."""
    for section, kind in SECTIONS.items():
        del section
        for f in fields(kind):
            name = f.metadata.get("flag", "")
            if name is not None and f.metadata.get("help"):
                yield name or f.name, f


def coerce(name: str, value: Any) -> Any:
    """``value`` of the leaf ``name`` as the spec holds it (a size's text as bytes, names as a tuple); a value that
    cannot be read raises :class:`GymUserError` naming the flag."""
    parse = LEAVES[name][1].metadata.get("parse")
    if parse is None or value is None:
        return value
    try:
        return parse(value)
    except GymUserError as err:
        raise GymUserError(f"{name}: {str(err).rstrip('.')}") from None


def field_default(name: str) -> Any:
    """The default of the leaf ``name`` (written once, in its section)."""
    f = LEAVES[name][1]
    return f.default if f.default is not MISSING else None


_LITERALS = {"Precision": Precision, "Optimizer": Optimizer, "Attention": Attention, "Kernels": Kernels}
_LITERALS |= {"Accelerator": Accelerator, "LossChunking": LossChunking, "Quantization": Quantization}
_LITERALS |= {"GradientCompression": GradientCompression, "LoraTargets": LoraTargets, "StageName": StageName}
_LITERALS |= {"ReferenceDtype": ReferenceDtype}


def choices(name: str) -> tuple[Any, ...]:
    """The values a ``Literal`` leaf takes (empty for any other)."""
    literal = _LITERALS.get(str(LEAVES[name][1].type))
    return get_args(literal) if literal is not None else ()


def _int_problem(name: str, value: Any, low: int) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return [f"{name} must be an integer >= {low}, got {value!r}"]
    return []


def spec_problems(spec: RunSpec) -> list[str]:
    """Every setting of ``spec`` that is not a value its leaf takes (the model-dependent checks are the callers')."""
    problems: list[str] = []
    for name, low in (("gpus_per_node", 1), ("nodes", 1), ("micro_batch_size", 1), ("seq_length", 1)):
        problems += _int_problem(name, getattr(spec, name), low)
    for name, low in (("lora_r", 0), ("accumulate_grad_batches", 1), ("loss_chunk_tokens", 1)):
        problems += _int_problem(name, getattr(spec, name), low)
    for name in ("precision", "lora_targets", "optimizer", "attention", "accelerator", "loss_chunking"):
        problems += _choice_problem(name, getattr(spec, name))
    for name in ("quantization", "gradient_compression", "kernels", "stage", "reference_dtype"):
        problems += _choice_problem(name, getattr(spec, name))
    problems += reference_problems(spec)
    for name in ("gpu_memory", "host_memory"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            problems.append(f"{name} must be positive, got {value!r}")
    if spec.quantization == "nf4" and spec.lora_r == 0:
        problems.append("quantization nf4 (QLoRA) freezes a 4-bit base and trains LoRA adapters: set lora_r > 0")
    for name in ("quantization_skip_modules", "lora_target_parameters"):
        if not names_ok(getattr(spec, name)):
            problems.append(f"{name} must be a list of names, got {getattr(spec, name)!r}")
    return problems


def reference_problems(spec: RunSpec) -> list[str]:
    """The reference's settings on a stage that reads no reference (ORPO, SimPO, SFT), or a ``ref_model`` that is
    not a name."""
    if spec.stage not in STAGES or STAGES[spec.stage].reference:
        ref = spec.ref_model
        return [] if ref is None or isinstance(ref, str) else [f"ref_model must be a folder or hub name, got {ref!r}"]
    with_reference = ", ".join(name for name, kind in STAGES.items() if kind.reference)
    given = [name for name in ("precompute_ref_log_probs", "ref_model") if getattr(spec, name) not in (None, False)]
    given += ["reference_dtype"] if spec.reference_dtype != "auto" else []
    return [
        f"{name} applies to the stages with a reference model ({with_reference}); stage {spec.stage} has none: "
        "leave it out"
        for name in given
    ]


def names_ok(value: Any) -> bool:
    """Whether ``value`` is a tuple of names (what a names leaf holds once read)."""
    return isinstance(value, tuple) and all(isinstance(n, str) for n in value)


def _choice_problem(name: str, value: Any) -> list[str]:
    options = choices(name)
    if value not in options:
        return [f"{name} must be one of {', '.join(map(str, options))}, got {value!r}"]
    return []


__all__ = ["choices", "coerce", "field_default", "flag_fields", "names_ok", "reference_problems", "spec_problems"]
