"""Memory planner: hand-checked figures for Llama 3 8B, the CLI, bad flags, and agreement with measured memory.

The validation test (``test_model_states_match_memory_callback_on_two_cpu_ranks``) trains the tiny Llama of
``tests/callbacks/test_memory_monitor.py`` on 2 CPU ranks with each strategy, reads the ``memory.json`` its
MemoryCallback writes, and compares the per-rank bytes of parameters, gradients and optimizer state (fp32 master weights
included) with the planner's fp32 estimate. CPU ranks train in fp32 (no bf16 mixed precision on gloo), so this checks
the model-state accounting for ``precision="32-true"``; activations can only be compared on a GPU (CUDA peak memory).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import shape_from_config
from gym_lightning.planner import BUNDLED, STRATEGIES, Setup, estimate, parse_bytes, plan
from gym_lightning.planner.catalog import PUBLISHED_ACTIVE_PARAMS, PUBLISHED_PARAMS
from gym_lightning.planner.estimate import (
    activation_bytes,
    activation_bytes_per_layer,
    logits_bytes,
    model_states,
    param_counts,
)

LLAMA_8B = BUNDLED["llama-3-8b"]
PSI_8B = 8_030_261_248  # Meta's model card: 8.03B; see test_llama_3_8b_parameter_count_by_hand
BY_KEY = {s.key: s for s in STRATEGIES}


def test_llama_3_8b_parameter_count_by_hand() -> None:
    # h=4096, I=14336, L=32, 32 query heads and 8 kv heads of 128, V=128256, untied LM head.
    # per layer: q 4096*4096 = 16_777_216, k and v 4096*1024 = 4_194_304 each, o 16_777_216,
    #            gate/up/down 3 * 4096*14336 = 176_160_768, two RMSNorms 8192  -> 218_112_000
    # 32 layers = 6_979_584_000; embedding + LM head 2 * 128256*4096 = 1_050_673_152; final norm 4096
    assert LLAMA_8B.layer_params() == 218_112_000
    assert LLAMA_8B.num_params() == 6_979_584_000 + 1_050_673_152 + 4096 == PSI_8B


@pytest.mark.parametrize("name", list(BUNDLED))
def test_bundled_parameter_counts_match_model_cards(name: str) -> None:
    # Model cards round to 2-3 significant digits (Qwen3-1.7B is 1.72B), hence 1.5 %.
    assert BUNDLED[name].num_params() / 1e9 == pytest.approx(PUBLISHED_PARAMS[name], rel=0.015)


@pytest.mark.parametrize("name", list(PUBLISHED_ACTIVE_PARAMS))
def test_moe_active_parameter_counts_match_model_cards(name: str) -> None:
    # "A3B" / "A22B": the cards' activated counts (embeddings included) are rounded down to 2 digits (3.35 -> 3.3).
    assert BUNDLED[name].active_params() / 1e9 == pytest.approx(PUBLISHED_ACTIVE_PARAMS[name], rel=0.02)


_QWEN3_30B_A3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
                  "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False}  # fmt: skip
_TINY_MOE = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "num_experts_per_tok": 2}  # fmt: skip
MOE_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "qwen3-30b-a3b": lambda: transformers.Qwen3MoeConfig(**_QWEN3_30B_A3B),
    "tiny-qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **_TINY_MOE, intermediate_size=48, head_dim=8, moe_intermediate_size=8, num_experts=4
    ),
    "tiny-mixtral": lambda: transformers.MixtralConfig(**_TINY_MOE, intermediate_size=24, num_local_experts=4),
}


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_shape_from_config_is_the_model_transformers_builds(name: str) -> None:
    """Total count, one decoder layer (the unit FSDP shards, experts inside) and the largest tensor of the shape
    equal those of the model transformers builds from the same config (on the meta device)."""
    config = MOE_CONFIGS[name]()
    shape = shape_from_config(config.to_dict(), name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape.is_moe and shape.num_params() == sum(p.numel() for p in model.parameters())
    assert shape.layer_params() == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.largest_tensor() == max(p.numel() for p in model.parameters())
    assert param_counts(shape, Setup(lora_r=4)).trainable == sum(
        4 * (fan_in + fan_out) * shape.num_layers for fan_in, fan_out in shape.linear_shapes().values()
    )  # adapters on the attention's linears only: routers and experts are plain parameters, not nn.Linear


def test_moe_with_dense_layers_is_refused_in_one_line() -> None:
    config = MOE_CONFIGS["tiny-qwen3-moe"]().to_dict() | {"mlp_only_layers": [0]}
    with pytest.raises(GymUserError, match="mixes dense and sparse layers"):
        shape_from_config(config, "mixed")


def test_plan_for_qwen3_30b_a3b_shows_total_and_gathers_whole_expert_layers() -> None:
    report = plan("qwen3-30b-a3b", gpu_memory="80GB", gpus_per_node=8, activation_checkpointing=True)
    assert report.table().startswith("qwen3-30b-a3b: 30.53B parameters (3.35B active, 8 of 128 experts per token)")
    # One layer, the unit FSDP and ZeRO-3 gather: q and o 2 x 2048*4096 = 16_777_216, k and v 2 x 2048*512 =
    # 2_097_152, q/k norms 256, two RMSNorms 4096, router 128*2048 = 262_144, experts 128 x 3 x 768*2048 =
    # 603_979_776 -> 623_120_640: 97 % of it experts, all gathered although a token uses 8 of 128.
    assert BUNDLED["qwen3-30b-a3b"].layer_params() == 623_120_640


def test_lora_trainable_count_by_hand() -> None:
    # r=16 on all 7 linears, A is r x in, B is out x r: q 16*4096 + 4096*16 = 131_072, k and v 16*4096 + 1024*16
    # = 81_920 each, o 131_072, gate/up/down 16*4096 + 14336*16 = 294_912 each -> 1_310_720 per layer, x 32 layers
    # = 41_943_040 (what peft prints for Llama 3 8B, r=16, all-linear).
    counts = param_counts(LLAMA_8B, Setup(lora_r=16))
    assert counts.trainable == 41_943_040
    assert counts.frozen == PSI_8B
    qv = param_counts(LLAMA_8B, Setup(lora_r=16, lora_targets="attention-qv")).trainable
    assert qv == 32 * (131_072 + 81_920) == 6_815_744


def test_zero_stages_by_hand_bf16_8_gpus() -> None:
    setup = Setup(gpus_per_node=8)
    # ZeRO-2: 2Ψ bf16 parameters + Ψ/8 * (2 bf16 grads + 4 fp32 grad copy + 4 master + 8 Adam) = 2Ψ + 18Ψ/8
    # = 16_060_522_496 + 18_068_087_808 = 34_128_610_304 B, DeepSpeed's estimate_zero2_model_states_mem_needs.
    assert model_states(LLAMA_8B, BY_KEY["zero2"], setup).total == pytest.approx(34_128_610_304)
    # ZeRO-1 keeps the full bf16 gradient: 2Ψ + 2Ψ + 16Ψ/8 = 32_121_044_992 + 16_060_522_496
    assert model_states(LLAMA_8B, BY_KEY["zero1"], setup).total == pytest.approx(48_181_567_488)
    # ZeRO-3: 2Ψ/8 params + persistent norms (32*2*4096 + 4096 = 266_240 elements < 1e5 each, kept whole, 2 B)
    # + 2Ψ/8 grads + fp32 grad copy of one optimizer sub-group (ZeROStrategy: one decoder layer, 218_112_000
    # elements; DeepSpeed's 1e9 default when set so) + 12Ψ/8 states
    z3 = model_states(LLAMA_8B, BY_KEY["zero3"], setup)
    assert z3.params == pytest.approx(2 * PSI_8B / 8 + 2 * 266_240)
    assert z3.grads == pytest.approx(2 * PSI_8B / 8 + 4 * 218_112_000)
    deepspeed_default = model_states(LLAMA_8B, BY_KEY["zero3"], Setup(gpus_per_node=8, sub_group_size=10**9))
    assert deepspeed_default.grads == pytest.approx(2 * PSI_8B / 8 + 4 * 1e9)  # Ψ/8 = 1_003_782_656 > 1e9
    assert z3.optimizer_state == pytest.approx(12 * PSI_8B / 8)
    # DDP under torch AMP: fp32 params + fp32 grads + 8 B Adam = 16Ψ = 128_484_179_968 B (nothing sharded)
    assert model_states(LLAMA_8B, BY_KEY["ddp"], setup).total == pytest.approx(16 * PSI_8B)
    # FSDP2 full shard: the same 16Ψ divided by 8 = 16_060_522_496 B
    assert model_states(LLAMA_8B, BY_KEY["fsdp_full"], setup).total == pytest.approx(2 * PSI_8B)


def test_offload_host_bytes_by_hand() -> None:
    setup = Setup(gpus_per_node=8)
    # ZeRO-3 + CPU optimizer + params: per node 8 ranks * Ψ/8 * (2 params + 4 fp32 grads + 4 master + 8 Adam) = 18Ψ,
    # DeepSpeed's own per-node figure before its 1.5 safety factor; the GPU keeps only persistent norms.
    z3o = model_states(LLAMA_8B, BY_KEY["zero3_offload"], setup)
    assert 8 * z3o.host == pytest.approx(18 * PSI_8B)
    assert z3o.params == 2 * 266_240 and z3o.grads == 0 and z3o.optimizer_state == 0


def test_matches_deepspeed_zero2_estimator() -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(PSI_8B, num_gpus_per_node=8, cpu_offload=False)
    assert model_states(LLAMA_8B, BY_KEY["zero2"], Setup(gpus_per_node=8)).total == pytest.approx(gpu, abs=8)


def test_activations_and_logits_by_hand() -> None:
    setup = Setup(seq_length=2048, micro_batch_size=1)
    # bytes per token per layer, bf16: two RMSNorms 2*(4*4096 fp32 upcast + 2*2*4096) = 65_536; rotated q,k,v
    # 2*(4096 + 2*1024) = 12_288; attention output + o_proj input 2*2*4096 = 16_384; SwiGLU 4*2*14336 = 114_688;
    # SDPA log-sum-exp 4*32 = 128 -> 209_024; x 2048 tokens = 428_081_152 B per layer.
    assert activation_bytes_per_layer(LLAMA_8B, setup, 1) == 209_024 * 2048
    # no checkpointing: 32 layers + final norm (4 + 2) * 4096 per token
    assert activation_bytes(LLAMA_8B, setup, 1) == 32 * 209_024 * 2048 + 6 * 4096 * 2048
    # checkpointing: a bf16 layer input per layer (2 * 4096 * 2048 * 32) + one layer recomputed
    ckpt = Setup(seq_length=2048, activation_checkpointing=True)
    assert activation_bytes(LLAMA_8B, ckpt, 1) == 2 * 4096 * 2048 * 32 + 209_024 * 2048
    # logits without chunking: 2048 * 128256 * (2 bf16 + 4 fp32 upcast + 4 fp32 log-softmax) = 2_626_682_880 B
    assert logits_bytes(LLAMA_8B, replace(setup, loss_chunking="off"), 1) == 2_626_682_880
    # the module's default chunks a 128k vocabulary by 1,024 positions: half of that (tests/planner/test_phases.py)
    assert logits_bytes(LLAMA_8B, setup, 1) == 2_626_682_880 / 2


def test_fit_and_largest_micro_batch_are_consistent() -> None:
    report = plan("llama-3-8b", gpus_per_node=8, gpu_memory="80GB", seq_length=4096, micro_batch_size=1)
    for e in report.estimates:
        if e.max_micro_batch == 0:
            continue
        at_max = estimate(report.shape, e.strategy, replace(report.setup, micro_batch_size=e.max_micro_batch))
        above = estimate(report.shape, e.strategy, replace(report.setup, micro_batch_size=e.max_micro_batch + 1))
        assert at_max.fits_gpu and not above.fits_gpu, e.strategy.key
    ddp = report.estimates[0]
    assert ddp.strategy.key == "ddp" and not ddp.fits_gpu  # 16Ψ = 120 GiB of model states alone
    # ZeRO-1 (2Ψ + 2Ψ + 4Ψ/8 + 12Ψ/8 = 44.9 GiB) + 4096-token activations (25.5) + full logits (4.9) > 75 GiB
    # usable; with the module's chunked loss (1,024-position chunks: 1.2 GiB) it fits.
    unchunked = plan("llama-3-8b", gpus_per_node=8, gpu_memory="80GB", seq_length=4096, loss_chunking="off")
    assert not {e.strategy.key: e for e in unchunked.estimates}["zero1"].fits
    assert {e.strategy.key: e for e in report.estimates}["zero1"].fits
    # The recommendation is the fastest that fits (planner.timing): ZeRO-1's reduction and parameter gather after
    # backward show (59 ms of a 745 ms step on 8 x H100), ZeRO-2 hides its reduce-scatter, within 5 % of the
    # fastest (ZeRO-3, FSDP) and first of them in the list's order.
    assert report.ranking()[:2] == unchunked.ranking()[:2] == ["zero2", "fsdp_grad_op"]
    assert report.recommendation is not None and report.recommendation.strategy.key == "zero2"


def test_seventy_b_on_8x24gb() -> None:
    # Full finetune: nothing without offload fits; FSDP full shard needs 16Ψ/8 = 131 GiB of model states per GPU.
    full = plan("llama-3-70b", gpu_memory="24GB", host_memory="2TB", activation_checkpointing=True)
    fitting = {e.strategy.key for e in full.estimates if e.fits}
    assert fitting == {"fsdp_offload", "zero3_offload", "zero_infinity"}
    # ... and with 1 TB of host RAM only NVMe offload is left (16-18 Ψ = 1.05-1.18 TiB per node on the host)
    small_host = plan("llama-3-70b", gpu_memory="24GB", host_memory="1TB", activation_checkpointing=True)
    assert small_host.recommendation is not None and small_host.recommendation.strategy.key == "zero_infinity"
    # LoRA on a bf16 base: the frozen weights alone are 2Ψ/8 = 16.4 GiB per GPU under FSDP full shard; with the
    # gathered embedding unit (2 x 2 x 1.05e9 B) and 2048-token activations that is over 21.8 GiB usable, so the
    # base must be offloaded. (With the base in 4 bits, QLoRA, FSDP full fits: tests/planner/test_qlora.py.)
    lora = plan("llama-3-70b", gpu_memory="24GB", lora_r=16, activation_checkpointing=True)
    by_key = {e.strategy.key: e for e in lora.estimates}
    # r=16 adapters per layer: q, o 2 * 16*8192*2 = 524_288; k, v 2 * (16*8192 + 1024*16) = 294_912; gate, up, down
    # 3 * (16*8192 + 28672*16) = 1_769_472 -> 2_588_672 x 80 layers = 207_093_760 trainable fp32 parameters
    assert by_key["fsdp_full"].params == pytest.approx((2 * 70_553_706_496 + 4 * 207_093_760) / 8)
    assert not by_key["fsdp_full"].fits_gpu
    assert lora.recommendation is not None and lora.recommendation.strategy.key == "fsdp_offload"


def test_table_and_json_from_the_command_line(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    (tmp_path / "config.json").write_text(config.to_json_string())
    base = [sys.executable, "-m", "gym_lightning", "plan", "--model", str(tmp_path), "--gpus_per_node", "2"]
    table = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    assert "ZeRO-Infinity (NVMe)" in table and "Recommendation: DDP (strategy: gym_ddp)" in table
    flags = ["--json", "--checkpoint_file_size", "500MB", "--loss_chunking", "on"]
    report = json.loads(subprocess.run([*base, *flags], capture_output=True, text=True, check=True).stdout)
    assert report["setup"]["checkpoint_file_bytes"] == 500 * 2**20 and report["setup"]["loss_chunking"] == "on"
    assert report["parameters"]["total"] == report["parameters"]["active"] == 34_976  # the hand count of helpers.tiny
    assert [s["key"] for s in report["strategies"]] == [s.key for s in STRATEGIES]
    assert report["recommendation"] == "ddp"
    assert "Peak per phase, GiB, host RAM / GPU memory per rank:" in table
    assert set(report["strategies"][0]["phases"]) == {"load", "step", "save", "export"}


BAD_FLAGS = [
    (["--model", "llama-3-8b", "--gpus_per_node", "0", "--lora_r", "-1"], "gpus_per_node must be an integer >= 1"),
    (["--model", "llama-3-8b", "--gpu_memory", "80XB"], "Cannot read memory size '80XB'"),
    (["--model", "no-such-model"], "Unknown model 'no-such-model'"),
    (["--model", "llama-3-8b", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--model", "llama-3-70b", "--load_in_4bit"], "quantization nf4 (QLoRA) freezes a 4-bit base and trains LoRA"),
]


@pytest.fixture(scope="module")
def bad_flag_runs() -> list[Any]:
    """``python -m gym_lightning plan FLAGS`` for each of ``BAD_FLAGS``, each in a process of its own
    (``helpers.forked``)."""
    from helpers.forked import run_forked

    return run_forked([["-m", "gym_lightning", "plan", *flags] for flags, _ in BAD_FLAGS])


@pytest.mark.parametrize(("index", "flags", "message"), [(i, *case) for i, case in enumerate(BAD_FLAGS)])
def test_bad_flags_one_line_exit_2(index: int, flags: list[str], message: str, bad_flag_runs: list[Any]) -> None:
    done = bad_flag_runs[index]
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    if "lora_r" in flags:  # every problem in one message
        assert "lora_r must be an integer >= 0" in done.stderr


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == parse_bytes("80 GiB") == 80 * 2**30
    assert parse_bytes("1.5TB") == int(1.5 * 2**40) and parse_bytes(123) == 123
    with pytest.raises(ValueError, match="expected a number with a unit"):
        parse_bytes("lots")


# ------------------------------------------------------------------------- validation against measured memory
MEASURED = {"gym_ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "gym_fsdp": "fsdp_full"}


def _planned(strategy_key: str, tiny: dict[str, int]) -> dict[str, float]:
    shape = shape_from_config({"model_type": "llama", **transformers.LlamaConfig(**tiny).to_dict()}, "tiny")
    # What the measured runs use: 2 CPU ranks, fp32, AdamW; their ZeRO-3 config sets the persistence threshold to 0.
    setup = Setup(gpus_per_node=2, precision="32-true", zero3_param_persistence_threshold=0)
    states = model_states(shape, BY_KEY[strategy_key], setup)
    return {"params": states.params, "grads": states.grads, "optimizer_state": states.optimizer_state}


def _measured(held: dict[str, Any]) -> dict[str, float]:
    def total(category: str) -> float:
        return held[category]["on_device"] + held[category]["offloaded"]

    return {
        "params": total("params"),
        "grads": total("grads"),
        "optimizer_state": total("master_params") + total("optimizer_state"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(MEASURED))
def test_model_states_match_memory_callback_on_two_cpu_ranks(
    strategy: str, two_rank_memory_run: Callable[[str], Path]
) -> None:
    """The MemoryCallback's own 2-rank runs (shared through conftest's ``two_rank_memory_run``)."""
    from helpers.tiny import TINY

    planned = _planned(MEASURED[strategy], TINY)
    report = json.loads((two_rank_memory_run(strategy) / "memory.json").read_text())
    for rank in report["ranks"]:
        measured = _measured(rank["end"])
        planned_total, measured_total = sum(planned.values()), sum(measured.values())
        assert measured_total == pytest.approx(planned_total, rel=0.05), (strategy, planned, measured)
        for category, value in planned.items():  # each category within 5 % of the rank's model-state bytes
            assert abs(measured[category] - value) <= 0.05 * measured_total, (strategy, category, planned, measured)
