"""``plan(...)``: the planner as a Python function, returning a :class:`PlanReport` (``.table()``, ``.to_dict()``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.budget import Budget, aligned, fastest, ranking, speed_dict, speed_lines
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.estimate import (
    STRATEGIES,
    STRATEGY_BY_KEY,
    Accelerator,
    Attention,
    Estimate,
    GradientCompression,
    LoraTargets,
    LossChunking,
    Optimizer,
    Precision,
    Quantization,
    Setup,
    Strategy,
    _is_int,
    estimate,
    estimate_all,
    local_tokens,
    mlp_tiles,
    param_counts,
    planner_strategy,
    quantized_base,
    sequence_parallel_problems,
)
from gym_lightning.planner.experts import skipped_expert_weights, target_parameter_problems, targeted_weights
from gym_lightning.planner.long_sequence import SEQUENCE_GRID, longest_sequence, sequence_step
from gym_lightning.planner.machines import Figures, Machine, machine
from gym_lightning.planner.phases import PHASES, PhasePeaks, phase_peaks
from gym_lightning.planner.timing import Hardware, Speed, speed
from gym_lightning.vocabulary import STRATEGY_NAMES, STRATEGY_PRESET_BY_NAME

GiB = 1024**3
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "MIB": 1024**2,
    "G": GiB,
    "GB": GiB,
    "GIB": GiB,
    "T": 1024**4,
    "TB": 1024**4,
    "TIB": 1024**4,
}


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` -> bytes. Sizes are binary: ``GB`` and ``GiB`` both mean 2**30 bytes, because the cards sold as
    "80GB" / "24GB" hold 80 / 24 GiB (81920 / 24576 MiB; the driver reports slightly less)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match.group(2).upper() not in _UNITS:
        raise GymUserError(f"Cannot read memory size {text!r}; expected a number with a unit, e.g. '80GB', '512GiB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class PlanReport:
    """What :func:`plan` found: one :class:`Estimate` per strategy (fastest first) and the recommendation."""

    shape: ModelShape
    setup: Setup
    estimates: list[Estimate]
    show_longest_sequence: bool = False  # table(): add the "longest seq" column (to_dict() always has it)
    selected: str | None = None  # the key of the run's own strategy (plan(strategy=...)): a line of its own
    machine: Machine | None = None  # the hardware the step time is predicted on (None: no speed predictions)
    budget: Budget = field(
        default_factory=Budget
    )  # tokens to train and the price of a GPU-hour (time and cost columns)

    @property
    def recommendation(self) -> Estimate | None:
        """The fastest strategy that fits (predicted tokens/s; the list's order without a machine)."""
        return fastest(self.estimates, self.speeds())

    def speeds(self) -> list[Speed | None]:
        """The step-time model's prediction for each strategy, in ``estimates`` order (None where not modelled)."""
        return list(self._speeds)

    @functools.cached_property
    def _speeds(self) -> tuple[Speed | None, ...]:
        # Computed once: the recommendation, ranking, table and JSON all read them (a frozen report never changes).
        if self.machine is None:
            return (None,) * len(self.estimates)
        hw = self.machine.hardware
        return tuple(speed(self.shape, e.strategy, self.setup, hw) if e.modelled else None for e in self.estimates)

    def ranking(self) -> list[str]:
        """The keys of the strategies that fit, fastest first."""
        return [self.estimates[i].strategy.key for i in ranking(self.estimates, self.speeds())]

    def longest_sequences(self) -> list[int]:
        """The longest sequence that fits the GPUs at micro-batch 1 with each strategy, in ``estimates`` order
        (``long_sequence.longest_sequence``: tokens, a multiple of 1,024 and of sp; 0 when none fits)."""
        return [longest_sequence(self.shape, e.strategy, self.setup) for e in self.estimates]

    def phases(self) -> list[PhasePeaks]:
        """The peak per rank of each phase (load, step, save, export), one per strategy, in ``estimates`` order."""
        return [phase_peaks(self.shape, e.strategy, self.setup) for e in self.estimates]

    def to_dict(self) -> dict[str, Any]:
        counts = param_counts(self.shape, self.setup)
        best = self.recommendation
        return {
            "model": asdict(self.shape),
            "parameters": {
                "total": counts.total_with_adapters,
                "trainable": counts.trainable,
                "active": self.shape.active_params(),  # base parameters one token uses: all of a dense model
                "nf4": quantized_base(self.shape, self.setup).weights,  # base weights stored in 4 bits (QLoRA)
            },
            "setup": asdict(self.setup),
            "usable_gpu_memory": self.setup.usable_gpu_memory,
            "data_parallel_size": self.setup.data_parallel_size,  # N / sp groups, each training its own sequences
            "tokens_per_rank": local_tokens(self.setup, self.setup.micro_batch_size),
            "longest_sequence_step": sequence_step(self.setup),
            "hardware": None if self.machine is None else _machine_dict(self.machine),
            "strategies": [
                {**_estimate_dict(e), "longest_sequence": n, "phases": _phases_dict(p), "speed": v}
                for e, n, p, v in zip(
                    self.estimates, self.longest_sequences(), self.phases(), self._speed_dicts(), strict=True
                )
            ],
            "ranking": self.ranking(),
            "recommendation": None if best is None else best.strategy.key,
            "selected": self.selected,
        }

    def _speed_dicts(self) -> list[dict[str, Any] | None]:
        ranks = {key: place + 1 for place, key in enumerate(self.ranking())}
        gpus = self.setup.world_size
        return [
            speed_dict(v, gpus, self.budget, ranks.get(e.strategy.key))
            for e, v in zip(self.estimates, self.speeds(), strict=True)
        ]

    def _active(self) -> str:
        """`` (3.35B active, 8 of 128 experts per token)`` for a mixture of experts, else nothing."""
        shape = self.shape
        if not shape.is_moe:
            return ""
        experts = f"{shape.experts_per_token} of {shape.num_experts} experts per token"
        return f" ({shape.active_params() / 1e9:.2f}B active, {experts})"

    def _mode(self) -> str:
        """``full finetune``, ``LoRA r=16 (all-linear + experts gate_up_proj, down_proj)`` or the QLoRA line with
        the base weights in NF4 (and how many of them are experts)."""
        s = self.setup
        if s.lora_r == 0:
            return "full finetune"
        experts = targeted_weights(s.lora_target_parameters)
        targets = [] if s.lora_targets == "none" else [s.lora_targets]
        targets += [f"experts {', '.join(experts)}"] if experts else []
        adapted = f"r={s.lora_r} ({' + '.join(targets)})"
        if s.quantization == "none":
            return f"LoRA {adapted}"
        quant = quantized_base(self.shape, s)
        of_them = f", {quant.expert_weights / 1e9:.2f}B of them experts" if quant.expert_weights else ""
        return (
            f"QLoRA {adapted}, {quant.weights / 1e9:.2f}B base weights in NF4 at {8 * quant.bytes_per_weight:.2f} "
            f"bits{of_them}"
        )

    def table(self) -> str:
        counts, s = param_counts(self.shape, self.setup), self.setup
        lines = [
            f"{self.shape.name}: {counts.total_with_adapters / 1e9:.2f}B parameters{self._active()}, "
            f"{counts.trainable / 1e9:.3g}B trainable ({self._mode()}), {s.optimizer}, {s.precision}",
            f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s) of {_gib(s.gpu_memory)} "
            f"({_gib(s.usable_gpu_memory)} usable), host {_gib(s.host_memory)} per node; micro-batch "
            f"{s.micro_batch_size} x {s.seq_length} tokens, activation checkpointing "
            f"{'on' if s.activation_checkpointing else 'off'}. GiB per GPU unless marked per node.",
            *self._long_sequence_lines(),
            "",
        ]
        header = [
            "strategy",
            "params",
            "grads",
            "optim",
            "activ",
            "logits",
            "buffers",
            "GPU total",
            "host/node",
            "NVMe/node",
            "fits",
            "max mbs",
        ]
        rows = [_row(e) for e in self.estimates]
        if self.show_longest_sequence:
            header.append("longest seq")
            for row, e, n in zip(rows, self.estimates, self.longest_sequences(), strict=True):
                row.append(f"{n:,}" if e.modelled else "—")
        lines += aligned([header, *rows])
        lines += ["", *self.phase_table(), *self.speed_table(), "", self.recommendation_line(), *self.selected_lines()]
        return "\n".join(lines)

    def speed_table(self) -> list[str]:
        """The predicted speed of each strategy (a blank line first), none without a machine."""
        if self.machine is None:
            return []
        lines = speed_lines(self.estimates, self.speeds(), self.machine, self.setup.world_size, self.budget)
        return ["", *lines] if lines else []

    def selected_lines(self) -> list[str]:
        """One line on the run's own strategy (``plan(strategy=...)``), none without one."""
        chosen = next((e for e in self.estimates if e.strategy.key == self.selected), None)
        if chosen is None:
            return []
        name = f"Your run: {chosen.strategy.label} (strategy: {chosen.strategy.trainer_strategy})"
        if not chosen.modelled:
            return [f"{name}: not modelled with these settings."]
        verdict = "fits" if chosen.fits else f"does not fit ({_fits(chosen).removeprefix('no (').rstrip(')')})"
        return [
            f"{name} {verdict}: {_gib(chosen.gpu_total)} per GPU, micro-batch up to {chosen.max_micro_batch}, "
            f"host {_gib(chosen.host_per_node)} per node."
        ]

    def _long_sequence_lines(self) -> list[str]:
        """The header's lines on sequence parallelism, the tiled MLP and the "longest seq" column, when in use."""
        s, parts = self.setup, []
        if s.sequence_parallel_size > 1:
            parts.append(
                f"Sequence parallel {s.sequence_parallel_size}: each sequence split over {s.sequence_parallel_size} "
                f"GPUs ({s.local_seq_length:,} tokens each), {s.data_parallel_size} data-parallel group(s)."
            )
        tiles = mlp_tiles(self.shape, s, s.micro_batch_size)
        if tiles > 1:
            parts.append(f"MLP in {tiles} tiles of at most {s.mlp_tile_tokens:,} tokens.")
        elif s.mlp_tile_tokens > 0 and self.shape.is_moe:  # models.tiling leaves expert blocks alone
            parts.append("MLP tiling: not applied to a mixture of experts' experts.")
        elif s.mlp_tile_tokens > 0:
            parts.append(f"MLP tiling: the {local_tokens(s, s.micro_batch_size):,} tokens fit one tile, none.")
        lines = [" ".join(parts)] if parts else []
        if self.show_longest_sequence:
            lines.append(
                f"Longest seq: the longest sequence that fits the GPU at micro-batch 1, in steps of "
                f"{sequence_step(s):,} tokens (multiples of {SEQUENCE_GRID:,} and of sp)."
            )
        return lines

    def phase_table(self) -> list[str]:
        """Peak per rank in each phase, GiB: ``host / device`` on GPUs, host only on CPU ranks."""
        cpu = self.setup.accelerator == "cpu"
        title = "host RAM per rank (CPU ranks)" if cpu else "host RAM / GPU memory per rank"
        rows = [["strategy", *PHASES]]
        for e, peaks in zip(self.estimates, self.phases(), strict=True):
            cells = [
                _gib(p.host, unit=False) if cpu else f"{_gib(p.host, unit=False)} / {_gib(p.device, unit=False)}"
                for p in peaks.by_phase().values()
            ]
            cells = cells if e.modelled else ["—"] * len(cells)
            rows.append([e.strategy.label, *cells])
        return [f"Peak per phase, GiB, {title}:", *aligned(rows)]

    def recommendation_line(self) -> str:
        best = self.recommendation
        if best is None:
            return (
                "Recommendation: nothing fits. Try activation checkpointing, a smaller micro-batch or sequence, "
                "LoRA (--lora_r), more GPUs or nodes, or more host memory for offloading."
            )
        predicted = dict(zip((e.strategy.key for e in self.estimates), self.speeds(), strict=True))[best.strategy.key]
        why = "the fastest that fits"
        if predicted is not None:
            why += f" ({predicted.tokens_per_second_per_gpu:,.0f} tokens/s per GPU predicted)"
        return (
            f"Recommendation: {best.strategy.label} (strategy: {best.strategy.trainer_strategy}), {why}; "
            f"{_gib(best.gpu_total)} per GPU, micro-batch up to {best.max_micro_batch}."
        )


def _columns(e: Estimate) -> list[float]:
    return [
        e.params,
        e.grads,
        e.optimizer_state,
        e.activations,
        e.logits,
        e.buffers,
        e.gpu_total,
        e.host_per_node,
        e.nvme_per_node,
    ]


def _row(e: Estimate) -> list[str]:
    if not e.modelled:
        return [e.strategy.label, *(["—"] * len(_columns(e))), "not modelled", "—"]
    return [e.strategy.label, *(_gib(v, unit=False) for v in _columns(e)), _fits(e), str(e.max_micro_batch)]


def _fits(e: Estimate) -> str:
    if e.fits:
        return "yes"
    return "no (GPU+host)" if not (e.fits_gpu or e.fits_host) else ("no (GPU)" if not e.fits_gpu else "no (host)")


def _estimate_dict(e: Estimate) -> dict[str, Any]:
    names = [
        "params",
        "grads",
        "optimizer_state",
        "activations",
        "logits",
        "buffers",
        "gpu_total",
        "host_per_node",
        "nvme_per_node",
    ]
    out: dict[str, Any] = {"key": e.strategy.key, "label": e.strategy.label, "strategy": e.strategy.trainer_strategy}
    out["bytes"] = {name: round(value) for name, value in zip(names, _columns(e), strict=True)}
    out["bytes"]["model_states"] = round(e.model_states)
    out.update(fits=e.fits, fits_gpu=e.fits_gpu, fits_host=e.fits_host, max_micro_batch=e.max_micro_batch)
    out["modelled"] = e.modelled
    return out


def _machine_dict(found: Machine) -> dict[str, Any]:
    hw = found.hardware
    return {
        "gpu": found.gpu,
        "name": hw.name,
        "peak_flops": hw.peak_flops,
        "compute_efficiency": hw.compute_efficiency,
        "memory_bandwidth": hw.memory_bandwidth,
        "intra_node_bus_bandwidth": hw.intra_bandwidth,
        "inter_node_bus_bandwidth": hw.inter_bandwidth,
        "host_bandwidth": hw.host_bandwidth,
        "assumed": list(found.notes),
    }


def _phases_dict(peaks: PhasePeaks) -> dict[str, dict[str, int]]:
    return {name: {"host": round(p.host), "device": round(p.device)} for name, p in peaks.by_phase().items()}


def _gib(value: float, unit: bool = True) -> str:
    text = f"{value / GiB:.1f}"
    return f"{text} GiB" if unit else text


def plan(
    model: str | ModelShape,
    gpus_per_node: int = 8,
    nodes: int = 1,
    gpu_memory: str | int | None = None,
    host_memory: str | int = "1TB",
    precision: Precision = "bf16-mixed",
    micro_batch_size: int = 1,
    seq_length: int = 2048,
    activation_checkpointing: bool = False,
    lora_r: int = 0,
    lora_targets: LoraTargets = "all-linear",
    lora_target_parameters: Sequence[str] | None = None,
    quantization_skip_modules: Sequence[str] | None = None,
    optimizer: Optimizer = "adamw",
    attention: Attention = "sdpa",
    accelerator: Accelerator = "gpu",
    checkpoint_file_size: str | int = "5GB",
    loss_chunking: LossChunking = "auto",
    loss_chunk_tokens: int = 1024,
    quantization: Quantization = "none",
    sequence_parallel_size: int = 1,
    mlp_tile_tokens: int | None = 0,
    longest_sequence: bool = False,
    strategy: str | Strategy | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    gpu: str | None = None,
    interconnect: str | None = None,
    figures: Figures | None = None,
    hardware: Hardware | None = None,
    accumulate_grad_batches: int = 1,
    gradient_compression: str = "none",
    tokens: float | None = None,
    price_per_gpu_hour: float | None = None,
) -> PlanReport:
    """Memory per GPU and per node of finetuning ``model`` with every strategy, and the fastest one that fits.

    Args:
        model: A bundled architecture name (``llama-3-8b``, ``qwen3-32b``, ... see ``shapes.BUNDLED``), a
            gym_lightning preset (``tiny-llama``), a local ``config.json`` or model folder, or a :class:`ModelShape`.
        gpus_per_node: GPUs per node (>= 1). nodes: Nodes (>= 1); all GPUs are data-parallel ranks.
        gpu_memory: Memory of one GPU, e.g. ``"80GB"`` (binary units, see :func:`parse_bytes`) or bytes; ``None``:
            the ``gpu``'s.
        host_memory: CPU RAM per node, e.g. ``"1TB"``.
        precision: ``"bf16-mixed"`` (16-bit compute, fp32 master weights) or ``"32-true"``.
        micro_batch_size: Sequences per GPU per forward pass (>= 1). seq_length: Tokens per sequence (>= 1).
        activation_checkpointing: Recompute each decoder layer in backward instead of storing its activations.
        lora_r: LoRA rank; ``0`` finetunes all parameters. lora_targets: ``"all-linear"``, ``"attention-qv"`` or
            ``"none"`` (only the experts of ``lora_target_parameters``).
        lora_target_parameters: A mixture of experts' fused expert weights to adapt (``lora.target_parameters``):
            ``["all-experts"]`` or peft names (``experts.gate_up_proj``, ``experts.down_proj``); ``None``: none.
        quantization_skip_modules: The run's ``quantization.skip_modules``: under QLoRA the fused expert weights
            are NF4 unless it names them (``experts``, ``experts.down_proj``); other names are not planned.
        optimizer: ``"adamw"`` (default), ``"sgd"`` (with momentum) or ``"adafactor"`` (factored, no momentum).
        attention: ``"sdpa"`` (flash / memory-efficient, the transformers default) or ``"eager"`` (stores scores).
        accelerator: ``"gpu"`` or ``"cpu"`` (CPU ranks: every byte is host memory; ``gpu_memory`` is ignored).
        checkpoint_file_size: The largest safetensors file of the checkpoint loaded (one file is in flight while
            loading), e.g. ``"5GB"`` (the Hub's usual shard size).
        loss_chunking: As ``CausalLMModule(loss_chunking=...)``: ``"auto"`` chunks from a 65,536-token vocabulary.
        loss_chunk_tokens: As ``CausalLMModule(loss_chunk_tokens=...)``: positions per LM-head/loss chunk.
        quantization: ``"nf4"``: QLoRA, the frozen base's decoder linear layers in 4-bit NF4 with double
            quantisation (``model.quantization``; needs ``lora_r > 0``). Offloading strategies are not modelled then.
        sequence_parallel_size: As the strategies' ``sequence_parallel_size`` (Ulysses): sp consecutive GPUs share
            each sequence, ``seq_length / sp`` tokens each; must divide the GPUs and the attention heads; sdpa only.
        mlp_tile_tokens: As ``CausalLMModule(mlp_tile_tokens=...)``: tokens per tiled-MLP step; 0 or None = off.
        longest_sequence: Add the "longest seq" column to ``table()`` (``to_dict()`` always has it).
        strategy: The run's own strategy, reported on a line of its own (``selected`` in ``to_dict()``): a
            registered name (``zero3``), a planner key (``fsdp_grad_op``) or a :class:`Strategy`; one the list
            lacks is added as a row.
        config_overrides: ``config.json`` keys changed first, as ``CausalLMModule(config_overrides=...)``.
        gpu: A GPU of the hardware catalog (``h100-sxm``, ``h200``, ``a100-40gb``, ``b200``, ...; ``metrics.hardware``)
            the speed is predicted on; ``None``: H100 SXM. Its memory is the default ``gpu_memory``.
        interconnect: The fabric between nodes (``ib-ndr400``, ``ethernet-100``, ...), an intra-node link
            (``pcie4``) or both (``pcie4,ethernet-100``); ``None``: the GPU's usual link, InfiniBand NDR across nodes.
        figures: Explicit figures (peak TFLOP/s, compute efficiency, bandwidths) over the catalog's.
        hardware: The step-time model's figures, given whole (CPU ranks: measured); overrides gpu and interconnect.
        accumulate_grad_batches: Micro-batches per optimizer step.
        gradient_compression: gym_ddp's / gym_fsdp's ``gradient_compression`` (``none``, ``fp16``, ``bf16``,
            ``powersgd``): the bytes their gradients travel in.
        tokens: Tokens to train on: the hours, GPU-hours (and cost) of each strategy.
        price_per_gpu_hour: Dollars per GPU-hour: the cost column.
    """
    problems = _problems(
        gpus_per_node, nodes, precision, micro_batch_size, seq_length, lora_r, lora_targets, optimizer, attention
    )
    gpu_bytes = 80 * GiB if gpu_memory is None else _memory(gpu_memory, "gpu_memory", problems)  # else the GPU's
    host_bytes = _memory(host_memory, "host_memory", problems)
    file_bytes = _memory(checkpoint_file_size, "checkpoint_file_size", problems)
    problems += _loss_and_quant_problems(loss_chunk_tokens, accelerator, loss_chunking, quantization, lora_r)
    shape, unknown = _resolve(model, config_overrides)
    expert_targets = tuple(lora_target_parameters or ())
    skip = quantization_skip_modules or ()
    problems += _expert_problems(lora_target_parameters, shape, lora_r, lora_targets, skip)
    chosen = run_strategy(strategy, problems)
    budget = Budget(tokens, price_per_gpu_hour)
    problems += budget.problems() + _speed_problems(accumulate_grad_batches, gradient_compression)
    found = _machine(accelerator, precision, nodes, gpu, interconnect, figures, hardware, problems)
    if gpu_memory is None and found is not None and found.gpu_memory:
        gpu_bytes = found.gpu_memory
    setup = Setup(
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory=gpu_bytes,
        host_memory=host_bytes,
        precision=precision,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        activation_checkpointing=activation_checkpointing,
        lora_r=lora_r,
        lora_targets=lora_targets,
        optimizer=optimizer,
        attention=attention,
        accelerator=accelerator,
        lora_target_parameters=expert_targets,
        skip_expert_weights=skipped_expert_weights(skip) if not _names_problem(skip) else (),
        checkpoint_file_bytes=file_bytes,
        loss_chunking=loss_chunking,
        loss_chunk_tokens=loss_chunk_tokens,
        quantization=quantization,
        sequence_parallel_size=sequence_parallel_size,
        mlp_tile_tokens=0 if mlp_tile_tokens is None else mlp_tile_tokens,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_compression=gradient_compression,  # type: ignore[arg-type]
    )
    shape = _refuse(problems + sequence_parallel_problems(shape, setup), shape, unknown)
    estimates = estimate_all(shape, setup)
    if chosen is not None and not any(e.strategy.key == chosen.key for e in estimates):
        estimates.append(estimate(shape, chosen, setup))
    return PlanReport(
        shape,
        setup,
        estimates,
        show_longest_sequence=longest_sequence,
        selected=None if chosen is None else chosen.key,
        machine=found,
        budget=budget,
    )


def _machine(
    accelerator: str,
    precision: str,
    nodes: int,
    gpu: str | None,
    interconnect: str | None,
    figures: Figures | None,
    hardware: Hardware | None,
    problems: list[str],
) -> Machine | None:
    """The plan's :class:`Machine`: ``hardware`` as given, else the catalog's GPU; none on CPU ranks without measured
    figures. A name or figure it cannot read goes to ``problems``."""
    if hardware is not None:
        return Machine(hardware, 0, "given")
    if accelerator == "cpu":
        return None
    try:
        return machine(precision, nodes if isinstance(nodes, int) else 1, gpu, interconnect, figures)
    except GymUserError as err:
        problems.append(str(err).rstrip("."))
        return None


def _speed_problems(accumulate_grad_batches: int, gradient_compression: str) -> list[str]:
    problems = []
    if not _is_int(accumulate_grad_batches, 1):
        problems.append(f"accumulate_grad_batches must be an integer >= 1, got {accumulate_grad_batches!r}")
    if gradient_compression not in get_args(GradientCompression):
        choices = ", ".join(get_args(GradientCompression))
        problems.append(f"gradient_compression must be one of {choices}, got {gradient_compression!r}")
    return problems


def run_strategy(strategy: str | Strategy | None, problems: list[str]) -> Strategy | None:
    """The planner's row for the run's ``strategy`` (a row of the list that shards and offloads alike, else the
    strategy itself); an unknown name is added to ``problems``."""
    if strategy is None or isinstance(strategy, Strategy):
        found = strategy
    elif strategy in STRATEGY_BY_KEY:
        found = STRATEGY_BY_KEY[strategy]
    elif strategy in STRATEGY_PRESET_BY_NAME:
        preset = STRATEGY_PRESET_BY_NAME[strategy]
        found = planner_strategy("run", strategy, preset.strategy_class, preset.init_args, name=strategy)
    else:
        problems.append(
            f"strategy must be one of gym_lightning's ({', '.join(STRATEGY_NAMES)}) or a planner key "
            f"({', '.join(STRATEGY_BY_KEY)}), got {strategy!r}"
        )
        return None
    same = [s for s in STRATEGIES if found is not None and _memory_layout(s) == _memory_layout(found)]
    return same[0] if same else found


def _memory_layout(strategy: Strategy) -> tuple[object, ...]:
    """What the planner's memory model reads of a strategy: everything but its names."""
    s = strategy
    return (s.framework, s.stage, s.offload_optimizer, s.offload_parameters, s.keep_gathered, s.hybrid)


def _refuse(problems: list[str], shape: ModelShape | None, unknown: GymUserError | None) -> ModelShape:
    """``shape`` if nothing is wrong, else one error listing every problem (an unknown model alone keeps its own
    message)."""
    if unknown is not None and not problems:
        raise unknown
    if unknown is not None:
        problems = [*problems, str(unknown).rstrip(".")]
    if problems or shape is None:
        raise GymUserError("Invalid planner settings: " + "; ".join(problems) + ".")
    return shape


def _loss_and_quant_problems(
    loss_chunk_tokens: int, accelerator: str, loss_chunking: str, quantization: str, lora_r: int
) -> list[str]:
    problems = []
    if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
        problems.append(f"loss_chunk_tokens must be an integer >= 1, got {loss_chunk_tokens!r}")
    for name, value, choices in (
        ("accelerator", accelerator, Accelerator),
        ("loss_chunking", loss_chunking, LossChunking),
        ("quantization", quantization, Quantization),
    ):
        if value not in get_args(choices):
            problems.append(f"{name} must be one of {', '.join(get_args(choices))}, got {value!r}")
    if quantization == "nf4" and lora_r == 0:
        problems.append("quantization nf4 (QLoRA) freezes a 4-bit base and trains LoRA adapters: set lora_r > 0")
    return problems


def _expert_problems(
    values: Sequence[str] | None, shape: ModelShape | None, lora_r: int, lora_targets: str, skip: Sequence[str]
) -> list[str]:
    """What is wrong with the expert LoRA / QLoRA settings (``planner.experts.target_parameter_problems``),
    ``lora_targets none`` with nothing else to adapt, and skip modules that are not a list of names."""
    problems = target_parameter_problems(values or (), shape, lora_r if isinstance(lora_r, int) else 0)
    if lora_targets == "none" and not values and lora_r:
        problems.append(
            "lora_targets none adapts no linear layer and lora_target_parameters names no expert: nothing to train; "
            "give lora_target_parameters (all-experts) or lora_targets all-linear / attention-qv"
        )
    if _names_problem(skip):
        problems.append(f"quantization_skip_modules must be a list of module names, got {skip!r}")
    return problems


def _names_problem(names: Sequence[str]) -> bool:
    return isinstance(names, str) or not all(isinstance(n, str) for n in names)


def _resolve(
    model: str | ModelShape, config_overrides: Mapping[str, Any] | None = None
) -> tuple[ModelShape | None, GymUserError | None]:
    """The shape of ``model``, or the error naming it unknown: kept, so that one message lists it with the other
    problems (the sequence-parallel ones need the shape's heads)."""
    if isinstance(model, ModelShape):
        return model, None
    try:
        return resolve_shape(model, config_overrides), None
    except GymUserError as err:
        return None, err


def _memory(value: str | int, name: str, problems: list[str]) -> int:
    try:
        size = parse_bytes(value)
    except ValueError as err:
        problems.append(f"{name}: {str(err).rstrip('.')}")
        return 0
    if size <= 0:
        problems.append(f"{name} must be positive, got {value!r}")
    return size


def _problems(
    gpus: int, nodes: int, precision: str, mbs: int, seq: int, lora_r: int, targets: str, optimizer: str, attention: str
) -> list[str]:
    problems = [
        f"{name} must be an integer >= {low}, got {value!r}"
        for name, value, low in (
            ("gpus_per_node", gpus, 1),
            ("nodes", nodes, 1),
            ("micro_batch_size", mbs, 1),
            ("seq_length", seq, 1),
            ("lora_r", lora_r, 0),
        )
        if isinstance(value, bool) or not isinstance(value, int) or value < low
    ]
    for name, value, choices in (
        ("precision", precision, Precision),
        ("lora_targets", targets, LoraTargets),
        ("optimizer", optimizer, Optimizer),
        ("attention", attention, Attention),
    ):
        if value not in get_args(choices):
            problems.append(f"{name} must be one of {', '.join(get_args(choices))}, got {value!r}")
    return problems
