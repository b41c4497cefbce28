"""Every ZeRO setting gym_lightning chooses, from the model's shape and the run's world size (one pure function).

:func:`zero_rule` gives the ``zero_optimization`` values, and :func:`fill_from_rule` is the one place that writes
them into a config, before the model is built: only what the user left unset (gym_lightning's own config) or
``"auto"`` (a user's JSON), so the user's values always win (``resolve.run_config``). After the build only
``sizing.cap_bucket_sizes`` changes the buckets, by the model's element count. Which decoder layers become ZeRO-3
leaf modules is decided where they are marked (``leaf.mark_decoder_leaf_modules``).

The unit is one decoder layer (``layer_numel``), the unit FSDP shards: ZeRO-3 gathers one layer and prefetches the
next (``sizing.stage3_limits``), buckets and optimizer sub-groups hold one layer (``sizing.derived_bucket_size``,
``sizing.optimizer_sub_group``). Gathered buffers hold whole tensors, so none of these depends on the world size;
what does is the sharded part (states / N), which DeepSpeed computes itself. Nothing here tests ``world_size == 1``.

Per-rank memory the rule adds at any world size (elements of the 16/32-bit parameter dtype): at most
``2 x layer`` gathered (``stage3_max_live_parameters``) + at most ``layer`` persistent
(``stage3_model_persistence_threshold``; in practice only the vectors: 0.1 M elements for Qwen3-1.7B) + one
``layer``-sized reduce bucket (two under ZeRO-2's ``overlap_comm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gym_lightning.strategies.zero.config import AUTO
from gym_lightning.strategies.zero.sizing import derived_bucket_size, optimizer_sub_group, stage3_limits
from gym_lightning.vocabulary import ZERO3_PERSIST_WIDTHS


@dataclass(frozen=True)
class ZeroShape:
    """What the rule reads, before the model is built; ``None``: not known (the setting then stays DeepSpeed's
    default).

    Args:
        layer_numel: Elements of the largest decoder layer.
        hidden_size: The model width.
        world_size: Ranks ZeRO partitions over.
        stage: ZeRO stage (0-3).
        offload_optimizer: Whether the optimizer is offloaded (its swapping works in DeepSpeed's own sub-groups).
    """

    layer_numel: int | None
    hidden_size: int | None
    world_size: int
    stage: int
    offload_optimizer: bool = False


@dataclass(frozen=True)
class ZeroRule:
    """The rule's answer.

    Args:
        zero: ``zero_optimization`` keys and values (only those the shape decides).
    """

    zero: dict[str, Any]


def zero_rule(shape: ZeroShape) -> ZeroRule:
    """Every ZeRO setting for ``shape`` (see the module docstring for the per-rank memory it implies).

    Args:
        shape: The model's shape and the run's world size, stage and device type.
    """
    if shape.world_size < 1 or shape.stage not in (0, 1, 2, 3):
        raise ValueError(f"world_size must be >= 1 and stage 0-3, got {shape.world_size} and {shape.stage}")
    bucket = derived_bucket_size(shape.layer_numel)
    zero: dict[str, Any] = {
        # Stage 1 under caller-managed accumulation reduces in step(); DeepSpeed overlaps only from stage 2.
        "overlap_comm": shape.stage >= 2,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if shape.stage == 3:
        zero.update(_stage3(shape))
    return ZeroRule(zero=zero)


def _stage3(shape: ZeroShape) -> dict[str, Any]:
    """ZeRO-3's gathered-parameter limits, persistence and optimizer sub-group for ``shape``."""
    settings: dict[str, Any] = {}
    if shape.layer_numel is not None:
        settings.update(stage3_limits(shape.layer_numel))
        if (group := optimizer_sub_group(shape.layer_numel, shape.offload_optimizer)) is not None:
            settings["sub_group_size"] = group
        # The budget of persisted elements per rank: one layer, so that persistence never costs more than one
        # more gathered layer whatever the per-tensor threshold lets through.
        settings["stage3_model_persistence_threshold"] = shape.layer_numel
    if shape.hidden_size is not None:
        settings["stage3_param_persistence_threshold"] = ZERO3_PERSIST_WIDTHS * shape.hidden_size
    return settings


# Keys a user's JSON may leave "auto" that the Hugging Face rules (``hf_auto``) do not know: the rule fills them.
RULE_ONLY_AUTO_KEYS: tuple[str, ...] = ("stage3_model_persistence_threshold",)


def fill_from_rule(config: dict[str, Any], rule: ZeroRule, generated: bool) -> dict[str, Any]:
    """``config`` with the rule's values where the user left them open; a new dict, ``config`` is not modified.

    In gym_lightning's own config (``generated``) every key that is absent or ``"auto"`` is filled; in a user's JSON
    only the ``"auto"`` keys of :data:`RULE_ONLY_AUTO_KEYS` (the rest follow the Hugging Face rules). A value the rule
    cannot give (a fact unknown) stays open: absent means DeepSpeed's default, and an ``"auto"`` is dropped.

    Args:
        config: The DeepSpeed config.
        rule: :func:`zero_rule`'s answer for the run.
        generated: Whether gym_lightning wrote ``config`` (no user JSON).
    """
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return config
    zero = dict(zero)
    keys = list(rule.zero) if generated else list(RULE_ONLY_AUTO_KEYS)
    for key in keys:
        if (generated and key not in zero) or zero.get(key) == AUTO:
            zero[key] = rule.zero.get(key, AUTO)
    for key in RULE_ONLY_AUTO_KEYS:
        if zero.get(key) == AUTO:
            del zero[key]
    return {**config, "zero_optimization": zero}


def persisted_numel(tensor_numels: list[int], param_threshold: int, model_threshold: int) -> int:
    """Elements DeepSpeed keeps whole on every rank: its ``mark_persistent_parameters`` walk over ``tensor_numels``
    in the model's parameter order (a tensor persists when it has at most ``param_threshold`` elements and the total
    stays within ``model_threshold``).

    Args:
        tensor_numels: Each parameter's elements, in ``named_parameters()`` order.
        param_threshold: ``stage3_param_persistence_threshold``.
        model_threshold: ``stage3_model_persistence_threshold``.
    """
    total = 0
    for numel in tensor_numels:
        if numel <= param_threshold and total + numel <= model_threshold:
            total += numel
    return total


__all__ = [
    "RULE_ONLY_AUTO_KEYS",
    "ZeroRule",
    "ZeroShape",
    "fill_from_rule",
    "persisted_numel",
    "zero_rule",
]
