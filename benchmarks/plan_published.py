"""The planner's step-time model against measured GPU runs: issue 47's one-H200 rows and published multi-GPU runs of
other projects; then what it predicts for the spec's DDP scaling and for the bundled shapes on 8 GPUs and 2-64 nodes.

Pure arithmetic (no torch, seconds to run): it writes the "Step time: validation" section of docs/planner.md.

    python benchmarks/plan_published.py            # print the section
    python benchmarks/plan_published.py --write    # and replace it in docs/planner.md

The compute efficiency is calibrated once, on the plain PyTorch loop's H200 row (planner.machines); every other row
is a prediction. Other projects' kernels reach another fraction of the peak (llm-foundry's MPT runs 46 % MFU where
the plain loop reaches 31 %), so for them the table also shows the scaling prediction: the project's efficiency set
from its own one-node row (``--compute_efficiency``, as a user would), the larger runs predicted.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from docs_section import replace_section

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, Setup
from gym_lightning.planner.machines import Figures, calibrated_compute_efficiency, machine
from gym_lightning.planner.report import plan
from gym_lightning.planner.timing import Speed, speed

DOC = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
HEADING = "## Step time: validation"
# MPT has a 4h GELU MLP (2 matrices) and multi-head attention; the planner's shapes are SwiGLU (3 matrices), so the
# MLP width is 2/3 of 4h: the same parameters, bytes and FLOPs (MPT-7B 6.65B here, 6.66B on its card).
MPT_7B = ModelShape("mpt-7b", 4096, 2 * 4 * 4096 // 3, 32, 32, 32, 128, 50432, True)
MPT_13B = ModelShape("mpt-13b", 5120, 2 * 4 * 5120 // 3, 40, 40, 40, 128, 50432, True)
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"


@dataclass(frozen=True)
class Run:
    """One measured run and how to plan it."""

    name: str
    shape: ModelShape
    strategy: str
    gpu: str
    interconnect: str | None
    gpus: int
    micro_batch: int
    seq_length: int
    measured: float  # tokens/s per GPU
    source: str
    checkpointing: bool = False
    accumulation: int = 1
    figures: Figures = field(default_factory=Figures)
    calibrate_on: str | None = None  # the one-node run whose measured speed sets this project's efficiency


def predict(run: Run, efficiency: float | None = None) -> Speed:
    """The model's prediction for ``run`` (at ``efficiency`` of the peak when given, else the calibrated one)."""
    nodes = max(1, run.gpus // 8)
    figures = replace(run.figures, compute_efficiency=efficiency) if efficiency else run.figures
    hw = machine("bf16-mixed", nodes, run.gpu, run.interconnect, figures).hardware
    setup = Setup(
        gpus_per_node=min(run.gpus, 8),
        nodes=nodes,
        micro_batch_size=run.micro_batch,
        seq_length=run.seq_length,
        activation_checkpointing=run.checkpointing,
        accumulate_grad_batches=run.accumulation,
    )
    return speed(run.shape, STRATEGY_BY_KEY[run.strategy], setup, hw)


def h200_rows() -> list[Run]:
    """Issue 47's table: one H200, Qwen3-1.7B shape, micro-batch 4 x 2048, bf16 autocast over fp32, world size 1."""
    shape, issue = resolve_shape("qwen3-1.7b"), "issue 47 (one H200, main 61fe4d1)"
    rows = [
        ("plain PyTorch loop (calibration)", "ddp", 25_764),
        ("transformers.Trainer", "ddp", 24_503),
        ("gym_fsdp", "fsdp_full", 24_515),
        ("Lightning FSDPStrategy", "fsdp_full", 24_487),
        ("gym_ddp (DDP wrapper on one GPU, before issue 47)", "ddp", 22_212),
        ("gym zero3 (before issue 47's settings rule)", "zero3", 12_460),
        ("Lightning DeepSpeedStrategy(stage=3)", "zero3", 10_491),
    ]
    return [Run(name, shape, key, "h200", None, 1, 4, 2048, tps, issue) for name, key, tps in rows]


# (name, shape key, GPU, interconnect, GPUs, micro-batch, sequence, tokens/s per GPU, source, activation
# checkpointing, the one-node row that sets the project's efficiency). Sources and settings: docs/planner.md.
PUBLISHED: tuple[tuple[str, str, str, str, int, int, int, int, str, bool, str | None], ...] = (
    ("torchtitan Llama 3.1 8B FSDP, 8 H100", "llama-3-8b", "h100", "roce-400", 8, 2, 8192, 5_762, TORCHTITAN, False,
     None),
    ("torchtitan Llama 3.1 8B FSDP, 128 H100", "llama-3-8b", "h100", "roce-400", 128, 2, 8192, 5_605, TORCHTITAN,
     False, "torchtitan Llama 3.1 8B FSDP, 8 H100"),
    *(
        (f"llm-foundry MPT-7B FSDP, {n} H100", "mpt-7b", "h100", "ib-ndr400", n, 6, 2048, tps, FOUNDRY, False,
         None if n == 8 else "llm-foundry MPT-7B FSDP, 8 H100")
        for n, tps in ((8, 10_643), (128, 10_475), (256, 10_119), (512, 9_670))
    ),
    *(
        (f"llm-foundry MPT-13B FSDP, {n} H100", "mpt-13b", "h100", "ib-ndr400", n, 2, 2048, tps, FOUNDRY, False,
         None if n == 8 else "llm-foundry MPT-13B FSDP, 8 H100")
        for n, tps in ((8, 4_792), (16, 4_767), (32, 4_811), (64, 4_800))
    ),
    *(
        (f"llm-foundry MPT-7B FSDP + AC, {n} A100-40GB", "mpt-7b", "a100-40gb", "roce-200", n, 16 if n == 16 else 18,
         2048, tps, FOUNDRY, True, None if n == 16 else "llm-foundry MPT-7B FSDP + AC, 16 A100-40GB")
        for n, tps in ((16, 3_645), (32, 3_725), (64, 3_665), (128, 3_623))
    ),
)  # fmt: skip


def published_rows() -> list[Run]:
    """Other projects' measured runs (:data:`PUBLISHED`). torchtitan's H100s are 96 GB HBM2e parts at 2.4 TB/s and
    500 W (its MFU still divides by 989 TFLOP/s) on 400 Gb/s RDMA per GPU (Meta's RoCE); its selective activation
    checkpointing keeps the matmuls' outputs, planned as no recompute."""
    shapes = {"mpt-7b": MPT_7B, "mpt-13b": MPT_13B, "llama-3-8b": resolve_shape("llama-3-8b")}
    rows = []
    for name, shape, gpu, link, gpus, mb, seq, tps, source, checkpointing, calibrate_on in PUBLISHED:
        figures = Figures(memory_bandwidth_gbs=2400) if source == TORCHTITAN else Figures()
        rows.append(
            Run(name, shapes[shape], "fsdp_full", gpu, link, gpus, mb, seq, tps, source, checkpointing, 1, figures,
                calibrate_on)
        )  # fmt: skip
    return rows


def project_efficiency(run: Run, by_name: dict[str, Run]) -> float | None:
    """The efficiency at which the model reproduces ``run.calibrate_on``'s measured speed (None without one)."""
    if run.calibrate_on is None:
        return None
    base = by_name[run.calibrate_on]
    return calibrated_compute_efficiency() * base.measured / predict(base).tokens_per_second_per_gpu


def validation_table(rows: list[Run]) -> list[str]:
    by_name = {r.name: r for r in rows}
    lines = [
        "| run | measured tok/s/GPU | predicted (calibrated on the plain loop) | error | predicted (project's own "
        "one-node row sets its efficiency) | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        absolute = predict(r).tokens_per_second_per_gpu
        efficiency = project_efficiency(r, by_name)
        relative = predict(r, efficiency).tokens_per_second_per_gpu if efficiency else None
        cells = [f"{r.name}", f"{r.measured:,}", f"{absolute:,.0f}", f"{absolute / r.measured - 1:+.1%}"]
        cells += (
            [f"{relative:,.0f} (at {efficiency:.1%})", f"{relative / r.measured - 1:+.1%}"] if relative else ["", ""]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ddp_scaling() -> list[str]:
    """Predicted DDP speed-up on 2 / 4 / 8 GPUs of one node: where the spec's 1.9x / 3.7x / 7.2x hold."""
    lines = ["| model, micro-batch | GPUs and link | 2 GPUs | 4 GPUs | 8 GPUs |", "|---|---|---:|---:|---:|"]
    cases = [
        ("qwen3-1.7b", 4, 2048, "h100", None),
        ("qwen3-1.7b", 4, 2048, "a100", None),
        ("qwen3-1.7b", 4, 2048, "l40s", None),
        ("qwen3-1.7b", 1, 2048, "rtx-4090", None),
        ("qwen3-0.6b", 1, 2048, "rtx-4090", None),
        ("llama-3.2-1b", 1, 2048, "rtx-4090", "pcie3"),
    ]
    for model, mb, seq, gpu, link in cases:
        shape, cells = resolve_shape(model), []
        hw_name = ""
        for gpus in (2, 4, 8):
            found = machine("bf16-mixed", 1, gpu, link)
            hw_name = found.hardware.name
            setup = Setup(gpus_per_node=gpus, micro_batch_size=mb, seq_length=seq)
            result = speed(shape, STRATEGY_BY_KEY["ddp"], setup, found.hardware)
            cells.append(f"{gpus * result.scaling:.2f}x")
        lines.append(f"| {model}, {mb} x {seq} | {hw_name} | " + " | ".join(cells) + " |")
    return lines


def bundled_predictions() -> list[str]:
    """The recommended strategy's tokens/s per GPU for the bundled dense shapes, full finetune, micro-batch 1 x 4096,
    activation checkpointing, on 8 x H100 / 8 x H200 and 2-64 nodes of 8 H100 (InfiniBand NDR 400)."""
    columns = [("8 x H100", "h100", 1), ("8 x H200", "h200", 1)] + [(f"{n} nodes", "h100", n) for n in (2, 8, 64)]
    lines = ["| model | " + " | ".join(c[0] for c in columns) + " |", "|---|" + "---:|" * len(columns)]
    for model in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3-8b", "qwen3-32b", "llama-3-70b"):
        cells = []
        for _, gpu, nodes in columns:
            report = plan(
                model,
                gpus_per_node=8,
                nodes=nodes,
                gpu=gpu,
                seq_length=4096,
                activation_checkpointing=True,
                interconnect="ib-ndr400" if nodes > 1 else None,
            )
            best = report.recommendation
            found = dict(zip((e.strategy.key for e in report.estimates), report.speeds(), strict=True))
            result = found.get(best.strategy.key) if best else None
            cells.append(
                "nothing fits"
                if result is None or best is None
                else f"{result.tokens_per_second_per_gpu:,.0f} ({best.strategy.label}, {result.mfu:.0%})"
            )
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def section() -> str:
    efficiency = calibrated_compute_efficiency()
    parts = [
        HEADING,
        "",
        "Written by `python benchmarks/plan_published.py --write` (pure arithmetic). The compute efficiency is "
        f"calibrated on the plain loop's row alone: {efficiency:.1%} of the H200's dense bf16 peak.",
        "",
        "### One H200 (issue 47's rows)",
        "",
        *validation_table(h200_rows()),
        "",
        "Within 15 %: the plain loop (the calibration), transformers.Trainer, gym_fsdp and Lightning's FSDP (the model "
        "has nothing to move on one GPU; the 5 % they lose is host-side work per step it does not contain). Outside: "
        "gym_ddp's row was measured with a DDP wrapper and its bucket copy on one GPU, which issue 47 removed (the "
        "model predicts the code as it is now; the new row is owed to the next GPU run), and the ZeRO-3 rows, "
        "measured before ZeRO's settings rule: one GPU moves nothing on the wire, yet ZeRO-3 added 0.34 s per step. "
        "The likely cause is DeepSpeed's per-module fetch and release hooks with their stream waits, host-side work a "
        "bytes model cannot see; issue 47's rule cut those hooks 9x (323 -> 35 fetch calls per step, measured on 2 CPU "
        "ranks). The rows under the rule are owed to `bash benchmarks/gpu.sh --part bench`.",
        "",
        "### Published multi-GPU runs of other projects",
        "",
        *validation_table(published_rows()),
        "",
        f"Sources: torchtitan, {TORCHTITAN} (Llama 3.1 8B, FSDP2, sequence 8192, local batch 2, selective activation "
        "checkpointing, bf16, no compile; 96 GB HBM2e H100s at 500 W, 400 Gb/s RDMA per GPU); llm-foundry, "
        f"{FOUNDRY} (MPT-7B / 13B, FSDP FULL_SHARD, amp_bf16, sequence 2048; H100 80 GB, interconnect not named: "
        "InfiniBand NDR 400 assumed; A100 40 GB on 8 x 200 Gb/s RoCE with activation checkpointing).",
        "",
        "Calibrated on the plain loop alone, the model predicts torchtitan's one-node run within 7 % and its 16-node "
        "run within 5 %. llm-foundry's kernels reach 40-67 % of the peak where the plain loop reaches 31.5 %, so its "
        "absolute rows are 21-54 % low: the efficiency is the project's, and `--compute_efficiency` is how a user "
        "states it. Set from each project's one-node (or smallest) row, the model predicts every larger run within "
        "11 % (scaling to 512 GPUs): it loses nothing across nodes where the runs lost 3-9 % at 128-512 GPUs "
        "(stragglers and ring latency grow with the job; the model's latency term grows with log2 of the nodes).",
        "",
        "### DDP on 2 / 4 / 8 GPUs of one node (the spec's 1.9x / 3.7x / 7.2x)",
        "",
        *ddp_scaling(),
        "",
        "No published source for the spec's factors was found (the nearest: PaddlePaddle DeepSpeech2 on V100, 1.98x / "
        "3.73x / 6.95x). In the model, DDP's all-reduce of a 0.6-1.7B model hides behind backward on NVLink (8.0x on "
        "H100 and A100) and almost on an 8-GPU PCIe 4 box of L40S (7.5x at 8): there the spec's factors are a lower "
        "bound, since the model leaves out the compute that collectives slow down by sharing the SMs. On RTX 4090s "
        "(PCIe 4 without peer-to-peer, about 20 GB/s bus bandwidth, assumed) it predicts 5-5.8x at 8 GPUs: the spec's "
        "7.2x does not hold there. So 1.9x / 3.7x / 7.2x hold for models up to about 2B on NVLink or PCIe 4 boxes of "
        "data-centre cards, micro-batches of 4 x 2048 tokens, not on consumer cards.",
        "",
        "### The bundled shapes: the recommended strategy's tokens/s per GPU (and MFU)",
        "",
        "Full finetune, bf16-mixed, AdamW, micro-batch 1 x 4096, activation checkpointing; nodes of 8 H100 SXM on "
        "InfiniBand NDR 400.",
        "",
        *bundled_predictions(),
    ]
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"replace the section in {DOC}")
    args = parser.parse_args()
    text = section()
    sys.stdout.write(text)
    if args.write:
        DOC.write_text(replace_section(DOC.read_text(), HEADING, text))


if __name__ == "__main__":
    main()
