"""The planner's step-time prediction for the run that just trained, so every real run checks the model.

``ThroughputCallback`` calls :func:`prediction` at the end of fit with what it measured; this module turns the live
Trainer, strategy and LightningModule into the planner's ``Setup``, ``Strategy``, ``ModelShape`` and ``Hardware`` and
runs ``planner.timing.speed`` on them. The micro-batch and sequence length are the measured ones (samples and
non-padding tokens per rank and micro-batch), so predicted and measured tokens/s count the same tokens.

Hardware: a CUDA device is looked up in the catalog (``assets/hardware.yaml``) by its CUDA name; CPU ranks measure
their own matmul FLOP/s, memory bandwidth and gloo all-reduce (``metrics.calibrate.measure_host``, a collective:
every rank calls :func:`prediction` at the same point). Whatever the planner cannot model (an unknown GPU, an
architecture ``models.shapes`` cannot read, a strategy of another package, a precision other than ``bf16-mixed`` or
``32-true``) gives ``{"unavailable": why}`` instead of a number.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies import Strategy as LightningStrategy

from gym_lightning.errors import GymUserError
from gym_lightning.metrics import hardware as catalog
from gym_lightning.metrics.calibrate import measure_host
from gym_lightning.models.shapes import LoraTargets, ModelShape, shape_from_config
from gym_lightning.planner.estimate import Optimizer, Setup, Strategy, planner_strategy
from gym_lightning.planner.experts import skipped_expert_weights
from gym_lightning.planner.machines import cpu_hardware, machine
from gym_lightning.planner.timing import Hardware, speed
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

# peft's default LoRA targets for Llama / Mistral / Qwen2 / Qwen3 (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_
# MAPPING``): the planner's "attention-qv"; any other target list is modelled as every linear layer.
QV_TARGETS = frozenset({"q_proj", "v_proj"})
PRECISIONS = ("bf16-mixed", "32-true")
# The Setup fields a run decides (the rest are the planner's memory defaults, which the step time does not read).
SETUP_SHOWN = (
    "gpus_per_node",
    "nodes",
    "precision",
    "micro_batch_size",
    "seq_length",
    "accumulate_grad_batches",
    "activation_checkpointing",
    "lora_r",
    "lora_targets",
    "optimizer",
    "quantization",
    "sequence_parallel_size",
    "gradient_compression",
    "accelerator",
)
MODELLED = "gym_ddp, gym_fsdp, ZeROStrategy, or Lightning's SingleDeviceStrategy / DDPStrategy / DeepSpeedStrategy"


class Unavailable(Exception):
    """Why the planner cannot predict this run (the message is shown in the report)."""


def planner_strategy_of(strategy: LightningStrategy) -> Strategy | None:
    """How the planner models the Trainer's ``strategy``; ``None`` for one it does not model (:data:`MODELLED` lists
    those it does).

    Args:
        strategy: ``trainer.strategy``.
    """
    if isinstance(strategy, DeepSpeedStrategy):  # ZeROStrategy and Lightning's own: both hold the run's config
        return planner_strategy("run", "ZeRO", "zero", _zero_arguments(strategy))
    if isinstance(strategy, GymFSDPStrategy):
        arguments = {"sharding": strategy.sharding, "cpu_offload": strategy.cpu_offload}
        return planner_strategy("run", "FSDP", "fsdp", arguments)
    if isinstance(strategy, GymDDPStrategy):
        return planner_strategy("run", "DDP", "ddp", {"gradient_compression": strategy.gradient_compression})
    if isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):  # Lightning's: replicated, fp32 all-reduce
        return planner_strategy("run", "DDP", "ddp", {}, name=type(strategy).__name__)
    return None


def _zero_arguments(strategy: DeepSpeedStrategy) -> dict[str, Any]:
    """``stage`` and ``offload_*`` of a DeepSpeed strategy, read from its config: a user's JSON replaces the
    constructor's arguments (``ZeROStrategy(config=...)``), so the config is what DeepSpeed ran."""
    zero = (strategy.config or {}).get("zero_optimization") or {}
    stage = strategy.stage if isinstance(strategy, ZeROStrategy) else int(zero.get("stage", 0))

    def device(section: str) -> str:
        found = (zero.get(section) or {}).get("device", "none") if isinstance(zero.get(section), dict) else "none"
        return found if found in ("cpu", "nvme") else "none"

    offloads = {"offload_optimizer": device("offload_optimizer"), "offload_parameters": device("offload_param")}
    return {"stage": stage, **offloads}


def run_setup(
    trainer: pl.Trainer, module: pl.LightningModule, samples_per_micro_batch: float, tokens_per_sample: float
) -> Setup:
    """The planner's :class:`Setup` of the running job.

    Raises :class:`Unavailable` for a precision the planner does not model or counts that measured nothing.

    Args:
        trainer: The Trainer (world size, nodes, precision, accumulation, optimizer, device type).
        module: The LightningModule (activation checkpointing, LoRA, NF4 base).
        samples_per_micro_batch: Measured samples per rank per micro-batch (may be fractional: variable batches).
        tokens_per_sample: Measured non-padding tokens per sample.
    """
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise Unavailable(f"precision {precision!r} is not modelled by the planner (only {', '.join(PRECISIONS)})")
    if samples_per_micro_batch <= 0 or tokens_per_sample <= 0:
        raise Unavailable("no samples or tokens were counted in the measured steps")
    # An integer micro-batch that keeps the measured tokens per micro-batch (variable batch sizes average out).
    micro_batch = max(1, round(samples_per_micro_batch))
    strategy = trainer.strategy
    lora_r, lora_targets, expert_targets = _lora(module)
    quantization = getattr(module, "quantization", None)
    return Setup(
        gpus_per_node=trainer.num_devices,
        nodes=trainer.num_nodes,
        precision=precision,  # type: ignore[arg-type]  # checked against PRECISIONS above
        micro_batch_size=micro_batch,
        seq_length=max(1, round(samples_per_micro_batch * tokens_per_sample / micro_batch)),
        activation_checkpointing=_activation_checkpointing(module, strategy),
        lora_r=lora_r,
        lora_targets=lora_targets,
        optimizer=_optimizer(trainer),
        accelerator="cpu" if strategy.root_device.type == "cpu" else "gpu",
        quantization="nf4" if quantization is not None and lora_r > 0 else "none",
        lora_target_parameters=expert_targets,
        skip_expert_weights=skipped_expert_weights(getattr(quantization, "skip_modules", None) or ()),
        sequence_parallel_size=int(getattr(strategy, "sequence_parallel_size", 1)),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_compression=getattr(strategy, "gradient_compression", "none"),
        powersgd_rank=int(getattr(strategy, "powersgd_rank", 1)),
    )


def _activation_checkpointing(module: pl.LightningModule, strategy: LightningStrategy) -> bool:
    """CausalLMModule's ``gradient_checkpointing``, gym_fsdp's ``activation_checkpointing``, or a Hugging Face model
    that checkpoints (``is_gradient_checkpointing``, also through a peft wrapper)."""
    hparams = getattr(module, "hparams", {}) or {}
    if hparams.get("gradient_checkpointing") or getattr(strategy, "activation_checkpointing", False):
        return True
    model = getattr(module, "model", None)
    # transformers 5 renamed the property (the old name warns, removal in v6); 4.x has only the old one.
    found = getattr(model, "is_activation_checkpointing", None)
    return bool(found if found is not None else getattr(model, "is_gradient_checkpointing", False))


def _lora(module: pl.LightningModule) -> tuple[int, LoraTargets, tuple[str, ...]]:
    """``(r, linear targets, expert weight targets)`` of the module's LoRA: the peft wrapper's config (what was
    applied), else ``module.lora`` (``LoRAArgs``); ``(0, "all-linear", ())`` without LoRA. peft's default targets
    (``None``) are q and v; an empty list (the experts alone, ``lora.resolved_targets``) is none."""
    model = getattr(module, "model", None)
    configs = getattr(model, "peft_config", None)
    config: Any = next(iter(configs.values()), None) if isinstance(configs, Mapping) else getattr(module, "lora", None)
    r = getattr(config, "r", 0)
    if not isinstance(r, int) or r <= 0:
        return 0, "all-linear", ()
    # The routed experts' weights (the planner does not model shared experts: their ``*.weight`` targets are left out)
    parameters = tuple(sorted(p for p in getattr(config, "target_parameters", None) or () if not p.endswith(".weight")))
    targets = getattr(config, "target_modules", None)
    if targets is not None and not isinstance(targets, str) and not targets:
        return r, "none", parameters
    names = {targets} if isinstance(targets, str) else set(targets or QV_TARGETS)
    return r, "attention-qv" if names <= QV_TARGETS else "all-linear", parameters


def _optimizer(trainer: pl.Trainer) -> Optimizer:
    """The planner's optimizer family of the Trainer's first optimizer (DeepSpeed's wrapper holds the user's)."""
    optimizers = getattr(trainer, "optimizers", None) or []
    if not optimizers:
        return "adamw"
    inner = getattr(optimizers[0], "optimizer", optimizers[0])
    name = type(inner).__name__.lower()
    return "sgd" if "sgd" in name else "adafactor" if "adafactor" in name else "adamw"


def run_shape(module: pl.LightningModule) -> ModelShape:
    """The planner's :class:`ModelShape` of the module's Hugging Face model (``module.model.config``).

    Args:
        module: The LightningModule.
    """
    model = getattr(module, "model", None)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise Unavailable("the LightningModule has no Hugging Face `model.config` for the planner to read")
    values = config.to_dict()
    try:
        return shape_from_config(values, str(values.get("_name_or_path") or values.get("model_type") or "model"))
    except GymUserError as err:
        raise Unavailable(str(err)) from err


def run_hardware(trainer: pl.Trainer, precision: str, width: int) -> tuple[Hardware, tuple[str, ...]]:
    """The step-time figures of the job's devices and the assumptions made, ``(hardware, notes)``.

    CUDA: the catalog GPU of the device's CUDA name (:class:`Unavailable` if the catalog lacks it). CPU: this
    process's measured figures (``measure_host``: a collective, every rank must call this at the same point) at the
    catalogued CPU compute efficiency.

    Args:
        trainer: The Trainer (device, nodes).
        precision: ``"bf16-mixed"`` or ``"32-true"``.
        width: The model's hidden size (the matmul benchmark's width on CPU).
    """
    device = trainer.strategy.root_device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        chip = catalog.gpu_for_device_name(name)
        if chip is None:
            raise Unavailable(
                f"GPU {name!r} is not in the hardware catalog (gym_lightning/assets/hardware.yaml); add it there "
                "to get a prediction"
            )
        found = machine(precision, trainer.num_nodes, chip.key)
        notes = found.notes
        if precision == "32-true" and torch.get_float32_matmul_precision() != "highest":
            # The matmuls then run in TF32 (7x the fp32 peak on an H100), which the planner's fp32 peak ignores.
            notes += ("fp32 matmuls run in TF32 here (float32_matmul_precision); the plan assumes the fp32 peak",)
        return found.hardware, notes
    if device.type != "cpu":
        raise Unavailable(f"the planner models CUDA GPUs and CPU ranks, not {device.type!r} devices")
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    host = measure_host(width, dtype)
    hardware = cpu_hardware(
        host.matmul_flops,
        host.memory_bandwidth,
        host.bus_bandwidth,
        host.latency,
        catalog.HOST.cpu_compute_efficiency,
        host.gather_bus_bandwidth,
        host.scatter_bus_bandwidth,
    )
    return hardware, ("CPU figures measured on this host at the end of fit",)


def prediction(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    job_counts: Mapping[str, Any] | None,
    steps_per_second: float | None,
    tokens_per_second: float | None,
) -> dict[str, Any]:
    """The planner's step time and tokens/s for this run beside the measured ones, or ``{"unavailable": why}``.

    Keys: ``step_seconds`` (one optimizer step), ``tokens_per_step`` and ``tokens_per_second`` (the job's),
    ``device_tokens_per_second``, ``terms`` (the step's terms, seconds), ``hardware`` (the figures used), ``notes``,
    ``strategy``, ``setup``, ``measured_step_seconds``, ``measured_tokens_per_second`` and ``ratio`` = measured /
    predicted step time (above 1: the run was slower than the plan). Collective on CPU ranks (see
    :func:`run_hardware`): every rank calls it; every branch depends only on job-wide facts, so all take the same.

    Args:
        trainer: The Trainer.
        module: The LightningModule.
        job_counts: The measured window's job counters (``Counters`` as a dict: ``steps``, ``samples``,
            ``tokens``), summed over ranks; ``None`` when nothing was measured.
        steps_per_second: Measured optimizer steps per second over the window.
        tokens_per_second: Measured job tokens per second over the window.
    """
    try:
        return _predict(trainer, module, job_counts, steps_per_second, tokens_per_second)
    except (Unavailable, GymUserError) as err:  # the planner's own refusals: same on every rank (bugs keep raising)
        return {"unavailable": str(err)}


def _predict(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    job_counts: Mapping[str, Any] | None,
    steps_per_second: float | None,
    tokens_per_second: float | None,
) -> dict[str, Any]:
    if not job_counts or not job_counts.get("steps") or not steps_per_second:
        raise Unavailable("the run was too short to measure (no optimizer step after the warm-up)")
    strategy = planner_strategy_of(trainer.strategy)
    if strategy is None:
        raise Unavailable(f"strategy {type(trainer.strategy).__name__} is not modelled by the planner ({MODELLED})")
    shape = run_shape(module)
    micro_batches = job_counts["steps"] * trainer.accumulate_grad_batches * trainer.world_size
    samples = job_counts["samples"]
    setup = run_setup(trainer, module, samples / micro_batches, job_counts["tokens"] / max(samples, 1))
    hardware, notes = run_hardware(trainer, setup.precision, shape.hidden_size)
    predicted = speed(shape, strategy, setup, hardware)
    step = predicted.step.total
    measured = 1.0 / steps_per_second
    return {
        "strategy": strategy.trainer_strategy,
        "setup": {key: getattr(setup, key) for key in SETUP_SHOWN},
        "hardware": asdict(hardware),
        "notes": list(notes),
        "step_seconds": step,
        "tokens_per_step": predicted.tokens_per_step,
        "tokens_per_second": predicted.tokens_per_step / step,
        "device_tokens_per_second": predicted.tokens_per_second_per_gpu,
        "terms": predicted.step.as_dict(),
        "measured_step_seconds": measured,
        "measured_tokens_per_second": tokens_per_second,
        "ratio": measured / step,
    }
