"""Planner: QLoRA (a frozen NF4 base + LoRA adapters): the 4-bit bytes per weight by hand and against the quant
package's own tensors, the 70B-on-8x24GB plan, QLoRA against LoRA, the load/step/export terms, and user errors.

The per-rank peaks are compared with measured QLoRA runs by benchmarks/qlora_peak.py (docs/planner.md, "Validation
against measured QLoRA peaks"), not here: they need 250M-1B models.
"""

from __future__ import annotations

import pytest
import torch

from gym_lightning.commands.plan import build_parser
from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner import BUNDLED, Setup, plan
from gym_lightning.planner.estimate import (
    NF4_BLOCK,
    NF4_CHUNK_BYTES,
    NF4_COMPUTE_BYTES,
    NF4_SCALE_BLOCK,
    STRATEGY_BY_KEY,
    dequant_bytes,
    model_states,
    nf4_tensors,
    param_counts,
    quantized_base,
)
from gym_lightning.planner.phases import PHASES, phase_peaks, qlora_peak
from gym_lightning.quant import nf4
from gym_lightning.quant.config import QuantizationArgs
from gym_lightning.quant.linear import NF4Linear

LLAMA_70B = BUNDLED["llama-3-70b"]
QLORA = Setup(gpus_per_node=8, lora_r=16, activation_checkpointing=True, quantization="nf4")
LORA = Setup(gpus_per_node=8, lora_r=16, activation_checkpointing=True)
# Per layer of Llama 3 70B (h 8192, kv 1024, I 28672): q, o 8192 x 8192; k, v 8192 -> 1024; gate, up 8192 -> 28672;
# down 28672 -> 8192: 855_638_016 weights, all with in % 64 == 0, so all in NF4; x 80 layers.
NF4_WEIGHTS_70B = 80 * 855_638_016


def test_constants_are_the_quant_packages() -> None:
    args = QuantizationArgs()
    assert (args.block_size, nf4.SCALE_BLOCK, 2) == (NF4_BLOCK, NF4_SCALE_BLOCK, NF4_COMPUTE_BYTES)
    assert args.double_quant and args.dtype == torch.bfloat16


@pytest.mark.parametrize(("fan_in", "fan_out"), [(8192, 1024), (28672, 8192), (64, 48), (16448, 3)])
def test_nf4_tensors_are_nf4linears_parameters(fan_in: int, fan_out: int) -> None:
    layer = NF4Linear(fan_in, fan_out, bias=False, device="meta")
    actual = {name: (p.numel(), p.element_size()) for name, p in layer.named_parameters()}
    assert actual == nf4_tensors(fan_in, fan_out)


def test_bytes_per_weight_by_hand_for_llama_3_70b() -> None:
    quant = quantized_base(LLAMA_70B, QLORA)
    assert quant.weights == NF4_WEIGHTS_70B and quant.largest_linear == 8192 * 28672
    # in = 8192: codes 1/2 B + 8-bit scales 1/64 B + int32 stats 4 x (1 + ceil(128/256)) per row = 8/8192 B
    q = 8192 * 8192 * (0.5 + 1 / 64) + 8192 * 4 * 2
    assert nf4_tensors(8192, 8192)["weight_scale_stats"] == (8192 * 2, 4)
    # down (in = 28672): 448 scales a row, 1 + ceil(448/256) = 3 stats a row
    down = 8192 * 28672 * (0.5 + 1 / 64) + 8192 * 4 * 3
    assert sum(n * b for n, b in nf4_tensors(28672, 8192).values()) == down
    assert sum(n * b for n, b in nf4_tensors(8192, 8192).values()) == q
    assert 8 * quant.bytes_per_weight == pytest.approx(4.13, abs=0.005)  # bitsandbytes' 4.127 bits


def test_seventy_b_qlora_fits_8x24gb_without_offload() -> None:
    report = plan("llama-3-70b", gpu_memory="24GB", lora_r=16, activation_checkpointing=True, quantization="nf4")
    by_key = {e.strategy.key: e for e in report.estimates}
    fitting = {key for key, e in by_key.items() if e.fits}
    assert {"fsdp_full", "zero3"} <= fitting
    # replicated 4-bit base (DDP, ZeRO-1/2: frozen parameters are not partitioned): 36.8 GiB on every GPU
    assert not ({"ddp", "zero1", "zero2", "fsdp_grad_op"} & fitting)
    assert all(not e.modelled for e in report.estimates if e.strategy.offload_optimizer != "none")
    assert report.recommendation is not None and report.recommendation.strategy.key == "fsdp_full"
    # FSDP full: (4 B fp32 adapters + 2 B 16-bit embeddings/norms + NF4 layers) / 8
    counts, quant = param_counts(LLAMA_70B, report.setup), quantized_base(LLAMA_70B, report.setup)
    frozen = 2 * (counts.frozen - NF4_WEIGHTS_70B) + quant.bytes
    assert by_key["fsdp_full"].params == pytest.approx((4 * 207_093_760 + frozen) / 8)
    assert report.recommendation.gpu_total < report.setup.usable_gpu_memory
    # ... where LoRA on the bf16 base needs offload (tests/planner/test_estimate.py::test_seventy_b_on_8x24gb)
    lora = plan("llama-3-70b", gpu_memory="24GB", lora_r=16, activation_checkpointing=True)
    assert lora.recommendation is not None and lora.recommendation.strategy.offload_optimizer != "none"
    table = report.table()
    assert "QLoRA r=16" in table and "not modelled" in table and "Recommendation: FSDP full" in table


@pytest.mark.parametrize("key", ["ddp", "zero1", "zero2", "fsdp_grad_op", "fsdp_full", "zero3"])
def test_qlora_params_are_lora_params_at_4_13_bits(key: str) -> None:
    strategy = STRATEGY_BY_KEY[key]
    lora, qlora = model_states(LLAMA_70B, strategy, LORA), model_states(LLAMA_70B, strategy, QLORA)
    quant = quantized_base(LLAMA_70B, QLORA)
    shards = 8 if strategy.family == "fsdp" or strategy.stage == 3 else 1
    persistent = quant.persistent_bytes if strategy.family == "zero" and strategy.stage == 3 else 0
    # Only the quantised weights change: 16 bits -> 4.13 bits each (a ratio of 3.87); grads and states are the same.
    saved = (2 - quant.bytes_per_weight) * quant.weights / shards
    assert lora.params - qlora.params == pytest.approx(saved - persistent)
    assert (lora.grads, lora.optimizer_state) == (qlora.grads, qlora.optimizer_state)
    assert 2 / quant.bytes_per_weight == pytest.approx(16 / 4.13, rel=0.002)
    for phase in PHASES:
        assert phase_peaks(LLAMA_70B, strategy, QLORA).by_phase()[phase].device < (
            phase_peaks(LLAMA_70B, strategy, LORA).by_phase()[phase].device
        ), phase


def test_dequantisation_transient_by_hand() -> None:
    largest = 8192 * 28672  # gate/up/down of Llama 3 70B
    assert dequant_bytes(LLAMA_70B, QLORA) == 2 * largest + 12 * largest / 64 + NF4_CHUNK_BYTES
    assert dequant_bytes(LLAMA_70B, LORA) == 0


# 2 layers of h=64 (MHA, 4 heads of 16), I=128, vocabulary 1000, tied; every linear has in % 64 == 0.
SMALL = ModelShape("small", 64, 128, 2, 4, 4, 16, 1000, True)


def test_fsdp_and_ddp_qlora_load_by_hand() -> None:
    setup = Setup(gpus_per_node=2, lora_r=4, quantization="nf4", checkpoint_file_bytes=2**20)
    t = param_counts(SMALL, setup).trainable
    quant = quantized_base(SMALL, setup)
    assert quant.weights == 2 * (4 * 64 * 64 + 3 * 64 * 128)
    base = 2 * (param_counts(SMALL, setup).frozen - quant.weights) + quant.bytes
    one_tensor = 2 * SMALL.largest_tensor()  # the embedding, in bf16: the largest tensor read
    fsdp = phase_peaks(SMALL, STRATEGY_BY_KEY["fsdp_full"], setup).load
    # its shard of the fp32 adapters and the 4-bit base, and its rows of one tensor being read and quantised
    assert fsdp.device == pytest.approx((4 * t + base) / 2 + one_tensor / 2 + NF4_CHUNK_BYTES)
    ddp = phase_peaks(SMALL, STRATEGY_BY_KEY["ddp"], setup).load
    # models.fill.fill_on_cpu fills the whole 4-bit model on the host, then moves it to the GPU
    assert ddp.device == pytest.approx(base + 4 * t)
    assert ddp.host == pytest.approx(setup.host_process_overhead + base + one_tensor + NF4_CHUNK_BYTES)


def test_narrow_linears_stay_16_bit() -> None:
    narrow = ModelShape("narrow", 48, 96, 2, 4, 4, 12, 100, True)  # in 48 and 96: no whole 64-weight blocks
    setup = Setup(lora_r=4, quantization="nf4")
    assert quantized_base(narrow, setup).weights == 0
    assert model_states(narrow, STRATEGY_BY_KEY["ddp"], setup) == model_states(
        narrow, STRATEGY_BY_KEY["ddp"], Setup(lora_r=4)
    )


def test_qlora_peak_is_the_phase_table() -> None:
    setup = Setup(lora_r=16, activation_checkpointing=True)
    for phase in PHASES:
        got = qlora_peak(LLAMA_70B, "fsdp_full", 8, phase, setup)
        assert got == phase_peaks(LLAMA_70B, STRATEGY_BY_KEY["fsdp_full"], QLORA).by_phase()[phase]
    assert qlora_peak(LLAMA_70B, "zero3", 4, "step").device > qlora_peak(LLAMA_70B, "zero3", 8, "step").device
    with pytest.raises(GymUserError, match="lora_r > 0"):
        qlora_peak(LLAMA_70B, "fsdp_full", 8, "step", Setup())
    with pytest.raises(GymUserError, match="offloading"):
        qlora_peak(LLAMA_70B, "fsdp_offload", 8, "step")


def test_quantization_without_lora_is_one_user_error() -> None:
    with pytest.raises(GymUserError, match=r"quantization nf4 \(QLoRA\) .* set lora_r > 0") as error:
        plan("llama-3-8b", quantization="nf4")
    assert "\n" not in str(error.value)
    with pytest.raises(GymUserError, match="quantization must be one of none, nf4, got 'int8'"):
        plan("llama-3-8b", lora_r=8, quantization="int8")  # type: ignore[arg-type]


def test_load_in_4bit_is_an_alias() -> None:
    parser = build_parser()
    assert parser.parse_args(["--model", "m", "--load_in_4bit"]).quantization == "nf4"
    assert parser.parse_args(["--model", "m", "--quantization", "nf4"]).quantization == "nf4"
    assert parser.parse_args(["--model", "m"]).quantization == "none"
