"""How large DeepSpeed's ZeRO buffers are: bucket sizes, ZeRO-3's gathered-parameter limits and optimizer
sub-groups, all derived from the size of one decoder layer (pure functions).

The unit is the model's largest decoder layer (``models.facts.ModelFacts.layer_numel``), the unit FSDP shards and
ZeRO-3 gathers: DeepSpeed's defaults (2e8-element buckets, 1e9-element limits and sub-groups) are sized for models of
billions of parameters and, below that, hold memory that is never used or keep the whole model gathered. These
functions size; ``rule.zero_rule`` puts the sizes together and ``rule.fill_from_rule`` writes them into a config.
"""

from __future__ import annotations

from typing import Any

# Elements per ZeRO bucket when the module states no layer size: Lightning's and DeepSpeed's configs' usual value.
DEFAULT_BUCKET_SIZE = 200_000_000
BUCKET_KEYS: tuple[str, ...] = ("reduce_bucket_size", "allgather_bucket_size")


def stage3_limits(layer_numel: int) -> dict[str, int]:
    """ZeRO-3's gathered-parameter limits (elements) for a model whose largest decoder layer has ``layer_numel``.

    DeepSpeed gathers a module's parameters when it runs and, after it, frees them unless the module runs again
    within ``stage3_max_reuse_distance`` elements of the recorded trace. Its default, 1e9, keeps every parameter of a
    model under 1e9 elements gathered from its forward use to its backward use: the whole model, fp32, on every rank
    at the forward/backward turn (docs/benchmarks-history.md, "ZeRO buffers sized by one layer"). One layer keeps
    only the last layer's, which backward needs first. ``stage3_max_live_parameters`` (default 1e9) caps what
    prefetching may hold: the layer that runs plus the one prefetched (``stage3_prefetch_bucket_size``: one layer
    ahead). A module larger than the limits (the embedding, an untied LM head) is still gathered when it runs, alone.
    """
    return {
        "stage3_prefetch_bucket_size": layer_numel,
        "stage3_max_live_parameters": 2 * layer_numel,
        "stage3_max_reuse_distance": layer_numel,
    }


def derived_bucket_size(layer_numel: int | None) -> int:
    """Elements per ZeRO reduce / all-gather bucket for a model whose largest decoder layer has ``layer_numel``.

    DeepSpeed allocates its reduce bucket(s) at the configured size when it initialises (``torch.empty``; the pages
    become resident when backward first fills them): stage 1 and 3 one bucket, stage 2 two (``overlap_comm``). At
    2e8 elements that is 381 MiB of bf16 per bucket on every rank whatever the model's size (763 MiB under ZeRO-2),
    beside sharded states of 2-3 GiB per rank for a 250M model on 2 ranks. One decoder layer is the
    unit the stage-3 limits already use (:func:`stage3_limits`); a parameter larger than the bucket (the embedding)
    is reduced on its own by DeepSpeed (``extra_large_param_to_reduce`` in stage 1/2, directly in stage 3). The
    Hugging Face integration's ``"auto"`` is smaller still (hidden², one attention matrix)."""
    return DEFAULT_BUCKET_SIZE if layer_numel is None else layer_numel


def optimizer_sub_group(layer_numel: int, offload_optimizer: bool) -> int | None:
    """ZeRO-3's ``sub_group_size``: one decoder layer's elements; ``None`` (DeepSpeed's default) with optimizer
    offload, whose swapping works in DeepSpeed's own sub-groups.

    ZeRO-3 runs the optimizer step one sub-group of the rank's partition at a time and converts that sub-group's
    gradients to an fp32 copy for it. DeepSpeed's default sub-group, 1e9 elements, is the whole partition of any
    model under 1e9 x N parameters: 4 bytes x Psi / N held at once (docs/benchmarks-history.md, "ZeRO buffers sized
    by one layer"). One layer bounds it like the stage-3 gathered-parameter limits."""
    return None if offload_optimizer else layer_numel


def cap_bucket_sizes(config: dict[str, Any], model_numel: int) -> dict[str, Any]:
    """``config`` with its reduce/all-gather bucket sizes capped at the model's element count: the one change to
    the buckets after the build, when that count is known.

    DeepSpeed allocates its reduce bucket up front at the configured size (Lightning's and our default, 2e8
    elements, is 763 MiB of fp32 per rank): for a model smaller than that the excess is never used, only held.
    """
    zero = dict(config.get("zero_optimization", {}))
    cap = max(2, model_numel + model_numel % 2)  # DeepSpeed wants even bucket sizes (its alignment factor is 2)
    for key in BUCKET_KEYS:
        if isinstance(zero.get(key), int | float) and zero[key] > cap:
            zero[key] = cap
    return {**config, "zero_optimization": zero} if zero else config


__all__ = [
    "BUCKET_KEYS",
    "DEFAULT_BUCKET_SIZE",
    "cap_bucket_sizes",
    "derived_bucket_size",
    "optimizer_sub_group",
    "stage3_limits",
]
