"""DeepSpeed JSON configs in the Hugging Face style: resolve ``"auto"`` and find conflicts (pure functions).

Users bring DeepSpeed files written for the Hugging Face Trainer or LLaMA-Factory (``ds_config_zero3.json``), full
of ``"auto"``. The rules here are those of transformers' ``HfTrainerDeepSpeedConfig``
(``transformers/integrations/deepspeed.py``: ``trainer_config_process`` and ``trainer_config_finalize``), with
the Trainer and what the module/data module state (``gym_lightning.strategies.facts``) in the place of
``TrainingArguments``. Settings are named as ``gym fit`` names them (``model.*`` are the module's
``OptimizerFacts``, ``data.batch_size`` is the data module's ``micro_batch_size``):

==============================================  =================================================================
JSON key                                        ``"auto"`` becomes (an explicit value must equal it)
==============================================  =================================================================
``train_micro_batch_size_per_gpu``              ``data.batch_size`` (else the training DataLoader's batch size)
``gradient_accumulation_steps``                 ``trainer.accumulate_grad_batches`` (see "One setting" below)
``train_batch_size``                            world size x micro-batch x accumulation
``gradient_clipping``                           ``trainer.gradient_clip_val`` (see "One setting" below)
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

The last two are not resolved by HF (its JSONs write DeepSpeed's default, 1e9, for both). ``stage3_limits`` explains
the numbers: with 1e9 a model under a billion elements stays gathered from the end of its forward to its backward.

A module without ``optimizer_facts()`` leaves the ``model.*`` rows unknown: ``"auto"`` there is an error naming the
key, an explicit value is used unchecked.

One setting, never two: Lightning's ``accumulate_grad_batches`` and the JSON's ``gradient_accumulation_steps``
are the same thing, and so are ``gradient_clip_val`` and ``gradient_clipping``. An explicit JSON value is adopted
when the Trainer's was left unset (``accumulate_grad_batches`` at its default 1 — Lightning cannot tell an explicit
1 from the default —, ``gradient_clip_val=None``); when both are set they must agree. The accumulation is adopted
before the Trainer is built (``accumulation_from_strategy_config``, called by ``gym fit`` and ``gym train``) because
the step count and the data loader read it; the strategy never changes the Trainer and reports a disagreement. The
clipping is adopted in the resolved config only. The resolved config always holds the single effective value of
both keys. (HF would raise instead; adopting is what a user moving a working HF setup expects.)

Differences from the HF integration: the stage-3 bucket keys are resolved whatever the stage (HF leaves them
``"auto"`` below stage 3, which DeepSpeed then rejects), and an ``"auto"`` on any other key is an error naming it.
All problems are collected into one ``GymUserError`` that lists each conflict with both values and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_lightning.errors import GymUserError, raise_if_problems
from gym_lightning.optim import resolve_warmup_steps
from gym_lightning.strategies.facts import OptimizerFacts

AUTO = "auto"
# HF's ``trainer_config_finalize`` derives these from the model width: buckets of one hidden x hidden matrix keep
# communication in large messages without holding much more than one layer's worth of memory.
HIDDEN_SIZE_KEYS: tuple[str, ...] = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
# ZeRO-3's gathered-parameter limits, derived from the size of one decoder layer (``stage3_limits``).
LAYER_SIZE_KEYS: tuple[str, ...] = (
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
)
SCHEDULER_STEP_KEYS: tuple[str, ...] = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
# ZeRO++ (Wang et al. 2023, https://arxiv.org/abs/2306.10209): quantized weight all-gather (qwZ), hierarchical
# secondary partition (hpZ) and quantized gradient reduce-scatter (qgZ). Stage 3 only.
ZERO_PLUS_PLUS_KEYS: tuple[str, ...] = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")

# The strategy classes whose ``config`` is a DeepSpeed JSON (``gym_lightning.strategies``).
ZERO_STRATEGY_CLASSES: tuple[str, ...] = ("ZeROStrategy", "ZeRO1Strategy", "ZeRO2Strategy", "ZeRO3Strategy")

# JSON key -> the Lightning setting it mirrors, as messages name it (``gym train`` adds its flags to these names).
_SETTINGS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "data.batch_size",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "train_batch_size": "world size (trainer.devices x trainer.num_nodes) x data.batch_size x "
    "trainer.accumulate_grad_batches",
    "gradient_clipping": "trainer.gradient_clip_val",
    "optimizer.params.lr": "model.lr",
    "optimizer.params.betas": "model.betas",
    "optimizer.params.eps": "model.eps",
    "optimizer.params.weight_decay": "model.weight_decay",
    "scheduler.params.warmup_max_lr": "model.lr",
    "scheduler.params.warmup_num_steps": "model.warmup_steps/model.warmup_ratio",
    "scheduler.params.total_num_steps": "the Trainer's optimizer steps (trainer.max_steps, or trainer.max_epochs x "
    "batches / accumulation)",
    "fp16.enabled": "trainer.precision",
    "bf16.enabled": "trainer.precision",
}


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


def load_deepspeed_json(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``config`` as a dict (a path is read as JSON); the caller's dict is never modified."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise GymUserError(f"DeepSpeed config file not found: {path}; pass an existing JSON file or a dict.")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise GymUserError(f"{path}:{err.lineno}: invalid JSON in the DeepSpeed config ({err.msg}).") from None
    if not isinstance(value, dict):
        raise GymUserError(f"{path}: a DeepSpeed config must be a JSON object, got {type(value).__name__}.")
    return value


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


def needs_hidden_size(config: dict[str, Any]) -> bool:
    """Whether resolving ``config`` needs the model's hidden size."""
    return any(is_auto(config, key) for key in HIDDEN_SIZE_KEYS)


def stage3_limits(layer_numel: int) -> dict[str, int]:
    """ZeRO-3's gathered-parameter limits (elements) for a model whose largest decoder layer has ``layer_numel``.

    DeepSpeed gathers a module's parameters when it runs and, after it, frees them unless the module runs again
    within ``stage3_max_reuse_distance`` elements of the recorded trace. Its default, 1e9, keeps every parameter of a
    model under 1e9 elements gathered from its forward use to its backward use: the whole model, fp32, on every rank
    at the forward/backward turn (1 GB for a 246M model; issue 14's measured zero3 step peak). One layer keeps only
    the last layer's, which backward needs first. ``stage3_max_live_parameters`` (default 1e9) caps what prefetching
    may hold: the layer that runs plus the one prefetched (``stage3_prefetch_bucket_size``: one layer ahead). A module
    larger than the limits (the embedding, an untied LM head) is still gathered when it runs, alone.
    """
    return {
        "stage3_prefetch_bucket_size": layer_numel,
        "stage3_max_live_parameters": 2 * layer_numel,
        "stage3_max_reuse_distance": layer_numel,
    }


# Elements per ZeRO bucket when the module states no layer size: Lightning's and DeepSpeed's configs' usual value.
DEFAULT_BUCKET_SIZE = 200_000_000
BUCKET_KEYS: tuple[str, ...] = ("reduce_bucket_size", "allgather_bucket_size")


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


def fill_bucket_sizes(config: dict[str, Any], elements: int) -> dict[str, Any]:
    """``config`` with its ``"auto"`` reduce / all-gather bucket sizes set to ``elements``."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or not any(zero.get(key) == AUTO for key in BUCKET_KEYS):
        return config
    filled = {key: elements for key in BUCKET_KEYS if zero.get(key) == AUTO}
    return {**config, "zero_optimization": {**zero, **filled}}


def layer_sized_sub_group(config: dict[str, Any], layer_numel: int | None) -> dict[str, Any]:
    """``config`` with ZeRO-3's ``sub_group_size`` set to one decoder layer's elements (unless already set).

    ZeRO-3 runs the optimizer step one sub-group of the rank's partition at a time and converts that sub-group's
    gradients to an fp32 copy for it. DeepSpeed's default sub-group, 1e9 elements, is the whole partition of any
    model under 1e9 x N parameters: 4 bytes x Psi / N held at once, 1.8 GiB per rank for a 946M model on 2 ranks
    (benchmarks/scale.py: that run was killed for memory on the shared 24 GiB host; with one layer it trained at
    8.6 GiB per rank, with the allocator fix of ``_common.return_freed_host_memory``). One layer bounds it like the
    stage-3 gathered-parameter limits. Left alone with optimizer offload (its swapping works in sub-groups) or when
    the layer size is unknown."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3 or layer_numel is None:
        return config
    if "sub_group_size" in zero or zero.get("offload_optimizer"):
        return config
    return {**config, "zero_optimization": {**zero, "sub_group_size": layer_numel}}


def drop_autos(config: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``config`` without those of ``keys`` that are ``"auto"`` (DeepSpeed's defaults apply to them)."""
    config = load_deepspeed_json(config)
    for key in keys:
        node, leaf = _parent(config, key)
        if node is not None and node.get(leaf) == AUTO:
            del node[leaf]
    return config


def hidden_size_of(model_config: Any) -> int | None:
    """The model width as HF picks it: ``hidden_size``, else the largest ``hidden_sizes``, else the text config's."""
    for candidate in (model_config, getattr(model_config, "text_config", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None) is not None:
            return int(candidate.hidden_size)
        if getattr(candidate, "hidden_sizes", None):
            return int(max(candidate.hidden_sizes))
    return None


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


def zero_plus_plus_problems(config: dict[str, Any], device_type: str, world_size: int) -> list[str]:
    """Problems of the ZeRO++ keys in ``config`` for a run on ``device_type`` ranks (each with its fix).

    qwZ/qgZ run DeepSpeed's CUDA quantization kernels, which have no CPU build; hpZ keeps a secondary parameter
    partition inside each node so that all-gathers stay on the fast intra-node links, which needs CUDA devices.
    """
    zero = config.get("zero_optimization") or {}
    hpz = zero.get("zero_hpz_partition_size", 1)
    enabled = [key for key in ZERO_PLUS_PLUS_KEYS[:2] if zero.get(key) is True]
    enabled += [f"zero_hpz_partition_size={hpz}"] if hpz not in (None, 1) else []
    if not enabled:
        return []
    names = ", ".join(enabled)
    problems = []
    if zero.get("stage") != 3:
        problems.append(
            f"ZeRO++ ({names}) needs zero_optimization.stage=3, got {zero.get('stage')!r}; use stage 3 or drop them."
        )
    if device_type != "cuda":
        problems.append(
            f"ZeRO++ ({names}) cannot run on {device_type} ranks: it needs CUDA GPUs (DeepSpeed's quantization "
            "kernels and hierarchical partitioning have no CPU implementation). Remove these keys (or set them to "
            "false / 1) for CPU runs; keep them for GPU runs."
        )
    elif not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1 or world_size % hpz:
        problems.append(
            f"zero_hpz_partition_size={hpz!r} must be a whole number >= 1 that divides the world size "
            f"({world_size}); use the number of GPUs per node."
        )
    return problems


# ------------------------------------------------------------------------------------------------------ bridge
def adopted_accumulation(config: dict[str, Any], trainer_value: int) -> int:
    """The run's one accumulation count: the Trainer's, or the JSON's explicit one when the Trainer's is the default 1.

    Lightning cannot tell ``accumulate_grad_batches=1`` from the default, so 1 counts as "unset" (see above).
    """
    json_value = config.get("gradient_accumulation_steps")
    value = adopted_value(None if json_value == AUTO else json_value, None if trainer_value == 1 else trainer_value)
    return int(value) if value is not None else 1


def accumulation_from_strategy_config(strategy: Any, accumulate_grad_batches: int) -> int:
    """``trainer.accumulate_grad_batches`` of a parsed Trainer configuration, with a ZeRO JSON's number adopted.

    ``strategy`` is ``trainer.strategy`` as a config parser holds it: a name (``"zero3"``, no JSON) or
    ``{"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": {"config": path or dict}}`` (a dict or a
    namespace; also ``ZeRO1Strategy``/``ZeRO2Strategy``/``ZeRO3Strategy``). When it holds a JSON with an explicit
    ``gradient_accumulation_steps`` and ``accumulate_grad_batches`` is at its default 1, the JSON's number is
    returned; else ``accumulate_grad_batches``. Call it before the Trainer is built: the data loader and the step
    count read the Trainer's value, and the strategy, which only sees the Trainer afterwards, reports a disagreement.
    """
    config = _zero_strategy_json(strategy)
    return accumulate_grad_batches if config is None else adopted_accumulation(config, accumulate_grad_batches)


def training_facts(
    trainer: Any, optimizer: OptimizerFacts, config: dict[str, Any], micro_batch_size: int | None
) -> TrainingFacts:
    """``TrainingFacts`` from a Lightning Trainer (read, never written) and what the module stated.

    The total step count (it may build the training DataLoader) is only computed when ``config`` needs it. The
    Trainer's accumulation is passed as set, so an explicit JSON number that differs is a conflict.
    """
    total = None
    if needs_total_steps(config):
        estimated = trainer.estimated_stepping_batches
        total = int(estimated) if estimated != float("inf") else None
    betas = optimizer.betas
    return TrainingFacts(
        micro_batch_size=micro_batch_size,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        world_size=trainer.world_size,
        gradient_clip_val=trainer.gradient_clip_val,
        precision=str(trainer.precision),
        lr=optimizer.lr,
        betas=None if betas is None else (float(betas[0]), float(betas[1])),
        eps=optimizer.eps,
        weight_decay=optimizer.weight_decay,
        warmup_steps=_warmup_steps(optimizer, total),
        total_steps=total,
        hidden_size=optimizer.hidden_size,
        layer_numel=optimizer.layer_numel,
    )


def _warmup_steps(optimizer: OptimizerFacts, total: int | None) -> int | None:
    if total is None or (optimizer.warmup_steps is None and optimizer.warmup_ratio is None):
        return None
    return resolve_warmup_steps(optimizer.warmup_steps or 0, optimizer.warmup_ratio or 0.0, total)


def _zero_strategy_json(strategy: Any) -> dict[str, Any] | None:
    """The DeepSpeed JSON of a ZeRO strategy given as ``class_path`` + ``init_args.config``, else ``None``."""
    class_path = _field(strategy, "class_path")
    if not isinstance(class_path, str):
        return None
    module, _, name = class_path.rpartition(".")
    if name not in ZERO_STRATEGY_CLASSES or not (module == "" or module.startswith("gym_lightning.strategies")):
        return None
    config = _field(_field(strategy, "init_args"), "config")
    return None if config is None else load_deepspeed_json(config)


def _field(node: Any, key: str) -> Any:
    # Parsed configs are dicts, or (LightningCLI) jsonargparse namespaces, which are read by attribute.
    if node is None or isinstance(node, str):
        return None
    return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)


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
    setting = _SETTINGS[key]
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
        return "the module states no layer_numel (gym_lightning.strategies.facts.OptimizerFacts); write an integer"
    if key in HIDDEN_SIZE_KEYS:
        return "the module states no hidden_size (gym_lightning.strategies.facts.OptimizerFacts); write an integer"
    setting = _SETTINGS.get(key, key)
    if key.startswith(("optimizer.", "scheduler.params.warmup")):
        source = "the LightningModule does not state it (gym_lightning.strategies.facts.ProvidesOptimizerFacts)"
    elif key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        source = (
            "the data module states no micro_batch_size (gym_lightning.strategies.facts.ProvidesMicroBatchSize) "
            "and the training DataLoader has no batch_size"
        )
    else:
        source = "the Trainer cannot tell it (an endless run: set trainer.max_steps)"
    return f"{setting} is not known: {source}; write a number"


__all__ = [
    "AUTO",
    "HIDDEN_SIZE_KEYS",
    "LAYER_SIZE_KEYS",
    "ZERO_PLUS_PLUS_KEYS",
    "ZERO_STRATEGY_CLASSES",
    "TrainingFacts",
    "accumulation_from_strategy_config",
    "adopted_accumulation",
    "adopted_value",
    "drop_autos",
    "get_value",
    "hidden_size_of",
    "is_auto",
    "load_deepspeed_json",
    "needs_hidden_size",
    "needs_total_steps",
    "precision_flags",
    "resolve_hf_deepspeed_config",
    "stage3_limits",
    "training_facts",
    "zero_plus_plus_problems",
]
