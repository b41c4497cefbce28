"""Peak host memory per rank of a training step at long sequences, with and without sequence parallelism, beside the
planner.

    python -m benchmarks.long_sequence_peak                    # every run below at 4,096 tokens (~15 min, 2 cores)
    python -m benchmarks.long_sequence_peak --seq 8192 --runs zero3-sp2-tiled
    python -m benchmarks.long_sequence_peak --render-only --write-docs

A 44M-parameter Llama-shaped folder (``benchmarks.common.models.SIZES["long-44m"]``: width 512, 8 layers, 8 query /
4 key-value heads, 32,000 tied vocabulary; built once under ``--workdir``) is trained by the real CLI on 2 CPU ranks
in fp32 (``32-true``: bf16 matmuls take a slow path on this AVX2-only CPU, ``scale.py``), one packed row of
``--seq`` tokens of the bundled data per micro-batch, 2 optimizer steps, with ``scale.PhasePeaks`` recording each
rank's peak resident memory per phase. Each run is one line of ``RUNS``: the strategy, the sequence-parallel size
(1: each rank trains its own row of ``--seq`` tokens; 2: the two ranks share one row, ``--seq``/2 tokens each), and
whether the module checkpoints activations and tiles the MLP (``mlp_tile_tokens`` 512). The table puts the step peak
beside ``gym_lightning.planner.phases.phase_peaks`` with the same settings and the measured baseline
(``accelerator="cpu"``: every byte is host memory), and the activation share: (step peak - the same strategy's load
peak), the part the sequence length drives.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.models import ensure_folder, folder_of
from benchmarks.common.paths import MIB
from benchmarks.scale import PLANNER_KEYS, fit_command, planner_setup, run_cli

SECTION = "## Long sequences: peak memory per rank with sequence parallelism"
# ``--probe-packed-mask`` on this machine (MiB; see ``mask_probe``), quoted under the table.
PROBE_SEQ = 4096
PROBE_FIGURES = {"single": 3100, "packed": 3712}
SIZE = "long-44m"
TILE = 512
STRATEGY_CLASSES = {
    "zero3": ("gym_lightning.strategies.ZeROStrategy", {"stage": 3}),
    "gym_fsdp": ("gym_lightning.strategies.GymFSDPStrategy", {}),
}
# name: (strategy, sequence_parallel_size, activation checkpointing + tiled MLP)
RUNS: dict[str, tuple[str, int, bool]] = {
    "zero3-sp1": ("zero3", 1, False),
    "zero3-sp2": ("zero3", 2, False),
    "zero3-sp1-tiled": ("zero3", 1, True),
    "zero3-sp2-tiled": ("zero3", 2, True),
    "gym_fsdp-sp1": ("gym_fsdp", 1, False),
    "gym_fsdp-sp2": ("gym_fsdp", 2, False),
}


def command(folder: Path, name: str, run: Path, steps: int, seq: int) -> list[str]:
    """``scale.fit_command`` in fp32 with the run's strategy class, sequence-parallel size and memory settings."""
    strategy, size, tiled = RUNS[name]
    class_path, init_args = STRATEGY_CLASSES[strategy]
    base = fit_command(folder, strategy, run, steps, seq)
    base = [a if a != "bf16-mixed" else "32-true" for a in base]
    index = base.index("--trainer.strategy")
    strategy_json = {"class_path": class_path, "init_args": {**init_args, "sequence_parallel_size": size}}
    base[index + 1] = json.dumps(strategy_json)
    extra = ["--model.attn_implementation", "sdpa", "--model.torch_dtype", "float32"]
    if tiled:
        extra += ["--model.gradient_checkpointing", "true", "--model.mlp_tile_tokens", str(TILE)]
    return base + extra


def planner_step(folder: Path, name: str, baseline_mib: float, seq: int) -> dict[str, float]:
    """The planner's load and step peaks (host bytes per rank) for the run's settings."""
    from gym_lightning.planner import resolve_shape
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY
    from gym_lightning.planner.phases import phase_peaks

    strategy, size, tiled = RUNS[name]
    setup = replace(
        planner_setup(folder, baseline_mib, seq),
        precision="32-true",
        sequence_parallel_size=size,
        activation_checkpointing=tiled,
        mlp_tile_tokens=TILE if tiled else 0,
    )
    peaks = phase_peaks(resolve_shape(str(folder)), STRATEGY_BY_KEY[PLANNER_KEYS[strategy]], setup).by_phase()
    return {phase: peaks[phase].host for phase in ("load", "step")}


def mask_probe(folder: Path, seq: int, packed: bool) -> float:
    """MiB by which one process's peak RSS grows in a forward + backward of one ``seq``-token row through plain
    transformers (sdpa, fp32): one sequence, or packed documents of 12 tokens (a block-diagonal mask, as
    ``data.collate`` packs). Run in its own process per case (``--probe-packed-mask``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common.memory import peak_rss

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, seq))
    positions = torch.arange(seq) % 12 if packed else torch.arange(seq)
    before = peak_rss()
    model(input_ids=ids, position_ids=positions[None], labels=ids, use_cache=False).loss.backward()
    return (peak_rss() - before) / 2**20


def render(results: dict[str, Any], workdir: Path, steps: int) -> str:
    """The markdown section: one row per run."""
    lines = [
        SECTION, "",
        f"`python -m benchmarks.long_sequence_peak` (2 CPU ranks, fp32, 1 packed row per micro-batch, {steps} "
        f"optimizer steps, the real CLI; see the script's docstring). sp = `sequence_parallel_size`; tiled = "
        f"`gradient_checkpointing: true` + `mlp_tile_tokens: {TILE}`. Peak resident memory per rank in the training "
        "step, MiB (rank 0 / rank 1); activations = step peak - load peak of the same run; planner = "
        "`planner.phases.phase_peaks` with the measured baseline and the same settings.",
        "",
        "| run | tokens per row | tokens per rank | step peak (r0 / r1) | planner step | planner error | "
        "activations measured | activations planned |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    misses = []
    for name, result in results.items():
        if "ranks" not in result:
            lines.append(f"| {name} | | | failed (exit {result['failed']}) | | | | |")
            continue
        folder, seq = folder_of(workdir, SIZE), result["seq"]
        baseline = max(r["baseline"] for r in result["ranks"])
        planned = {k: v / MIB for k, v in planner_step(folder, name, baseline, seq).items()}
        steps_peak = [r["step"]["peak"] for r in result["ranks"]]
        load_peak = max(r["load"]["peak"] for r in result["ranks"])
        error = max(abs(p - planned["step"]) / p for p in steps_peak)
        if error > 0.10:
            misses.append(f"{name}: {error:.1%}")
        lines.append(
            f"| {name} | {seq:,} | {seq // RUNS[name][1]:,} | {' / '.join(f'{p:,.0f}' for p in steps_peak)} | "
            f"{planned['step']:,.0f} | {error:.1%} | {max(steps_peak) - load_peak:,.0f} | "
            f"{planned['step'] - planned['load']:,.0f} |"
        )
    lines += [
        "", "Planner error above 10 % of the measured step peak: " + ("; ".join(misses) or "none") + ".", "",
        "The rows are packed documents of the bundled data (about 12 tokens each). Without sequence parallelism "
        "transformers keeps them apart with a dense block-diagonal `[L, L]` mask, and sdpa with a mask keeps more "
        "for backward than the planner's mask-free attention: `--probe-packed-mask` measured one forward + "
        f"backward of a {PROBE_SEQ:,}-token row in one process (sdpa, fp32, 8 layers) at "
        f"{PROBE_FIGURES['single']:,} MiB as one sequence and {PROBE_FIGURES['packed']:,} MiB as packed documents, "
        f"{(PROBE_FIGURES['packed'] - PROBE_FIGURES['single']) / 8:,.0f} MiB more per layer. That is of the size "
        "of the uncheckpointed sp = 1 rows' excess over the planner; with activation checkpointing one layer's "
        "worth exists at a time, inside the planner's error. Under sequence parallelism the exchange attends each "
        "document on its own (no mask), so the sp = 2 rows do not pay it.",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per packed row (micro-batch 1)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-scale")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from earlier results")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--probe-packed-mask", choices=["single", "packed"], help="one process: see mask_probe")
    args = parser.parse_args()
    if args.probe_packed_mask:
        mib = mask_probe(ensure_folder(args.workdir, SIZE), PROBE_SEQ, args.probe_packed_mask == "packed")
        return print(f"{args.probe_packed_mask}: peak RSS grew {mib:,.0f} MiB")
    results_file = args.workdir / "long_sequence_results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if not args.render_only:
        folder = ensure_folder(args.workdir, SIZE)
        for name in args.runs:
            print(f"{name} at {args.seq} tokens ...", file=sys.stderr, flush=True)
            run = args.workdir / "runs" / f"long-{name}"
            results[name] = run_cli(args.workdir, f"long-{name}", command(folder, name, run, args.steps, args.seq),
                                    args.steps, args.seq)  # fmt: skip
            results_file.write_text(json.dumps(results, indent=1))
    section = render(results, args.workdir, args.steps)
    print(section)
    if args.write_docs:
        write_section(SECTION, section)


if __name__ == "__main__":
    main()
