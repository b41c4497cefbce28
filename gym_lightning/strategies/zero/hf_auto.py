"""DeepSpeed JSON configs in the Hugging Face style: resolve ``"auto"`` and find conflicts (pure functions).

Users bring DeepSpeed files written for the Hugging Face Trainer or LLaMA-Factory (``ds_config_zero3.json``), full
of ``"auto"``. The rules here are those of transformers' ``HfTrainerDeepSpeedConfig``
(``transformers/integrations/deepspeed.py``: ``trainer_config_process`` and ``trainer_config_finalize``), with
the Trainer and what the module/data module state (``gym_lightning.protocols``) in the place of
``TrainingArguments``. :func:`resolve_hf_deepspeed_config` lists the keys and what each ``"auto"`` becomes.

One setting, never two: Lightning's ``accumulate_grad_batches`` and the JSON's ``gradient_accumulation_steps``
are the same thing, and so are ``gradient_clip_val`` and ``gradient_clipping``. An explicit JSON value is adopted
when the Trainer's was left unset (``accumulate_grad_batches`` at its default 1 — Lightning cannot tell an explicit
1 from the default —, ``gradient_clip_val=None``); when both are set they must agree. The accumulation is adopted
before the Trainer is built (``cli.accumulation_from_strategy_config``, called by ``gym fit`` and ``gym train``) because
the step count and the data loader read it; the strategy never changes the Trainer and reports a disagreement. The
clipping is adopted in the resolved config only. The resolved config always holds the single effective value of
both keys. (HF would raise instead; adopting is what a user moving a working HF setup expects.)

Differences from the HF integration: the stage-3 bucket keys are resolved whatever the stage (HF leaves them
``"auto"`` below stage 3, which DeepSpeed then rejects), and an ``"auto"`` on any other key is an error naming it.
All problems are collected into one ``GymUserError`` that lists each conflict with both values and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_lightning.errors import raise_if_problems
from gym_lightning.strategies.zero.config import AUTO, load_deepspeed_json
from gym_lightning.strategies.zero.sizing import stage3_limits
from gym_lightning.vocabulary import DEEPSPEED_SETTINGS  # JSON key -> the setting messages name

# HF's ``trainer_config_finalize`` derives these from the model width: buckets of one hidden x hidden matrix keep
# communication in large messages without holding much more than one layer's worth of memory.
HIDDEN_SIZE_KEYS: tuple[str, ...] = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
# ZeRO-3's gathered-parameter limits, derived from the size of one decoder layer (``sizing.stage3_limits``).
LAYER_SIZE_KEYS: tuple[str, ...] = (
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
)
SCHEDULER_STEP_KEYS: tuple[str, ...] = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


@dataclass(frozen=True)
class TrainingFacts:
    """What the Trainer, the module and the data module say, in the place of HF's ``TrainingArguments``.

    ``None`` means "not known" (or, for the two adoptable settings, "left unset"): an ``"auto"`` that needs it is
    an error, an explicit JSON value is not checked against it.

    Args:
        micro_batch_size: Per-device training micro-batch size.
        accumulate_grad_batches: ``Trainer(accumulate_grad_batches)``; ``None`` when unset (the JSON's number is then
            adopted; the strategy always passes the Trainer's value, which was settled before the Trainer was built).
        world_size: Number of data-parallel processes (devices x nodes).
        gradient_clip_val: ``Trainer(gradient_clip_val)``; ``None`` when unset (0 means no clipping).
        precision: ``Trainer(precision)`` as a string, e.g. ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``.
        lr: Peak learning rate of the module's optimizer.
        betas: Adam betas of the module's optimizer.
        eps: Adam epsilon of the module's optimizer.
        weight_decay: Weight decay of the module's optimizer.
        warmup_steps: Warm-up length in optimizer steps (a ratio already turned into steps).
        total_steps: Total optimizer steps of the run.
        hidden_size: The model's hidden size (for the bucket sizes).
        layer_numel: Elements of the model's largest decoder layer (for ZeRO-3's gathered-parameter limits).
    """

    micro_batch_size: int | None = None
    accumulate_grad_batches: int | None = None
    world_size: int = 1
    gradient_clip_val: float | None = None
    precision: str = "32-true"
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    hidden_size: int | None = None
    layer_numel: int | None = None


def get_value(config: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` (e.g. ``"optimizer.params.lr"``), or ``None`` if any part is missing."""
    node, leaf = _parent(config, key)
    return None if node is None else node.get(leaf)


def is_auto(config: dict[str, Any], key: str) -> bool:
    """Whether dotted ``key`` is ``"auto"`` in ``config``."""
    return get_value(config, key) == AUTO


def needs_total_steps(config: dict[str, Any]) -> bool:
    """Whether resolving or checking ``config`` needs the run's total optimizer steps (costly to compute)."""
    return any(get_value(config, key) is not None for key in SCHEDULER_STEP_KEYS)


def drop_autos(config: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``config`` without those of ``keys`` that are ``"auto"`` (DeepSpeed's defaults apply to them)."""
    config = load_deepspeed_json(config)
    for key in keys:
        node, leaf = _parent(config, key)
        if node is not None and node.get(leaf) == AUTO:
            del node[leaf]
    return config


def precision_flags(precision: str) -> tuple[bool, bool]:
    """``(fp16, bf16)`` as HF's ``--fp16``/``--bf16`` would be for a Lightning precision string."""
    precision = str(precision)
    return precision.startswith("16") or precision == "half", precision.startswith("bf16")


def adopted_value(json_value: Any, trainer_value: Any) -> Any:
    """The single value of an adoptable setting: the Trainer's if set, else an explicit JSON number, else ``None``."""
    if trainer_value is not None:
        return trainer_value
    return json_value if isinstance(json_value, int | float) and not isinstance(json_value, bool) else None


def resolve_hf_deepspeed_config(config: str | Path | dict[str, Any], facts: TrainingFacts) -> dict[str, Any]:
    """Resolve every ``"auto"`` of an HF-style DeepSpeed config and check its explicit values against ``facts``.

    Returns a new dict (the input is not modified) that always holds ``gradient_accumulation_steps`` and
    ``gradient_clipping``. Raises one ``GymUserError`` listing every conflict (both values and the fix), every
    ``"auto"`` that ``facts`` cannot fill, and every ``"auto"`` on a key that is not resolvable at all.

    Settings are named as ``gym fit`` names them (``model.*`` are the module's ``OptimizerFacts``, ``data.batch_size``
    is the data module's ``micro_batch_size``):

    ==============================================  =================================================================
    JSON key                                        ``"auto"`` becomes (an explicit value must equal it)
    ==============================================  =================================================================
    ``train_micro_batch_size_per_gpu``              ``data.batch_size`` (else the training DataLoader's batch size)
    ``gradient_accumulation_steps``                 ``trainer.accumulate_grad_batches`` (module doc: "One setting")
    ``train_batch_size``                            world size x micro-batch x accumulation
    ``gradient_clipping``                           ``trainer.gradient_clip_val`` (module doc: "One setting")
    ``optimizer.params.lr``                         ``model.lr``
    ``optimizer.params.betas`` / ``eps``            ``model.betas`` / ``model.eps``
    ``optimizer.params.weight_decay``               ``model.weight_decay``
    ``scheduler.params.warmup_min_lr``              0 (never checked)
    ``scheduler.params.warmup_max_lr``              ``model.lr``
    ``scheduler.params.warmup_num_steps``           max(1, warm-up steps) (DeepSpeed >= 0.19.6 rejects 0)
    ``scheduler.params.total_num_steps``            the Trainer's estimated optimizer steps
    ``fp16.enabled`` / ``bf16.enabled``             ``trainer.precision`` is ``16-*`` / ``bf16-*``
    ``zero_optimization.reduce_bucket_size``        hidden_size² (never checked)
    ``zero_optimization.stage3_prefetch_bucket_size``       one decoder layer's elements (``model`` states it), else
                                                    HF's 0.9 x hidden_size² (never checked)
    ``zero_optimization.stage3_param_persistence_threshold``  10 x hidden_size (never checked)
    ``zero_optimization.stage3_max_live_parameters``          2 x one decoder layer's elements (never checked)
    ``zero_optimization.stage3_max_reuse_distance``           one decoder layer's elements (never checked)
    ==============================================  =================================================================

    The last two are not resolved by HF (its JSONs write DeepSpeed's default, 1e9, for both). ``sizing.stage3_limits``
    explains the numbers: with 1e9 a model under a billion elements stays gathered from the end of its forward to its
    backward.

    A module without ``optimizer_facts()`` leaves the ``model.*`` rows unknown: ``"auto"`` there is an error naming the
    key, an explicit value is used unchecked.
    """
    resolver = _Resolver(load_deepspeed_json(config))
    accumulation = resolver.fill_adoptable("gradient_accumulation_steps", facts.accumulate_grad_batches, default=1)
    resolver.fill_adoptable("gradient_clipping", facts.gradient_clip_val, default=0.0)
    resolver.fill("train_micro_batch_size_per_gpu", facts.micro_batch_size)
    total_batch = None if facts.micro_batch_size is None else facts.world_size * facts.micro_batch_size * accumulation
    resolver.fill("train_batch_size", total_batch)
    _fill_optimizer_and_scheduler(resolver, facts)
    fp16, bf16 = precision_flags(facts.precision)
    resolver.fill("fp16.enabled", fp16, shown=repr(str(facts.precision)))
    resolver.fill("bf16.enabled", bf16, shown=repr(str(facts.precision)))
    _fill_hidden_size_keys(resolver, facts.hidden_size, facts.layer_numel)
    resolver.raise_if_problems()
    return resolver.config


def adopted_accumulation(config: dict[str, Any], trainer_value: int) -> int:
    """The run's one accumulation count: the Trainer's, or the JSON's explicit one when the Trainer's is the default 1.

    Lightning cannot tell ``accumulate_grad_batches=1`` from the default, so 1 counts as "unset" (see above).
    """
    json_value = config.get("gradient_accumulation_steps")
    value = adopted_value(None if json_value == AUTO else json_value, None if trainer_value == 1 else trainer_value)
    return int(value) if value is not None else 1


# --------------------------------------------------------------------------------------------------- internals
@dataclass
class _Resolver:
    config: dict[str, Any]
    conflicts: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def fill(self, key: str, value: Any, must_match: bool = True, shown: str | None = None) -> None:
        """HF's ``fill_match``: ``"auto"`` becomes ``value``; an explicit value must equal it (if ``must_match``)."""
        node, leaf = _parent(self.config, key)
        if node is None or leaf not in node:
            return
        if node[leaf] == AUTO:
            if value is None:
                self.unknown.append(key)
            else:
                node[leaf] = value
            return
        if must_match and value is not None and _differs(node[leaf], value):
            self.conflicts.append(_conflict(key, node[leaf], value, shown))

    def fill_adoptable(self, key: str, trainer_value: Any, default: Any) -> Any:
        """One setting shared by the Trainer and the JSON (see the module docstring); returns the single value."""
        json_value = self.config.get(key)
        value = adopted_value(None if json_value == AUTO else json_value, trainer_value)
        value = default if value is None else value
        if json_value not in (None, AUTO) and _differs(json_value, value):
            self.conflicts.append(_conflict(key, json_value, value))
        self.config[key] = value
        return value

    def raise_if_problems(self) -> None:
        leftover = [key for key in _auto_keys(self.config) if key not in self.unknown]
        problems = [*self.conflicts]
        problems += [
            f'{key}: "auto" needs a value that is not known here ({_why_unknown(key)}).' for key in self.unknown
        ]
        problems += [
            f'{key}: "auto" is only understood on the keys the Hugging Face Trainer fills; write a value.'
            for key in leftover
        ]
        raise_if_problems("The DeepSpeed config disagrees with the Trainer/module", problems)


def _fill_optimizer_and_scheduler(resolver: _Resolver, facts: TrainingFacts) -> None:
    resolver.fill("optimizer.params.lr", facts.lr)
    resolver.fill("optimizer.params.betas", None if facts.betas is None else [float(b) for b in facts.betas])
    resolver.fill("optimizer.params.eps", facts.eps)
    resolver.fill("optimizer.params.weight_decay", facts.weight_decay)
    resolver.fill("scheduler.params.warmup_min_lr", 0, must_match=False)  # no Trainer setting to compare with
    resolver.fill("scheduler.params.warmup_max_lr", facts.lr)
    resolver.fill("scheduler.params.total_num_steps", facts.total_steps)
    warmup = None if facts.warmup_steps is None else max(1, facts.warmup_steps)
    resolver.fill("scheduler.params.warmup_num_steps", warmup)


def _fill_hidden_size_keys(resolver: _Resolver, hidden: int | None, layer_numel: int | None) -> None:
    reduce_bucket, prefetch, persistence = HIDDEN_SIZE_KEYS
    square = None if hidden is None else hidden * hidden
    resolver.fill(reduce_bucket, square, must_match=False)
    limits = None if layer_numel is None else stage3_limits(layer_numel)
    hf_prefetch = None if square is None else int(0.9 * square)
    resolver.fill(prefetch, hf_prefetch if limits is None else limits["stage3_prefetch_bucket_size"], must_match=False)
    resolver.fill(persistence, None if hidden is None else 10 * hidden, must_match=False)
    for key in LAYER_SIZE_KEYS:
        resolver.fill(key, None if limits is None else limits[key.split(".")[-1]], must_match=False)


def _parent(config: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = key.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _differs(json_value: Any, value: Any) -> bool:
    if isinstance(json_value, list | tuple) and isinstance(value, list | tuple):
        return list(json_value) != list(value)
    return json_value != value


def _auto_keys(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_keys(value, f"{prefix}{key}.")
    elif node == AUTO:
        yield prefix[:-1]


def _conflict(key: str, json_value: Any, value: Any, shown: str | None = None) -> str:
    setting = DEEPSPEED_SETTINGS[key]
    if key in ("fp16.enabled", "bf16.enabled"):
        wanted = ("16-mixed" if key == "fp16.enabled" else "bf16-mixed") if json_value else "32-true"
        return (
            f'{key}={json.dumps(json_value)} in the DeepSpeed config but {setting} is {shown}: write "auto" in the '
            f"JSON, or set {setting} to {wanted}."
        )
    message = (
        f"{key}={json.dumps(json_value)} in the DeepSpeed config but {setting} gives {json.dumps(value)}: "
        f'write "auto" (or {json.dumps(value)}) in the JSON, or change {setting} to {json.dumps(json_value)}.'
    )
    if key == "gradient_accumulation_steps" and value == 1:
        # The Trainer (its step count, the data loader) already uses 1 here: too late to adopt the JSON's number.
        message += (
            " The JSON's number is adopted only before the Trainer is built (gym fit and gym train do it when "
            "trainer.accumulate_grad_batches is left at 1); in Python, pass Trainer(accumulate_grad_batches=...)."
        )
    return message


def _why_unknown(key: str) -> str:
    if key in LAYER_SIZE_KEYS:
        return "the module states no layer_numel (gym_lightning.protocols.ProvidesModelFacts); write an integer"
    if key in HIDDEN_SIZE_KEYS:
        return "the module states no hidden_size (gym_lightning.protocols.ProvidesModelFacts); write an integer"
    setting = DEEPSPEED_SETTINGS.get(key, key)
    if key.startswith(("optimizer.", "scheduler.params.warmup")):
        source = "the LightningModule does not state it (gym_lightning.protocols.ProvidesOptimizerFacts)"
    elif key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        source = (
            "the data module states no micro_batch_size (gym_lightning.protocols.ProvidesMicroBatchSize) "
            "and the training DataLoader has no batch_size"
        )
    else:
        source = "the Trainer cannot tell it (an endless run: set trainer.max_steps)"
    return f"{setting} is not known: {source}; write a number"


__all__ = [
    "HIDDEN_SIZE_KEYS",
    "LAYER_SIZE_KEYS",
    "SCHEDULER_STEP_KEYS",
    "TrainingFacts",
    "adopted_accumulation",
    "adopted_value",
    "drop_autos",
    "get_value",
    "is_auto",
    "needs_total_steps",
    "precision_flags",
    "resolve_hf_deepspeed_config",
]
