"""The DeepSpeed config of a ZeRO run, from what the user wrote and what the run states (pure functions).

Three moments of ``strategies.zero.strategy``:

- Construction: :func:`checked_stage`, :func:`alst_sequence_parallel_size`, the base config (the user's JSON, or
  ``config.zero_config`` for the arguments, through ``config.apply_gym_defaults``) and :func:`remote_device`. The
  base config is what ``setup_environment`` (ops, ZeRO++ checks) and ``needs_total_steps`` read.
- Once per run, before the model is built (under ZeRO-3 it is built inside ``zero.Init``, which reads the config):
  :func:`run_config` fills every ``"auto"`` from the ``hf_auto.TrainingFacts`` (:func:`training_facts`, the one
  function here that reads objects: what the Trainer and the module state; bucket sizes, ZeRO-3's limits and
  optimizer sub-group from the layer size, ``rule.fill_from_rule``; Hugging Face's rules for the rest) and checks
  the explicit values against them.
- After the build: only ``sizing.cap_bucket_sizes``, by the model's element count. Neither the Trainer nor the
  module states that count before ``configure_model`` has run (``ModelFacts`` holds one layer's size, and a LoRA
  adapter or a head changes the total), so it cannot be one of the facts :func:`run_config` reads.

:func:`inference_config` is the config of an engine that only evaluates (validate, test, predict).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gym_lightning.models.facts import ModelFacts
from gym_lightning.optim import resolve_warmup_steps
from gym_lightning.protocols import OptimizerFacts
from gym_lightning.strategies._common import raise_strategy_problems
from gym_lightning.strategies.parallel_dims import size_problems
from gym_lightning.strategies.zero.config import STAGE3_DERIVED_KEYS, zero_problems
from gym_lightning.strategies.zero.hf_auto import (
    TrainingFacts,
    drop_autos,
    needs_total_steps,
    resolve_hf_deepspeed_config,
)
from gym_lightning.strategies.zero.rule import ZeroShape, fill_from_rule, zero_rule

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def checked_stage(
    owner: str,
    fixed_stage: int | None,
    stage: int | None,
    user_config: dict[str, Any] | None,
    offload_optimizer: str,
    offload_parameters: str,
    nvme_path: str | None,
    cpu_optimizer: str,
) -> int:
    """The run's ZeRO stage; every problem of the arguments in one error.

    Args:
        owner: The strategy class's name (errors name it).
        fixed_stage: The stage a stage-fixing subclass (``ZeRO1Strategy``, ...) sets, else ``None``.
        stage: The ``stage`` argument (``None``: the fixed stage, else the config's, else 2).
        user_config: The user's DeepSpeed config, ``None`` when gym_lightning writes it.
        offload_optimizer: The ``offload_optimizer`` argument.
        offload_parameters: The ``offload_parameters`` argument.
        nvme_path: The ``nvme_path`` argument.
        cpu_optimizer: The ``cpu_optimizer`` argument.
    """
    problems = []
    if fixed_stage is not None and stage not in (None, fixed_stage):
        problems.append(f"stage={stage} disagrees with {owner} (stage {fixed_stage}); use ZeROStrategy(stage=...).")
    stage = fixed_stage if stage is None else stage
    config_stage = ((user_config or {}).get("zero_optimization") or {}).get("stage")
    resolved = stage if stage is not None else (config_stage if config_stage is not None else 2)
    has_config = user_config is not None
    args = (offload_optimizer, offload_parameters, nvme_path, cpu_optimizer, config_stage, has_config)
    raise_strategy_problems(owner, problems + zero_problems(resolved, *args))
    return resolved


def alst_sequence_parallel_size(argument: int, user_config: dict[str, Any] | None) -> tuple[int, dict[str, Any] | None]:
    """The run's sequence-parallel size and ``user_config`` without its ``"sequence_parallel_size"``.

    An ALST JSON carries the size there; it is taken out because DeepSpeed would divide its data-parallel world by
    it, and here ZeRO spans all ranks (``strategies.sequence``).

    Args:
        argument: The strategy's ``sequence_parallel_size`` argument (1: off, or take the JSON's).
        user_config: The user's DeepSpeed config, ``None`` when gym_lightning writes it; not modified.
    """
    problems = size_problems(argument)
    in_json = None if user_config is None else user_config.get("sequence_parallel_size")
    if in_json is not None:
        problems += size_problems(in_json)
        if argument not in (1, in_json):
            problems.append(
                f"sequence_parallel_size={argument} disagrees with the DeepSpeed config's {in_json}; drop one of them."
            )
    raise_strategy_problems("ZeROStrategy", problems)
    if user_config is not None and "sequence_parallel_size" in user_config:
        user_config = {key: value for key, value in user_config.items() if key != "sequence_parallel_size"}
    return (in_json if in_json is not None and argument == 1 else argument), user_config


def remote_device(config: dict[str, Any], offload_parameters: str) -> str | None:
    """Where ``zero.Init`` places parameters (``"cpu"``, ``"nvme"``), from ``config``'s ``offload_param``.

    Args:
        config: The base config.
        offload_parameters: The ``offload_parameters`` argument (used when the config has no device).
    """
    zero_section = config.get("zero_optimization") or {}
    offload_param = (zero_section.get("offload_param") or {}).get("device", offload_parameters)
    return offload_param if offload_param in ("cpu", "nvme") else None


def warmup_steps(optimizer: OptimizerFacts, total: int | None) -> int | None:
    """The module's warm-up in optimizer steps (a ratio of ``total`` turned into steps); ``None`` when unknown.

    Args:
        optimizer: What the module states of its optimizer.
        total: The run's total optimizer steps, ``None`` when unknown.
    """
    if total is None or (optimizer.warmup_steps is None and optimizer.warmup_ratio is None):
        return None
    return resolve_warmup_steps(optimizer.warmup_steps or 0, optimizer.warmup_ratio or 0.0, total)


def run_config(config: dict[str, Any], facts: TrainingFacts, generated: bool) -> dict[str, Any]:
    """The DeepSpeed config of the run: the base ``config`` with every ``"auto"`` filled from ``facts``
    and its explicit values checked against them (one ``GymUserError`` lists every problem); a new dict.

    The values nobody set come from ``rule.zero_rule``, written by ``rule.fill_from_rule`` alone. In gym_lightning's
    own config the buckets are one decoder layer (2e8 elements when the module states no layer size,
    ``sizing.derived_bucket_size``), ZeRO-3's optimizer sub-group too unless the optimizer is offloaded
    (``sizing.optimizer_sub_group``), and ZeRO-3's limits nobody states fall back to DeepSpeed's defaults; a user's
    JSON follows the Hugging Face rules (``hf_auto``). No bucket ``"auto"`` survives: ``hf_auto`` fills or refuses
    the user's.

    Args:
        config: The base config.
        facts: What the Trainer, the module and the data module state.
        generated: Whether gym_lightning wrote ``config`` (no user JSON).
    """
    if generated and facts.layer_numel is None:
        config = drop_autos(config, tuple(f"zero_optimization.{key}" for key in STAGE3_DERIVED_KEYS))
    config = fill_from_rule(config, zero_rule(_shape(config, facts)), generated)
    config = resolve_hf_deepspeed_config(config, facts)
    # DeepSpeed needs a micro-batch (it only logs throughput with it here); 1 when unknown, as Lightning's.
    config.setdefault("train_micro_batch_size_per_gpu", facts.micro_batch_size or 1)
    return config


def _shape(config: dict[str, Any], facts: TrainingFacts) -> ZeroShape:
    """The rule's view of the run before the model is built (its element count is not known yet)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    return ZeroShape(
        layer_numel=facts.layer_numel,
        hidden_size=facts.hidden_size,
        world_size=facts.world_size,
        stage=stage if stage in (0, 1, 2, 3) else 0,
        offload_optimizer=bool(zero.get("offload_optimizer")),
    )


def inference_config(config: dict[str, Any], zero_stage_3: bool) -> dict[str, Any]:
    """The config of an engine that only evaluates: ``config``'s precision and, under ZeRO-3, its partitioning.

    Args:
        config: The run's config.
        zero_stage_3: Whether the run partitions parameters (stages 1-2 evaluate the whole model on each rank).
    """
    inference: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    for key in ("fp16", "bf16"):
        if key in config:
            inference[key] = config[key]
    if zero_stage_3:
        inference["zero_optimization"] = config["zero_optimization"]
        inference["zero_allow_untested_optimizer"] = True
    return inference


def training_facts(
    trainer: Trainer, optimizer: OptimizerFacts, model: ModelFacts, config: dict[str, Any], micro_batch_size: int | None
) -> TrainingFacts:
    """``TrainingFacts`` from a Lightning Trainer (read, never written) and what the module stated.

    The total step count (it may build the training DataLoader) is only computed when ``config`` needs it. The
    Trainer's accumulation is passed as set, so an explicit JSON number that differs is a conflict. The config's
    values come from these facts in one call, ``resolve.run_config``.
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
        warmup_steps=warmup_steps(optimizer, total),
        total_steps=total,
        hidden_size=model.hidden_size,
        layer_numel=model.layer_numel,
    )


__all__ = [
    "alst_sequence_parallel_size",
    "checked_stage",
    "inference_config",
    "remote_device",
    "run_config",
    "training_facts",
    "warmup_steps",
]
