"""Published training runs the planner's step-time model is checked against (data only; ``plan_published.py`` uses
them). Each row: the project, its cluster, the model's shape, GPUs, micro-batch, sequence, accumulation, activation
checkpointing, strategy, kernel path, the measured tokens/s per GPU, and the table it comes from. ``role`` names the
few rows that calibrate something (``efficiency``: the project's kernel efficiency on that GPU; ``compiled``:
torch.compile's share of the eager elementwise bytes; ``scaling``: the fabric's latency per ring step);
every other row is a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.catalog import resolve_shape
from gym_lightning.planner.machines import Figures

FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"
TITAN_H100 = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_A100 = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
FMS = "https://pytorch.org/blog/maximizing-training/ (IBM and Meta, 2024-03-13; the fms-fsdp repository)"
GYM = "issue 47's one-H200 table (docs/benchmarks-history.md)"


def mpt(d_model: int, layers: int, heads: int) -> ModelShape:
    """An MPT model as the planner's shape: a 4h GELU MLP has the parameters, bytes and FLOPs of a SwiGLU of width
    ``8h/3``; multi-head attention; the 50,368-entry vocabulary tied (MPT-7B: 6.65B here, 6.66B on its card)."""
    return ModelShape(f"mpt-{d_model}x{layers}", d_model, 8 * d_model // 3, layers, heads, heads, d_model // heads,
                      50368, True)  # fmt: skip


def llama2(h: int, inter: int, layers: int, heads: int, kv: int) -> ModelShape:
    return ModelShape(f"llama2-{h}x{layers}", h, inter, layers, heads, kv, h // heads, 32000, False)


SHAPES: dict[str, ModelShape] = {
    "mpt-125m": mpt(768, 12, 12),
    "mpt-350m": mpt(1024, 24, 16),
    "mpt-760m": mpt(1536, 24, 12),
    "mpt-1b": mpt(2048, 24, 16),
    "mpt-3b": mpt(2560, 32, 20),
    "mpt-7b": mpt(4096, 32, 32),
    "mpt-13b": mpt(5120, 40, 40),
    "mpt-30b": mpt(7168, 48, 64),
    "mpt-70b": mpt(8192, 80, 64),
    "llama2-7b": llama2(4096, 11008, 32, 32, 32),
    "llama2-13b": llama2(5120, 13824, 40, 40, 40),
    "llama2-34b": llama2(8192, 22016, 48, 64, 8),
    "llama2-70b": llama2(8192, 28672, 80, 64, 8),
    "llama3-8b": resolve_shape("llama-3-8b"),
    "llama3-70b": resolve_shape("llama-3-70b"),
    "qwen3-1.7b": resolve_shape("qwen3-1.7b"),
}


@dataclass(frozen=True)
class Cluster:
    """Where a project ran: the catalog GPU and interconnect, and figures the catalog lacks."""

    gpu: str
    interconnect: str | None
    figures: Figures = field(default_factory=Figures)
    note: str = ""


CLUSTERS: dict[str, Cluster] = {
    "foundry-h100": Cluster("h100", "ib-ndr400", note="H100 80GB; the interconnect is not named: NDR 400 assumed"),
    "foundry-a100-80": Cluster("a100-80gb", "roce-200", note="A100 80GB, 1600 Gbps RoCE per node"),
    "foundry-a100-40": Cluster("a100-40gb", "roce-200", note="A100 40GB, 1600 Gbps RoCE per node"),
    "titan-h100": Cluster(
        "h100", "roce-400", Figures(memory_bandwidth_gbs=2400), "96 GB HBM2e H100s at 500 W, 400 Gb/s RDMA per GPU"
    ),
    "titan-a100": Cluster("a100-80gb", "ib-hdr200", note="64 A100 80GB; the interconnect is not named: HDR assumed"),
    "fms-a100": Cluster(
        "a100-80gb", "roce-400", Figures(inter_node_bandwidth_gbs=40), "400 Gbps per node, GPUDirect RDMA"
    ),
    "fms-h100": Cluster("h100", "roce-400", Figures(inter_node_bandwidth_gbs=80), "800 Gbps per node"),
    "gym-h200": Cluster("h200", None, note="one H200, torch 2.11 + cu130"),
}


@dataclass(frozen=True)
class Run:
    """One measured run (see the module docstring)."""

    project: str
    cluster: str
    model: str
    gpus: int
    micro_batch: int
    seq: int
    measured: float
    source: str
    accumulation: int = 1
    checkpointing: bool = False
    strategy: str = "fsdp_full"
    kernels: str = "eager"
    role: str = ""
    note: str = ""

    @property
    def series(self) -> tuple[object, ...]:
        """Runs that differ only in their GPU count: a scaling curve."""
        setting = (self.micro_batch, self.seq, self.accumulation, self.checkpointing, self.strategy, self.kernels)
        return (self.project, self.cluster, self.model, *setting)

    @property
    def name(self) -> str:
        parts = [f"{self.project} {self.model}", f"{self.gpus} x {self.cluster.split('-', 1)[1]}"]
        parts.append(f"{self.micro_batch} x {self.seq}" + (f" x{self.accumulation}" if self.accumulation > 1 else ""))
        extra = [x for x in (self.strategy.replace("fsdp_", ""), self.kernels) if x not in ("full", "eager")]
        extra += ["AC"] if self.checkpointing else []
        return ", ".join(parts + extra)


def _foundry(cluster: str, rows: list[tuple[object, ...]]) -> list[Run]:
    """llm-foundry rows: (model, GPUs, micro-batch, sequence, accumulation, checkpointing, strategy, tok/s/GPU).
    MPT's layers run fused kernels (``low_precision_layernorm``: one ``F.layer_norm`` kernel in 16 bits, where
    Hugging Face's RMSNorm makes seven fp32 passes; flash attention), planned as the fused ("liger") path."""
    found = []
    for model, gpus, mb, seq, ga, ac, strategy, tps, *role in rows:
        found.append(Run("llm-foundry", cluster, f"mpt-{model}", gpus, mb, seq, tps, FOUNDRY, ga, ac, strategy,  # type: ignore[arg-type]
                         "liger", role=role[0] if role else ""))  # fmt: skip
    return found


F, G = "fsdp_full", "fsdp_grad_op"
# llm-foundry's "H100 80GB BF16 (Large Scale, >= 128 GPUs)" and "H100 80GB BF16" tables, seq 2048 unless given.
FOUNDRY_H100 = _foundry("foundry-h100", [
    ("70b", 512, 8, 2048, 1, True, F, 1007), ("70b", 256, 8, 2048, 1, True, F, 1035),
    ("70b", 128, 8, 2048, 1, True, F, 1058),
    ("30b", 512, 8, 2048, 1, True, F, 2115), ("30b", 256, 8, 2048, 1, True, F, 2148),
    ("30b", 128, 8, 2048, 1, True, F, 2199),
    ("13b", 512, 16, 2048, 1, True, F, 4952), ("13b", 256, 16, 2048, 1, True, F, 4989),
    ("13b", 128, 16, 2048, 1, True, F, 5080),
    ("7b", 512, 6, 2048, 1, False, F, 9670, "scaling"), ("7b", 256, 6, 2048, 1, False, F, 10119),
    ("7b", 128, 6, 2048, 1, False, F, 10475), ("7b", 8, 6, 2048, 1, False, F, 10643, "efficiency"),
    ("3b", 512, 8, 2048, 1, False, G, 21664), ("3b", 256, 8, 2048, 1, False, G, 22772),
    ("3b", 128, 8, 2048, 1, False, G, 23422),
    ("1b", 512, 12, 2048, 1, False, G, 39837), ("1b", 256, 12, 2048, 1, False, G, 42555),
    ("1b", 128, 12, 2048, 1, False, G, 44123),
    ("13b", 64, 2, 2048, 1, False, F, 4800), ("13b", 32, 2, 2048, 1, False, F, 4811),
    ("13b", 16, 2, 2048, 1, False, F, 4767), ("13b", 8, 2, 2048, 1, False, F, 4792),
    ("3b", 64, 6, 2048, 3, False, F, 22525), ("3b", 32, 6, 2048, 3, False, F, 23021),
    ("1b", 64, 20, 2048, 1, False, F, 44402), ("1b", 32, 20, 2048, 1, False, F, 45130),
    ("1b", 16, 20, 2048, 1, False, F, 46037),
    ("760m", 32, 24, 2048, 1, False, F, 67971), ("760m", 16, 24, 2048, 1, False, F, 68551),
    ("1b", 8, 14, 2048, 1, False, F, 45455), ("760m", 8, 24, 2048, 2, False, F, 63147),
    ("30b", 8, 3, 2048, 21, True, F, 2002), ("3b", 16, 10, 2048, 3, False, F, 24142),
    ("7b", 8, 16, 4096, 2, True, F, 8611), ("7b", 8, 8, 8192, 2, True, F, 6935),
    ("1b", 8, 7, 4096, 4, False, F, 38535), ("1b", 8, 3, 8192, 4, False, F, 29157),
])  # fmt: skip
# llm-foundry's "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" table: 8 GPUs, every size.
FOUNDRY_A100_80 = _foundry("foundry-a100-80", [
    ("7b", 8, 6, 2048, 2, False, F, 4641, "efficiency"), ("125m", 8, 40, 2048, 2, False, F, 142830),
    ("350m", 8, 32, 2048, 2, False, F, 58782), ("760m", 8, 24, 2048, 2, False, F, 32434),
    ("1b", 8, 14, 2048, 4, False, F, 20513), ("3b", 8, 10, 2048, 2, False, F, 10811),
    ("13b", 8, 2, 2048, 3, False, F, 2262), ("30b", 8, 3, 2048, 21, True, F, 916),
    ("7b", 8, 16, 4096, 2, True, F, 3684), ("3b", 8, 5, 4096, 6, False, F, 9457),
    ("1b", 8, 7, 4096, 4, False, F, 17807), ("350m", 8, 16, 4096, 2, False, F, 49555),
])  # fmt: skip
# llm-foundry's "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" table.
FOUNDRY_A100_40 = _foundry("foundry-a100-40", [
    ("7b", 16, 16, 2048, 1, True, F, 3645, "efficiency"), ("7b", 32, 18, 2048, 1, True, F, 3725),
    ("7b", 64, 18, 2048, 1, True, F, 3665), ("7b", 128, 18, 2048, 1, True, F, 3623),
    ("13b", 16, 10, 2048, 1, True, F, 1993), ("13b", 32, 14, 2048, 1, True, F, 1998),
    ("13b", 64, 16, 2048, 1, True, F, 1976), ("13b", 128, 16, 2048, 1, True, F, 1972),
    ("30b", 128, 6, 2048, 1, True, F, 865), ("30b", 32, 4, 2048, 1, True, F, 857),
])  # fmt: skip
TORCHTITAN = [
    Run("torchtitan", "titan-h100", "llama3-8b", 8, 2, 8192, 5762, TITAN_H100 + " Table 1", role="efficiency",
        note="selective AC (planned without recompute)"),
    Run("torchtitan", "titan-h100", "llama3-8b", 128, 2, 8192, 5605, TITAN_H100 + " Table 3"),
    Run("torchtitan", "titan-h100", "llama3-8b", 8, 2, 8192, 6667, TITAN_H100 + " Table 1", kernels="compiled",
        role="compiled"),
    Run("torchtitan", "titan-h100", "llama3-8b", 128, 2, 8192, 6514, TITAN_H100 + " Table 3", kernels="compiled"),
    Run("torchtitan", "titan-a100", "llama3-8b", 64, 1, 8192, 2973, TITAN_A100 + " Llama 3", role="efficiency",
        note="selective op AC (planned without recompute)"),
    Run("torchtitan", "titan-a100", "llama3-70b", 64, 1, 8192, 331, TITAN_A100 + " Llama 3", checkpointing=True),
    Run("torchtitan", "titan-a100", "llama2-13b", 64, 2, 4096, 2162, TITAN_A100 + " Llama 2"),
    Run("torchtitan", "titan-a100", "llama2-70b", 64, 2, 4096, 353, TITAN_A100 + " Llama 2", checkpointing=True),
]  # fmt: skip
FMS_RUNS = [
    Run("fms-fsdp", "fms-a100", "llama2-7b", 128, 2, 4096, 3700, FMS + " Table 1", role="efficiency"),
    Run("fms-fsdp", "fms-a100", "llama2-13b", 128, 2, 4096, 1800, FMS + " Table 1", note="selective AC (none)"),
    Run("fms-fsdp", "fms-a100", "llama2-34b", 128, 2, 4096, 700, FMS + " Table 1", checkpointing=True),
    Run("fms-fsdp", "fms-a100", "llama2-70b", 128, 2, 4096, 370, FMS + " Table 1", checkpointing=True),
    Run("fms-fsdp", "fms-h100", "llama2-7b", 96, 2, 4096, 7500, FMS + " Table 1", role="efficiency"),
    Run("fms-fsdp", "fms-h100", "llama2-13b", 96, 2, 4096, 3800, FMS + " Table 1", note="selective AC (none)"),
    Run("fms-fsdp", "fms-h100", "llama2-34b", 96, 2, 4096, 1550, FMS + " Table 1", checkpointing=True),
    Run("fms-fsdp", "fms-h100", "llama2-70b", 96, 2, 4096, 800, FMS + " Table 1", checkpointing=True),
]  # fmt: skip
# This project's one-H200 rows (Qwen3-1.7B shape, micro-batch 4 x 2048, bf16 autocast over fp32 parameters).
GYM_H200 = [
    Run("gym", "gym-h200", "qwen3-1.7b", 1, 4, 2048, 25_764, GYM, strategy="ddp", role="efficiency",
        note="the plain PyTorch loop"),
    Run("gym", "gym-h200", "qwen3-1.7b", 1, 4, 2048, 24_503, GYM, strategy="ddp", note="transformers.Trainer"),
    Run("gym", "gym-h200", "qwen3-1.7b", 1, 4, 2048, 24_515, GYM, note="gym_fsdp"),
    Run("gym", "gym-h200", "qwen3-1.7b", 1, 4, 2048, 24_487, GYM, note="Lightning FSDPStrategy"),
    Run("gym", "gym-h200", "qwen3-1.7b", 1, 4, 2048, 12_460, GYM, strategy="zero3_modules",
        note="gym zero3 before issue 47's settings rule (a hook on every submodule)"),
    Run("gym", "gym-h200", "qwen3-1.7b", 1, 4, 2048, 10_491, GYM, strategy="zero3_modules",
        note="Lightning DeepSpeedStrategy(stage=3)"),
]  # fmt: skip
RUNS: list[Run] = [*FOUNDRY_H100, *FOUNDRY_A100_80, *FOUNDRY_A100_40, *TORCHTITAN, *FMS_RUNS, *GYM_H200]
