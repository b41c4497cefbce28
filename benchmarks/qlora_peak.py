"""Peak host memory per rank in each phase of a QLoRA run (4-bit NF4 base + LoRA) at 250M and 1B parameters.

    python benchmarks/qlora_peak.py                    # 250M and 1B, gym_fsdp and zero3, QLoRA + full-precision LoRA
    python benchmarks/qlora_peak.py --sizes 250m --strategies gym_fsdp --no-lora
    python benchmarks/qlora_peak.py --render-only --write-docs
    python benchmarks/qlora_peak.py --diagnose --no-lora --sizes 1b   # what is resident at the load peak (not tabled)

The same real-CLI runs as ``benchmarks/scale.py`` (2 CPU ranks, ``bf16-mixed``, 1 x ``--seq`` packed tokens, a few
optimizer steps, a checkpoint save and the HF export, per-phase peak RSS per rank from its ``PhasePeaks`` callback,
the model folders it builds and caches under ``--workdir``), with LoRA r=16 (alpha 32) on every linear layer and
``--model.quantization`` (nf4, double quantisation, bf16 compute, blocks of 64): the QLoRA runs. Each size and
strategy also runs without ``--model.quantization`` (full-precision LoRA, ``--no-lora`` skips it) so that the load
peak of the 16-bit base stands beside the 4-bit one.

The table puts each measured peak beside the planner (``gym_lightning.planner.phases.qlora_peak`` with the measured
baseline) and, for the load, beside the theory of the issue: baseline process RSS + the base / N + one decoder layer
in bf16, where the base is the model as it is built for the run (meta device, ``models.quantized.nf4_linears``):
the NF4 tensors (codes, block-scale codes, per-row statistics) at their real sizes, every other frozen tensor
(embeddings = tied LM head, norms) in bf16, and the LoRA adapters in fp32 (their master copy under bf16-mixed).
Under gym_fsdp and ZeRO-3 every one of them is sharded (/ N); under gym_ddp each rank holds them whole.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docs_section import replace_section_before_history  # benchmarks/ is not a package
from scale import (
    DOCS,
    MIB,
    PHASES,
    PLANNER_KEYS,
    SIZES,
    PhasePeaks,
    ensure_folder,
    fit_command,
    folder_of,
    planner_setup,
    run_cli,
)

SECTION = "## QLoRA: peak memory per phase at 250M and 1B"
STRATEGIES = ["gym_fsdp", "zero3"]
LORA_R, LORA_ALPHA = 16, 32
LORA = {"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": ["all-linear"]}
# QLoRA's settings (configs/qlora.yaml): NF4, double quantisation, bf16 compute, 64 weights per block scale.
QUANTIZATION = {"quant_type": "nf4", "compute_dtype": "bfloat16", "double_quant": True, "block_size": 64}
MODES = ("qlora", "lora")
# The targets: the load peak within 1.1x of the theory, the planner within 10 % of the measured peak.
THEORY_TARGET = 1.1
PLANNER_TARGET = 0.10


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
    """``PhasePeaks`` plus what is resident at the load peak and at the end of the load (``--diagnose``): the
    anonymous/file split at the sampled peak, the mapped files by kind, the modules imported since ``setup`` and
    the RSS after glibc returns its freed heap (``malloc_trim``), written to ``rank<r>.json`` under ``diagnosis``."""

    def __init__(self, out: str, checkpoint: str) -> None:
        self.diagnosis: dict[str, Any] = {}
        self._split_peak = 0.0
        super().__init__(out, checkpoint)

    def _sample(self) -> None:
        while True:
            rss = self._rss()
            if self._phase == "load" and rss > self._split_peak + MIB:
                self._split_peak = rss
                self.diagnosis["load_peak_split"] = _status()
                self.diagnosis["load_peak_stack"] = _main_stack()
            self._peak = max(self._peak, rss)
            time.sleep(0.002)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.diagnosis["baseline_split"], self.diagnosis["baseline_mapped"] = _status(), _mapped()
        self._modules = set(sys.modules)
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_start(trainer, pl_module)
        import ctypes

        self.diagnosis["load_end_split"], self.diagnosis["load_end_mapped"] = _status(), _mapped()
        self.diagnosis["imported_since_setup"] = len(set(sys.modules) - self._modules)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.diagnosis["load_end_after_malloc_trim"] = _status()
        self.rows["diagnosis"] = self.diagnosis


def command(folder: Path, strategy: str, run: Path, steps: int, seq: int, mode: str, diagnose: bool) -> list[str]:
    """``scale.fit_command`` with LoRA on every linear layer, and the 4-bit base for ``mode == "qlora"``."""
    extra = ["--model.lora", json.dumps(LORA)]
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
    return run_cli(
        workdir, name, command(folder_of(workdir, size), strategy, run, steps, seq, mode, diagnose), steps, seq
    )


@dataclass(frozen=True)
class Base:
    """Bytes of the model as a QLoRA run builds it, whole (not per rank)."""

    nf4: int  # NF4Linear codes, block-scale codes and per-row statistics
    sixteen_bit: int  # every other frozen tensor in bf16 (embedding = tied LM head, norms), each tied tensor once
    adapters: int  # LoRA A and B in fp32
    layer_bf16: int  # one decoder layer of the unquantised model in bf16


def base_bytes(folder: Path) -> Base:
    """The real tensor sizes: the model built on the meta device with its linear layers as ``NF4Linear``
    (``models.quantized.nf4_linears`` + ``restore_skipped``, what loading builds) and LoRA applied."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gym_lightning.lora import LoRAArgs, apply_lora
    from gym_lightning.models.quantized import nf4_linears, restore_skipped
    from gym_lightning.quant.config import QuantizationArgs
    from gym_lightning.quant.linear import NF4Linear

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layer_bf16 = 2 * sum(p.numel() for p in plain.model.layers[0].parameters())
    args = QuantizationArgs(**QUANTIZATION)
    with torch.device("meta"), nf4_linears(args):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    restore_skipped(model, args)
    model = apply_lora(model, LoRAArgs.from_value(LORA))
    nf4 = sixteen = adapters = 0
    nf4_params = {id(p) for m in model.modules() if isinstance(m, NF4Linear) for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters():  # tied parameters come once
        if id(param) in nf4_params:
            nf4 += param.numel() * param.element_size()
        elif "lora_" in name:
            adapters += 4 * param.numel()
        else:
            sixteen += 2 * param.numel()
    return Base(nf4, sixteen, adapters, layer_bf16)


def theory_load(base: Base, baseline: float, strategy: str, world_size: int) -> float:
    """Baseline + the base (4-bit + bf16 rest + fp32 adapters) / N (whole under gym_ddp) + one decoder layer in
    bf16 (the 16-bit tensor being read and quantised)."""
    shards = 1 if strategy == "gym_ddp" else world_size
    return baseline + (base.nf4 + base.sixteen_bit + base.adapters) / shards + base.layer_bf16


def planner_peaks(folder: Path, strategy: str, baseline_mib: float, seq: int, world_size: int) -> dict[str, float]:
    """``qlora_peak`` of every phase (host bytes per rank: CPU ranks count their tensors as host memory)."""
    from gym_lightning.planner import resolve_shape
    from gym_lightning.planner.phases import qlora_peak

    setup = replace(planner_setup(folder, baseline_mib, seq), lora_r=LORA_R, lora_targets="all-linear")
    shape = resolve_shape(str(folder))
    return {p: qlora_peak(shape, PLANNER_KEYS[strategy], world_size, p, setup).host for p in PHASES}


def _peaks(result: dict[str, Any], phase: str) -> list[float]:
    return [r[phase]["peak"] for r in result.get("ranks", []) if phase in r]


def render(results: dict[str, Any], workdir: Path, steps: int, seq: int) -> str:
    """The markdown section: one row per size, strategy and phase of the QLoRA runs, the full-precision LoRA load
    beside the QLoRA load, and how far each target is from being met."""
    lines = [
        SECTION, "",
        f"`python benchmarks/qlora_peak.py` (2 CPU ranks, `bf16-mixed`, 1 x {seq} packed tokens, {steps} optimizer "
        f"steps, a checkpoint save and the merged HF export, the real CLI with `--model.lora "
        f"'{json.dumps(LORA)}' --model.quantization '{json.dumps(QUANTIZATION)}'`; see the script's docstring). "
        "Peak resident memory per rank in each phase, MiB (rank 0 / rank 1). Theory (load only) = the rank's "
        "measured baseline RSS + (NF4 tensors at their real sizes + the bf16 non-quantised tensors (tied "
        "embedding/LM head, norms) + the fp32 LoRA adapters) / N (all sharded under gym_fsdp and ZeRO-3) + one "
        "decoder layer in bf16. Planner = `gym_lightning.planner.phases.qlora_peak` with the measured baseline "
        "(`accelerator=\"cpu\"`: device bytes counted as host). Full-precision LoRA load = the same run without "
        "`--model.quantization` (16-bit base).",
        "",
        "| model | strategy | phase | measured (r0 / r1) | theory | measured / theory | planner | "
        "measured / planner | full-precision LoRA load (r0 / r1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    misses: list[str] = []
    for key, result in results.items():
        size, strategy, mode = key.split("/")
        if mode != "qlora":
            continue
        if "ranks" not in result:
            lines.append(f"| {size} | {strategy} | — | failed (exit {result['failed']}) | | | | | |")
            continue
        folder = folder_of(workdir, size)
        baseline = max(r["baseline"] for r in result["ranks"])
        planned = planner_peaks(folder, strategy, baseline, result["seq"], 2)
        base = base_bytes(folder)
        for phase in PHASES:
            peaks = _peaks(result, phase)
            if not peaks:
                continue
            measured, plan = max(peaks), planned[phase] / MIB
            theory_cells, full = "— | —", ""
            if phase == "load":
                theory = theory_load(base, baseline * MIB, strategy, 2) / MIB
                theory_cells = f"{theory:,.0f} | {measured / theory:.2f}"
                if measured / theory > THEORY_TARGET:
                    misses.append(f"{size} {strategy} load: {measured / theory:.2f}x theory")
                full_peaks = _peaks(results.get(f"{size}/{strategy}/lora", {}), "load")
                full = " / ".join(f"{p:,.0f}" for p in full_peaks) or "not run"
            error = max(abs(p - plan) / p for p in peaks)
            if error > PLANNER_TARGET:
                misses.append(f"{size} {strategy} {phase}: planner {error:.1%} off")
            lines.append(
                f"| {size} | {strategy} | {phase} | {' / '.join(f'{p:,.0f}' for p in peaks)} | {theory_cells} | "
                f"{plan:,.0f} | {measured / plan:.2f} | {full} |"
            )
    lines += [
        "",
        "Targets missed (load <= 1.1x theory; planner error = |measured - planner| / measured of the worse rank "
        "<= 10 %): " + ("; ".join(misses) or "none") + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["250m", "1b"], choices=[s for s in SIZES if s != "moe-400m"])
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
    section = render(results, args.workdir, args.steps, args.seq)
    print(section)
    if args.write_docs:
        write_docs(section)


def write_docs(section: str) -> None:
    """Replace this script's section of docs/benchmarks.md (the first time: before the History section)."""
    DOCS.write_text(replace_section_before_history(DOCS.read_text() if DOCS.exists() else "", SECTION, section))


if __name__ == "__main__":
    main()
