"""The planner's step-time prediction for the run that just trained, so every real run checks the model.

``ThroughputCallback`` calls :func:`prediction` at the end of fit with what it measured; this module describes the
live Trainer, strategy and LightningModule as the planner's run description (:func:`run_setup`: a
``planner.spec.RunSpec``, the same one ``gym plan`` builds from flags) and runs ``planner.timing.speed`` on it. The
micro-batch and sequence length are the measured ones, so predicted and measured tokens/s count the same tokens.

Per term: :class:`TermTimer` (a callback; add it beside ``ThroughputCallback``) times each optimizer step's phases
on the device's stream (CUDA events, no synchronisation; the host clock on CPU ranks): waiting for data, forward,
backward, optimizer step. :func:`prediction` then puts each phase's measured share of the step beside the model's
(forward and backward hold the compute and the exposed communication, the optimizer phase the optimizer step,
offload and the reductions after backward, the data phase nothing), so a run says which term was wrong.

Hardware: a CUDA device is looked up in the catalog by its CUDA name; CPU ranks measure their own matmul FLOP/s,
memory bandwidth and gloo collectives (``metrics.calibrate.measure_host``, a collective). Whatever the planner
cannot model gives ``{"unavailable": why}`` instead of a number.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies import Strategy as LightningStrategy
from typing_extensions import override

from gym_lightning.errors import GymUserError
from gym_lightning.metrics import hardware as catalog
from gym_lightning.metrics.calibrate import measure_host
from gym_lightning.models.shapes import LoraTargets, ModelShape, shape_from_config
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.machines import cpu_hardware, machine
from gym_lightning.planner.run_config import JSON_KNOBS
from gym_lightning.planner.spec import STAGES, RunSpec
from gym_lightning.planner.strategies import Strategy, planner_strategy
from gym_lightning.planner.timing import StepTime, speed
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

# peft's default LoRA targets for Llama / Mistral / Qwen2 / Qwen3: the planner's "attention-qv"; any other target
# list is modelled as every linear layer.
QV_TARGETS = frozenset({"q_proj", "v_proj"})
PRECISIONS = ("bf16-mixed", "32-true")
# The leaves a run decides, shown in the report (the rest are the planner's memory defaults).
SETUP_SHOWN = ("gpus_per_node", "nodes", "precision", "micro_batch_size", "seq_length", "accumulate_grad_batches")
SETUP_SHOWN += ("activation_checkpointing", "lora_r", "lora_targets", "optimizer", "quantization", "stage", "kernels")
SETUP_SHOWN += ("sequence_parallel_size", "gradient_compression", "accelerator", "bucket_size", "zero3_leaf_layers")
MODELLED = "gym_ddp, gym_fsdp, ZeROStrategy, or Lightning's SingleDeviceStrategy / DDPStrategy / DeepSpeedStrategy"
PHASES = ("data", "forward", "backward", "optimizer")


class Unavailable(Exception):
    """Why the planner cannot predict this run (the message is shown in the report)."""


def planner_strategy_of(strategy: LightningStrategy) -> Strategy | None:
    """How the planner models the Trainer's ``strategy``; ``None`` for one it does not model (:data:`MODELLED`)."""
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


def _zero_section(strategy: LightningStrategy) -> dict[str, Any]:
    config = getattr(strategy, "config", None) or {}
    return dict(config.get("zero_optimization") or {}) if isinstance(config, Mapping) else {}


def _zero_arguments(strategy: DeepSpeedStrategy) -> dict[str, Any]:
    """``stage`` and ``offload_*`` of a DeepSpeed strategy, read from its config: a user's JSON replaces the
    constructor's arguments (``ZeROStrategy(config=...)``), so the config is what DeepSpeed ran."""
    zero = _zero_section(strategy)
    stage = strategy.stage if isinstance(strategy, ZeROStrategy) else int(zero.get("stage", 0))

    def device(section: str) -> str:
        found = (zero.get(section) or {}).get("device", "none") if isinstance(zero.get(section), dict) else "none"
        return found if found in ("cpu", "nvme") else "none"

    offloads = {"offload_optimizer": device("offload_optimizer"), "offload_parameters": device("offload_param")}
    return {"stage": stage, **offloads}


def _knobs(strategy: LightningStrategy) -> dict[str, Any]:
    """The strategy's knobs the planner reads: a DeepSpeed config's buckets, persistence and sub-group (numbers;
    ``auto`` left to gym's rule) and whether ZeRO-3 gathers decoder layers whole; gym_ddp's PowerSGD rank."""
    knobs: dict[str, Any] = {}
    if isinstance(strategy, DeepSpeedStrategy):
        zero = _zero_section(strategy)
        knobs = {leaf: int(zero[key]) for key, leaf in JSON_KNOBS.items() if isinstance(zero.get(key), (int, float))}
        leaves = isinstance(strategy, ZeROStrategy) and getattr(strategy, "leaf_decoder_layers", True)
        knobs["zero3_leaf_layers"] = bool(leaves) and "leaf_module" not in zero
    knobs["gradient_compression"] = getattr(strategy, "gradient_compression", "none")
    knobs["powersgd_rank"] = int(getattr(strategy, "powersgd_rank", 1))
    return knobs


def run_setup(
    trainer: pl.Trainer, module: pl.LightningModule, samples_per_micro_batch: float, tokens_per_sample: float
) -> RunSpec:
    """The planner's description of the running job.

    Raises :class:`Unavailable` for a precision the planner does not model or counts that measured nothing.

    Args:
        trainer: The Trainer (world size, nodes, precision, accumulation, optimizer, device type).
        module: The LightningModule (activation checkpointing, LoRA, NF4 base, objective, kernels).
        samples_per_micro_batch: Measured samples per rank per micro-batch (may be fractional: variable batches).
        tokens_per_sample: Measured non-padding tokens per sample.
    """
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise Unavailable(f"precision {precision!r} is not modelled by the planner (only {', '.join(PRECISIONS)})")
    if samples_per_micro_batch <= 0 or tokens_per_sample <= 0:
        raise Unavailable("no samples or tokens were counted in the measured steps")
    micro_batch = max(1, round(samples_per_micro_batch))  # keeps the measured tokens per micro-batch
    strategy = trainer.strategy
    lora_r, lora_targets, expert_targets = _lora(module)
    quantization = getattr(module, "quantization", None)
    return RunSpec(
        gpus_per_node=trainer.num_devices,
        nodes=trainer.num_nodes,
        precision=precision,
        micro_batch_size=micro_batch,
        seq_length=max(1, round(samples_per_micro_batch * tokens_per_sample / micro_batch)),
        activation_checkpointing=_activation_checkpointing(module, strategy),
        lora_r=lora_r,
        lora_targets=lora_targets,
        optimizer=_optimizer(trainer),
        accelerator="cpu" if strategy.root_device.type == "cpu" else "gpu",
        quantization="nf4" if quantization is not None and lora_r > 0 else "none",
        lora_target_parameters=expert_targets,
        quantization_skip_modules=tuple(getattr(quantization, "skip_modules", None) or ()),
        sequence_parallel_size=int(getattr(strategy, "sequence_parallel_size", 1)),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        stage=_stage(module),
        kernels=_kernels(module),
        **_knobs(strategy),
    )


run_spec = run_setup


def _stage(module: pl.LightningModule) -> str:
    """The module's objective (``model.objective``) as the planner's stage; ``Unavailable`` for one it lacks."""
    name = getattr(getattr(module, "objective", None), "name", None) or "sft"
    if name not in STAGES:
        raise Unavailable(f"objective {name!r} is not modelled by the planner (stages {', '.join(STAGES)})")
    return name


def _kernels(module: pl.LightningModule) -> str:
    """``liger`` for Liger's fused kernels, ``compiled`` for ``compile`` or torch's fused ops, else ``eager``."""
    fused = getattr(module, "fused_ops", None)
    if fused is not None and getattr(fused, "kernels", None) == "liger":
        return "liger"
    return "compiled" if getattr(module, "compile_args", None) is not None or fused is not None else "eager"


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
    applied), else ``module.lora``; ``(0, "all-linear", ())`` without LoRA. peft's default targets (``None``) are q
    and v; an empty list (the experts alone) is none."""
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


def _optimizer(trainer: pl.Trainer) -> str:
    """The planner's optimizer family of the Trainer's first optimizer (DeepSpeed's wrapper holds the user's)."""
    optimizers = getattr(trainer, "optimizers", None) or []
    if not optimizers:
        return "adamw"
    name = type(getattr(optimizers[0], "optimizer", optimizers[0])).__name__.lower()
    return "sgd" if "sgd" in name else "adafactor" if "adafactor" in name else "adamw"


def run_shape(module: pl.LightningModule) -> ModelShape:
    """The planner's :class:`ModelShape` of the module's Hugging Face model (``module.model.config``)."""
    config = getattr(getattr(module, "model", None), "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise Unavailable("the LightningModule has no Hugging Face `model.config` for the planner to read")
    values = config.to_dict()
    try:
        return shape_from_config(values, str(values.get("_name_or_path") or values.get("model_type") or "model"))
    except GymUserError as err:
        raise Unavailable(str(err)) from err


def run_hardware(trainer: pl.Trainer, precision: str, width: int) -> tuple[Hardware, tuple[str, ...]]:
    """The step-time figures of the job's devices and the assumptions made, ``(hardware, notes)``: the catalog GPU
    of a CUDA device's name (:class:`Unavailable` if the catalog lacks it), or this process's measured CPU figures
    (a collective: every rank calls this at the same point) at the catalogued CPU kernel efficiency."""
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
            notes += ("fp32 matmuls run in TF32 here (float32_matmul_precision); the plan assumes the fp32 peak",)
        return found.hardware, notes
    if device.type != "cpu":
        raise Unavailable(f"the planner models CUDA GPUs and CPU ranks, not {device.type!r} devices")
    host = measure_host(width, torch.bfloat16 if precision == "bf16-mixed" else torch.float32)
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


class TermTimer(pl.Callback):
    """Times each optimizer step's phases (data, forward, backward, optimizer) on the device's stream, for
    :func:`prediction`'s per-term comparison; CUDA events are read once, at the end of fit.

    Args:
        warmup_steps: Optimizer steps left out first (compilation, allocator warm-up).
        window: Optimizer steps kept (the last ones).
    """

    def __init__(self, warmup_steps: int = 1, window: int = 50) -> None:
        self.warmup_steps, self.window = warmup_steps, window
        self._marks: list[tuple[str, Any]] = []
        self._steps: list[list[tuple[str, Any]]] = []

    def _mark(self, trainer: pl.Trainer, phase: str) -> None:
        if trainer.strategy.root_device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((phase, event))
        else:
            self._marks.append((phase, time.perf_counter()))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._mark(trainer, "forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._mark(trainer, "backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "forward")  # until the next micro-batch or the optimizer step: the loop's own work

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._mark(trainer, "optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._mark(trainer, "data")
        if any(phase == "optimizer" for phase, _ in self._marks):  # an optimizer step ended with this micro-batch
            self._steps = [*self._steps, self._marks][-(self.window + self.warmup_steps) :]
            self._marks = [self._marks[-1]]

    def phase_seconds(self) -> dict[str, float] | None:
        """Mean seconds per optimizer step of each phase over the kept steps, ``None`` before any."""
        steps = self._steps[self.warmup_steps :]
        if not steps:
            return None
        if any(not isinstance(stamp, float) for step in steps for _, stamp in step):
            torch.cuda.synchronize()
        totals = dict.fromkeys(PHASES, 0.0)
        for step in steps:
            for (phase, start), (_, end) in itertools.pairwise(step):
                totals[phase] += _seconds(start, end)
        return {phase: value / len(steps) for phase, value in totals.items()}


def _seconds(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1000


def predicted_phases(step: StepTime) -> dict[str, float]:
    """The model's seconds of each :class:`TermTimer` phase: forward and backward hold the compute and what shows
    of the collectives, hooks, contention and the wait for the slowest rank; the optimizer phase the step, the
    offload and the reductions after backward (inside the exposed communication); no data wait."""
    passes = step.compute + step.recompute + step.exposed_communication + step.sequence_parallel
    passes += step.hooks + step.contention + step.dispersion
    return {"data": 0.0, "forward": passes / 3, "backward": 2 * passes / 3, "optimizer": step.optimizer + step.offload}


def term_check(timer: TermTimer | None, step: StepTime) -> dict[str, Any] | None:
    """Each phase's measured and predicted share of the step, and which differs most (``None`` without a timer)."""
    measured = timer.phase_seconds() if timer is not None else None
    if not measured:
        return None
    predicted = predicted_phases(step)
    m_total, p_total = sum(measured.values()) or 1.0, sum(predicted.values()) or 1.0
    shares = {k: {"measured": measured[k] / m_total, "predicted": predicted[k] / p_total} for k in PHASES}
    worst = max(PHASES, key=lambda k: abs(measured[k] - predicted[k]))
    return {"seconds": measured, "predicted_seconds": predicted, "shares": shares, "largest_gap": worst}


def prediction(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    job_counts: Mapping[str, Any] | None,
    steps_per_second: float | None,
    tokens_per_second: float | None,
) -> dict[str, Any]:
    """The planner's step time and tokens/s for this run beside the measured ones, or ``{"unavailable": why}``.

    Keys: ``step_seconds``, ``tokens_per_step`` and ``tokens_per_second`` (the job's), ``device_tokens_per_second``,
    ``terms`` (the step's terms, seconds), ``phases`` (a :class:`TermTimer`'s measured vs predicted shares, when one
    ran), ``hardware``, ``notes``, ``strategy``, ``setup``, ``measured_step_seconds``,
    ``measured_tokens_per_second`` and ``ratio`` = measured / predicted step time. Collective on CPU ranks.

    Args:
        trainer: The Trainer.
        module: The LightningModule.
        job_counts: The measured window's job counters (``steps``, ``samples``, ``tokens``) summed over ranks.
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
    step, measured = predicted.step.total, 1.0 / steps_per_second
    timer = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, TermTimer)), None)
    return {
        "strategy": strategy.trainer_strategy,
        "setup": {key: getattr(setup, key) for key in SETUP_SHOWN},
        "hardware": {
            "name": hardware.name,
            "peak_flops": hardware.peak_flops,
            "compute_efficiency": hardware.compute_efficiency,
            "memory_bandwidth": hardware.memory_bandwidth,
            **{part: vars(getattr(hardware, part)) for part in ("kernels", "network", "host")},
        },
        "notes": list(notes),
        "step_seconds": step,
        "tokens_per_step": predicted.tokens_per_step,
        "tokens_per_second": predicted.tokens_per_step / step,
        "device_tokens_per_second": predicted.tokens_per_second_per_gpu,
        "terms": predicted.step.as_dict(),
        "phases": term_check(timer, predicted.step),
        "measured_step_seconds": measured,
        "measured_tokens_per_second": tokens_per_second,
        "ratio": measured / step,
    }
