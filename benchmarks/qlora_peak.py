"""Peak host memory per rank in each phase of a QLoRA run (4-bit NF4 base + LoRA) at 250M and 1B, and a 0.4B MoE.

    python -m benchmarks.qlora_peak                    # 250M and 1B, gym_fsdp and zero3, QLoRA + full-precision LoRA
    python -m benchmarks.qlora_peak --sizes moe-400m   # QLoRA on a mixture of experts' experts (its own section)
    python -m benchmarks.qlora_peak --sizes 250m --strategies gym_fsdp --no-lora
    python -m benchmarks.qlora_peak --render-only --write-docs
    python -m benchmarks.qlora_peak --diagnose --no-lora --sizes 1b   # what is resident at the peaks (not tabled)

The same real-CLI runs as ``benchmarks/scale.py`` (2 CPU ranks, ``bf16-mixed``, 1 x ``--seq`` packed tokens, a few
optimizer steps, a checkpoint save and the HF export, per-phase peak RSS per rank from its ``PhasePeaks`` callback,
the model folders it builds and caches under ``--workdir``), with LoRA r=16 (alpha 32) on every linear layer and
``--model.quantization`` (nf4, double quantisation, bf16 compute, blocks of 64): the QLoRA runs. Each size and
strategy also runs without ``--model.quantization`` (full-precision LoRA, ``--no-lora`` skips it) so that the load
peak of the 16-bit base stands beside the 4-bit one. A mixture of experts (``moe-400m``: Qwen3-MoE, 16 experts,
top-2, 8 layers, 0.39B) also adapts every routed expert's fused weights (``lora.target_parameters: [all-experts]``,
issue 49), whose 3-D weights the QLoRA runs hold in NF4; its runs are tabled in their own section, against the
issue's target (each rank's load and step peak within 1.10x of the planner).

The table puts each measured peak beside the planner (``gym_lightning.planner.phases.qlora_peak`` with the measured
baseline, and ``lora_target_parameters`` for the MoE) and, for the load, beside the theory of the issue: baseline
process RSS + the base / N + one decoder layer in bf16, where the base is the model as it is built for the run
(meta device, ``models.quantized.nf4_linears`` and ``nf4_experts``): the NF4 tensors (codes, block-scale codes,
per-row statistics; of the linear layers and the fused expert weights) at their real sizes, every other frozen tensor
(embeddings and LM head, norms, routers) in bf16, and the LoRA adapters in fp32 (their master copy under bf16-mixed).
Under gym_fsdp and ZeRO-3 every one of them is sharded (/ N); under gym_ddp each rank holds them whole.

``--diagnose`` (results in ``qlora_diagnosis.json``, not tabled) records, per rank, the anonymous/file split and the
main thread's stack at the load and step peaks, the ZeRO-3 parameters gathered at the step peak, the RSS at each
hook of each step and after ``malloc_trim``: how the planner's missing terms were found (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.memory import RSS
from benchmarks.common.memory import rss as current_rss
from benchmarks.common.models import SIZES, ensure_folder, folder_of
from benchmarks.common.paths import MIB
from benchmarks.scale import PHASES, PLANNER_KEYS, PhasePeaks, fit_command, planner_setup, run_cli

SECTION = "## QLoRA: peak memory per phase at 250M and 1B"
SECTION_MOE = "## QLoRA on MoE experts: peak memory per phase at moe-400m"
STRATEGIES = ["gym_fsdp", "zero3"]
LORA_R, LORA_ALPHA = 16, 32
LORA = {"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": ["all-linear"]}
# Mixture-of-experts sizes (a config with ``num_experts``) also adapt every routed expert's fused 3-D weights (issue
# 49): without them LoRA would leave 90 % of moe-400m's parameters unadapted.
EXPERT_TARGETS = ["all-experts"]


def lora_settings(size: str) -> dict[str, Any]:
    """The LoRA settings of ``size``'s runs: every linear layer, plus the experts for a mixture of experts."""
    return {**LORA, "target_parameters": EXPERT_TARGETS} if is_moe(size) else dict(LORA)


def is_moe(size: str) -> bool:
    """Whether ``size`` (a ``scale.SIZES`` key) is a mixture of experts (its config sets ``num_experts``)."""
    return "num_experts" in SIZES[size]


# QLoRA's settings (configs/qlora.yaml): NF4, double quantisation, bf16 compute, 64 weights per block scale.
QUANTIZATION = {"quant_type": "nf4", "compute_dtype": "bfloat16", "double_quant": True, "block_size": 64}
MODES = ("qlora", "lora")
# The targets: the load peak within 1.1x of the theory, the planner within 10 % of the measured peak.
THEORY_TARGET = 1.1
PLANNER_TARGET = 0.10
# Issue 49 point 3: QLoRA on the experts at moe-400m, the load and step peaks per rank within 1.10x of `gym plan`.
MOE_PLANNER_TARGET = 1.10
MOE_TARGET_PHASES = ("load", "step")
# What the --diagnose runs found when the step peaks first missed (kept under the MoE table, which is rewritten).
MOE_FINDINGS = (
    "Before the planner knew three terms of the step, its moe-400m step figures were 1.24 / 1.24x (gym_fsdp) and "
    "1.10 / 1.08x (zero3) low (first run; measured 1,145 / 1,138 against 921, 1,147 / 1,123 against 1,038). "
    "`--diagnose` put both steps' peaks in an all-gather early in the forward, none in the expert forward: (1) "
    "gym_fsdp's root unit (what no decoder layer holds) is the embedding and, untied as here, the LM head: 125 MiB in "
    "bf16 gathered at once, where the planner had one embedding, 62.5 MiB (`planner.estimate.fsdp_root_params`; on "
    "GPUs too); the step peaked 298 MiB above its start. (2) On CPU ranks gloo receives every all-gather into a "
    "temporary of the whole gathered size and copies it out (100 MiB above output + input for a 100 MiB "
    "`all_gather_into_tensor` on 2 ranks; NCCL receives in place): ZeRO-3's gathered units exist twice in flight "
    "(207 MiB above the step's start at its peak against 125 planned; the gathered decoder layers measured 21-22 MiB "
    "each there, their NF4 size), and (3) gym_fsdp's peak is the root's all-gather, not its copy-out, beside the "
    "previous forward's last all-gather output, which FSDP2 frees only at the next forward unit's copy-out (one "
    'layer more). (2) and (3) apply to `accelerator="cpu"` only. The same terms bring the full-finetuning rows of '
    "`benchmarks/scale.py` closer (planner error at the documented figures: zero3 step 5.0 -> 0.6 % at 250M, "
    "2.9 -> 0.0 % at 1B, 15.3 -> 12.0 % for moe-400m; gym_fsdp moe-400m step 7.8 -> 1.2 %)."
)


def _status() -> dict[str, float]:
    """The resident-set split of this process (MiB): anonymous memory, mapped files, shared memory."""
    fields = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    lines = Path("/proc/self/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in lines if line.startswith(fields)}


def _mapped() -> dict[str, float]:
    """Resident MiB of the mapped files by kind (shared libraries, safetensors, other files, anonymous)."""
    kinds: dict[str, float] = {}
    kind = "anon"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header line: address range, perms, ...
            path = head[5] if len(head) > 5 else ""
            kind = "so" if ".so" in path else "safetensors" if path.endswith(".safetensors") else (
                "file" if path.startswith("/") else "anon")  # fmt: skip
        elif head and head[0] == "Rss:":
            kinds[kind] = kinds.get(kind, 0.0) + int(head[1]) / 1024
    return kinds


def _main_stack() -> list[str]:
    """The main thread's innermost frames in gym_lightning, DeepSpeed, torch.distributed or peft (where the load
    is when its peak is sampled)."""
    import threading
    import traceback

    frame = sys._current_frames().get(threading.main_thread().ident)
    names = ("gym_lightning", "deepspeed", "distributed", "peft", "transformers")
    frames = traceback.extract_stack(frame) if frame is not None else []
    return [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames
            if any(n in f.filename for n in names)][-6:]  # fmt: skip


def _gathered(module: Any) -> dict[str, float]:
    """MiB of ZeRO-3 parameters gathered whole right now (``ds_status`` AVAILABLE, persistent ones included), by
    the module path's first names below the decoder layers (``layers.7``, ``lm_head``): what DeepSpeed keeps live.
    Empty for other strategies."""
    found: dict[str, float] = {}
    try:
        for name, param in list(module.named_parameters()):
            status = getattr(param, "ds_status", None)
            if status is None or status.name != "AVAILABLE":
                continue
            parts = name.split(".")
            key = ".".join(parts[: parts.index("layers") + 2]) if "layers" in parts else parts[-2]
            found[key] = found.get(key, 0.0) + param.ds_numel * param.element_size() / MIB
    except RuntimeError:  # the parameters changed while listed (the sampler runs beside the step)
        pass
    return {k: round(v, 1) for k, v in found.items()}


class CodeLoadedPeaks(PhasePeaks):
    """``PhasePeaks`` whose baseline is taken once the code the load imports is imported (peft, the model's modeling
    module, torch distributed checkpoint): the planner's ``host_process_overhead`` is a process with its code
    loaded. Measured with ``--diagnose``: about 800 modules, 51 MiB, are imported after ``PhasePeaks``' baseline,
    a constant that weighed 10-25 % on these 4-bit peaks and is not model memory."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import peft.tuners.lora  # noqa: F401 - imported for its memory, before the baseline
        import torch.distributed.checkpoint  # noqa: F401

        from gym_lightning.models.loading import import_model_code, load_model_config

        hp = pl_module.hparams
        import_model_code(load_model_config(hp.model, hp.config_overrides, hp.trust_remote_code))
        super().setup(trainer, pl_module, stage)


class ResidentAtPeak(CodeLoadedPeaks):
    """``PhasePeaks`` plus what is resident at the load and step peaks and at the end of the load (``--diagnose``):
    the anonymous/file split and the main thread's stack at each sampled peak, the mapped files by kind, the modules
    imported since ``setup``, the RSS after glibc returns its freed heap (``malloc_trim``) at the end of the load,
    and the RSS at each hook of each training step (``step_timeline``: where in forward, backward or the optimizer
    step it grows), written to ``rank<r>.json`` under ``diagnosis``."""

    def __init__(self, out: str, checkpoint: str) -> None:
        self.diagnosis: dict[str, Any] = {"step_timeline": []}
        self._split_peak = {"load": 0.0, "step": 0.0}
        super().__init__(out, checkpoint)

    def _observe(self, readings: dict[str, int]) -> None:
        rss, phase = readings[RSS], self._phase
        if phase in self._split_peak and rss > self._split_peak[phase] + MIB:
            self._split_peak[phase] = rss
            self.diagnosis[f"{phase}_peak_split"] = _status()
            self.diagnosis[f"{phase}_peak_stack"] = _main_stack()
            if phase == "step":
                self.diagnosis["step_peak_gathered"] = _gathered(self._module)

    def _mark(self, hook: str) -> None:
        """One ``step_timeline`` entry: the hook, the RSS now and the phase's peak so far (MiB)."""
        self.diagnosis["step_timeline"].append(
            [hook, round(current_rss() / MIB), round(self._meter.peak_bytes() / MIB)]
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.diagnosis["baseline_split"], self.diagnosis["baseline_mapped"] = _status(), _mapped()
        self._modules = set(sys.modules)
        self._module = pl_module
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_start(trainer, pl_module)
        import ctypes

        self.diagnosis["load_end_split"], self.diagnosis["load_end_mapped"] = _status(), _mapped()
        self.diagnosis["imported_since_setup"] = len(set(sys.modules) - self._modules)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.diagnosis["load_end_after_malloc_trim"] = _status()
        self.rows["diagnosis"] = self.diagnosis
        self._mark("after_load_trim")

    def on_train_batch_start(self, *args: Any) -> None:
        self._mark("batch_start")

    def on_before_backward(self, *args: Any) -> None:
        self._mark("before_backward")

    def on_after_backward(self, *args: Any) -> None:
        self._mark("after_backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._mark("before_optimizer_step")

    def on_train_batch_end(self, *args: Any) -> None:
        self._mark("batch_end")


def command(
    folder: Path, strategy: str, run: Path, steps: int, seq: int, mode: str, diagnose: bool, lora: dict[str, Any]
) -> list[str]:
    """``scale.fit_command`` with LoRA settings ``lora``, and the 4-bit base for ``mode == "qlora"``."""
    extra = ["--model.lora", json.dumps(lora)]
    if mode == "qlora":
        extra += ["--model.quantization", json.dumps(QUANTIZATION)]
    base = fit_command(folder, strategy, run, steps, seq)
    # Diagnose: the same callback with the residency probes (it trims the heap after the load: not for tables).
    callback = "benchmarks.qlora_peak.ResidentAtPeak" if diagnose else "benchmarks.qlora_peak.CodeLoadedPeaks"
    base = [a.replace("benchmarks.scale.PhasePeaks", callback) for a in base]
    return base + extra


def run_one(
    workdir: Path, size: str, strategy: str, steps: int, seq: int, mode: str, diagnose: bool = False
) -> dict[str, Any]:
    """One CLI run; returns ``{"ranks": [rank0 rows, rank1 rows], "seconds": ...}`` and deletes its outputs (its
    own run folder and log names: scale.py's runs may share the workdir)."""
    name = f"{size}-{strategy}-{mode}"
    run = workdir / "runs" / name
    argv = command(folder_of(workdir, size), strategy, run, steps, seq, mode, diagnose, lora_settings(size))
    return run_cli(workdir, name, argv, steps, seq)


@dataclass(frozen=True)
class Base:
    """Bytes of the model as a QLoRA run builds it, whole (not per rank)."""

    nf4: int  # NF4Linear codes, block-scale codes and per-row statistics
    sixteen_bit: int  # every other frozen tensor in bf16 (embedding = tied LM head, norms), each tied tensor once
    adapters: int  # LoRA A and B in fp32
    layer_bf16: int  # one decoder layer of the unquantised model in bf16


def base_bytes(folder: Path, lora: dict[str, Any]) -> Base:
    """The real tensor sizes: the model built on the meta device as loading builds it (``models.quantized``'s
    ``nf4_linears`` and ``nf4_experts`` contexts, then ``restore_skipped``: the decoder linears and a mixture of
    experts' fused expert weights in NF4) with the LoRA settings ``lora`` applied.

    Args:
        folder: The model folder (its config.json).
        lora: The runs' LoRA settings (:func:`lora_settings`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gym_lightning.lora import LoRAArgs, apply_lora
    from gym_lightning.models.experts import expert_targets
    from gym_lightning.models.quantized import nf4_experts, nf4_linears, restore_skipped
    from gym_lightning.quant.config import QuantizationArgs

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layer_bf16 = 2 * sum(p.numel() for p in plain.model.layers[0].parameters())
    args = QuantizationArgs(**QUANTIZATION)
    with torch.device("meta"), nf4_linears(args), nf4_experts(args, config):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    restore_skipped(model, args)
    model = apply_lora(model, LoRAArgs.from_value(lora), expert_targets(model))  # as CausalLMModule applies it
    nf4 = sixteen = adapters = 0
    nf4_params = _nf4_parameters(model)
    for name, param in model.named_parameters():  # tied parameters come once
        if id(param) in nf4_params:
            nf4 += param.numel() * param.element_size()
        elif "lora_" in name:
            adapters += 4 * param.numel()
        else:
            sixteen += 2 * param.numel()
    return Base(nf4, sixteen, adapters, layer_bf16)


def _nf4_parameters(model: Any) -> set[int]:
    """``id`` of every NF4 tensor of ``model``: the ``NF4Linear`` layers' and the NF4 expert weights' parts (codes,
    block-scale codes, per-row statistics; ``quant.experts.stored_components``).

    Args:
        model: The model built as :func:`base_bytes` builds it.
    """
    from gym_lightning.quant import experts
    from gym_lightning.quant.linear import NF4Linear

    found = {id(p) for m in model.modules() if isinstance(m, NF4Linear) for p in m.parameters(recurse=False)}
    for module in model.modules():
        for name, spec in experts.nf4_weights_of(module).items():
            found |= {id(getattr(module, attr)) for attr in experts.stored_components(name, spec)}
    return found


def theory_load(base: Base, baseline: float, strategy: str, world_size: int) -> float:
    """Baseline + the base (4-bit + bf16 rest + fp32 adapters) / N (whole under gym_ddp) + one decoder layer in
    bf16 (the 16-bit tensor being read and quantised)."""
    shards = 1 if strategy == "gym_ddp" else world_size
    return baseline + (base.nf4 + base.sixteen_bit + base.adapters) / shards + base.layer_bf16


def planner_peaks(
    folder: Path, strategy: str, baseline_mib: float, seq: int, world_size: int, lora: dict[str, Any]
) -> dict[str, float]:
    """``qlora_peak`` of every phase (host bytes per rank: CPU ranks count their tensors as host memory), with the
    runs' LoRA settings: r, every linear layer, and the expert adapters of ``lora["target_parameters"]`` (what
    ``gym plan --lora_target_parameters`` passes).

    Args:
        folder: The model folder.
        strategy: The strategy's CLI name (``gym_fsdp``, ``zero3``, ``gym_ddp``).
        baseline_mib: The measured baseline RSS of a rank (MiB): the planner's process overhead.
        seq: Tokens per packed row.
        world_size: Ranks.
        lora: The runs' LoRA settings (:func:`lora_settings`).
    """
    from gym_lightning.planner import resolve_shape
    from gym_lightning.planner.phases import qlora_peak

    setup = replace(
        planner_setup(folder, baseline_mib, seq),
        lora_r=lora["r"],
        lora_targets="all-linear",
        lora_target_parameters=tuple(lora.get("target_parameters") or ()),
    )
    shape = resolve_shape(str(folder))
    return {p: qlora_peak(shape, PLANNER_KEYS[strategy], world_size, p, setup).host for p in PHASES}


def _peaks(result: dict[str, Any], phase: str) -> list[float]:
    return [r[phase]["peak"] for r in result.get("ranks", []) if phase in r]


def _intro(steps: int, seq: int, moe: bool) -> list[str]:
    """The section's heading, the command and what each column is.

    Args:
        steps: Optimizer steps of the runs.
        seq: Tokens per packed row.
        moe: The mixture-of-experts section (expert adapters, NF4 experts, per-rank planner ratios).
    """
    lora = {**LORA, "target_parameters": EXPERT_TARGETS} if moe else LORA
    command = "python -m benchmarks.qlora_peak" + (" --sizes moe-400m" if moe else "")
    nf4 = "the decoder linears' and the fused expert weights' NF4 tensors" if moe else "NF4 tensors"
    rest = "embeddings, LM head, norms, routers" if moe else "tied embedding/LM head, norms"
    experts = ', `lora_target_parameters=("all-experts",)`' if moe else ""
    ratio = "measured / planner (r0 / r1)" if moe else "measured / planner"
    return [
        SECTION_MOE if moe else SECTION, "",
        f"`{command}` (2 CPU ranks, `bf16-mixed`, 1 x {seq} packed tokens, {steps} optimizer "
        f"steps, a checkpoint save and the merged HF export, the real CLI with `--model.lora "
        f"'{json.dumps(lora)}' --model.quantization '{json.dumps(QUANTIZATION)}'`; see the script's docstring). "
        "Peak resident memory per rank in each phase, MiB (rank 0 / rank 1). Theory (load only) = the rank's "
        f"measured baseline RSS + ({nf4} at their real sizes + the bf16 non-quantised tensors ({rest}) + the fp32 "
        "LoRA adapters) / N (all sharded under gym_fsdp and ZeRO-3) + one decoder layer in bf16. Planner = "
        "`gym_lightning.planner.phases.qlora_peak` with the measured baseline (`accelerator=\"cpu\"`: device bytes "
        f"counted as host{experts}). Full-precision LoRA load = the same run without `--model.quantization` "
        "(16-bit base).",
        "",
        f"| model | strategy | phase | measured (r0 / r1) | theory | measured / theory | planner | {ratio} | "
        "full-precision LoRA load (r0 / r1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip


def _planner_misses(size: str, strategy: str, phase: str, peaks: list[float], plan: float, moe: bool) -> list[str]:
    """The planner target a phase misses: the dense section's |measured - planner| / measured <= 10 % on every
    phase; the mixture-of-experts section's issue-49 target, each rank's load and step peak within 1.10x of the
    planner (either way)."""
    if not moe:
        error = max(abs(p - plan) / p for p in peaks)
        return [f"{size} {strategy} {phase}: planner {error:.1%} off"] if error > PLANNER_TARGET else []
    worst = max(max(p / plan, plan / p) for p in peaks)
    if phase in MOE_TARGET_PHASES and worst > MOE_PLANNER_TARGET:
        return [f"{size} {strategy} {phase}: {' / '.join(f'{p / plan:.2f}' for p in peaks)}x planner"]
    return []


def _rows(
    result: dict[str, Any], workdir: Path, size: str, strategy: str, full: dict[str, Any], moe: bool
) -> tuple[list[str], list[str]]:
    """The table rows of one QLoRA run (every phase) and the targets it misses; ``full`` is the full-precision LoRA
    run of the same size and strategy (its load peak beside the QLoRA one)."""
    folder = folder_of(workdir, size)
    baseline = max(r["baseline"] for r in result["ranks"])
    lora = lora_settings(size)
    planned = planner_peaks(folder, strategy, baseline, result["seq"], 2, lora)
    base = base_bytes(folder, lora)
    lines: list[str] = []
    misses: list[str] = []
    for phase in PHASES:
        peaks = _peaks(result, phase)
        if not peaks:
            continue
        measured, plan = max(peaks), planned[phase] / MIB
        theory_cells, full_cell = "— | —", ""
        if phase == "load":
            theory = theory_load(base, baseline * MIB, strategy, 2) / MIB
            theory_cells = f"{theory:,.0f} | {measured / theory:.2f}"
            if measured / theory > THEORY_TARGET:
                misses.append(f"{size} {strategy} load: {measured / theory:.2f}x theory")
            full_cell = " / ".join(f"{p:,.0f}" for p in _peaks(full, "load")) or "not run"
        misses += _planner_misses(size, strategy, phase, peaks, plan, moe)
        ratio = " / ".join(f"{p / plan:.2f}" for p in peaks) if moe else f"{measured / plan:.2f}"
        lines.append(
            f"| {size} | {strategy} | {phase} | {' / '.join(f'{p:,.0f}' for p in peaks)} | {theory_cells} | "
            f"{plan:,.0f} | {ratio} | {full_cell} |"
        )
    return lines, misses


def render(results: dict[str, Any], workdir: Path, steps: int, seq: int, moe: bool = False) -> str | None:
    """The markdown section of the dense sizes' QLoRA runs, or (``moe``) of the mixture-of-experts sizes': one row
    per size, strategy and phase, the full-precision LoRA load beside the QLoRA load, and how far each target is
    from being met. ``None`` when ``results`` holds no run of that kind (its section is left as it is)."""
    keys = [k for k in results if k.split("/")[2] == "qlora" and is_moe(k.split("/")[0]) == moe]
    if not keys:
        return None
    lines, misses = _intro(steps, seq, moe), []
    for key in keys:
        size, strategy, _ = key.split("/")
        if "ranks" not in results[key]:
            lines.append(f"| {size} | {strategy} | — | failed (exit {results[key]['failed']}) | | | | | |")
            continue
        rows, missed = _rows(results[key], workdir, size, strategy, results.get(f"{size}/{strategy}/lora", {}), moe)
        lines, misses = lines + rows, misses + missed
    target = (
        "load <= 1.1x theory; load and step peak of each rank within 1.10x of the planner (issue 49)"
        if moe
        else "load <= 1.1x theory; planner error = |measured - planner| / measured of the worse rank <= 10 %"
    )
    lines += ["", f"Targets missed ({target}): " + ("; ".join(misses) or "none") + "."]
    if moe:
        lines += ["", MOE_FINDINGS]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["250m", "1b"], choices=list(SIZES))
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=["gym_ddp", *STRATEGIES])
    parser.add_argument("--steps", type=int, default=2)
    # 4 tokens: scale.py's reason (a 1B backward on this AVX2-only CPU is slow at longer rows).
    parser.add_argument("--seq", type=int, default=4, help="tokens per packed row (micro-batch 1)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-scale")
    parser.add_argument("--no-lora", action="store_true", help="skip the full-precision LoRA runs")
    parser.add_argument("--diagnose", action="store_true", help="probe what is resident at the load (not tabled)")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from earlier results")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.diagnose:  # PhasePeaks' own probe: the RSS after malloc_trim once training is over (before the save)
        os.environ["GYM_SCALE_TRIM"] = "1"
    results_file = args.workdir / ("qlora_diagnosis.json" if args.diagnose else "qlora_results.json")
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for size in [] if args.render_only else args.sizes:
        ensure_folder(args.workdir, size)
        for strategy in args.strategies:
            for mode in MODES[:1] if args.no_lora else MODES:
                print(f"{size} {strategy} {mode} ...", file=sys.stderr, flush=True)
                result = run_one(args.workdir, size, strategy, args.steps, args.seq, mode, args.diagnose)
                results[f"{size}/{strategy}/{mode}"] = result
                results_file.write_text(json.dumps(results, indent=1))
    # Two sections: the dense sizes' and the mixture-of-experts sizes' (issue 49's expert QLoRA); one with no run in
    # the results file is neither printed nor written (its earlier figures in the docs stay).
    for moe in (False, True):
        section = render(results, args.workdir, args.steps, args.seq, moe)
        if section is not None:
            print(section)
            if args.write_docs:
                write_docs(SECTION_MOE if moe else SECTION, section)


def write_docs(heading: str, section: str) -> None:
    """Replace the section ``heading`` of docs/benchmarks.md by ``section`` (the first time: before the History
    section).

    Args:
        heading: The section's first line (:data:`SECTION` or :data:`SECTION_MOE`).
        section: Its new text (:func:`render`).
    """
    write_section(heading, section)


if __name__ == "__main__":
    main()
