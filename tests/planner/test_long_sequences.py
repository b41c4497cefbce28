"""Planner: long sequences. Sequence parallelism (Ulysses: sp GPUs share a sequence, s/sp tokens each), the tiled
MLP, the refusals of impossible settings, ``longest_sequence`` and the ``gym plan`` flags.

The per-rank formulas are checked against their definition: a rank under sp = N holds what a rank at sp = 1 holds
for s/N tokens, except for two attention terms: the all-to-all buffers of one layer, and k and v saved at the query
width (the exchange repeats the kv heads to the query heads before sdpa; at sp = 1 sdpa runs GQA on the kv heads).
The tiled MLP replaces the saved SwiGLU intermediates of every token by one tile's. Measured peaks are compared in
docs/planner.md ("Validation against measured peaks").
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gym_lightning.cli import main
from gym_lightning.commands.plan import build_parser
from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner import BUNDLED, STRATEGIES, Setup, estimate, longest_sequence, plan
from gym_lightning.planner.estimate import (
    STRATEGY_BY_KEY,
    activation_bytes,
    activation_bytes_per_layer,
    attention_exchange_bytes,
    buffer_bytes,
    local_tokens,
    logits_bytes,
    mlp_tile_bytes,
    model_states,
    sequence_parallel_problems,
)
from gym_lightning.planner.long_sequence import sequence_step

LLAMA_8B = BUNDLED["llama-3-8b"]  # 32 heads, 8 kv heads of 128, h 4096, I 14336, 32 layers
QWEN3_MOE = BUNDLED["qwen3-30b-a3b"]  # 32 heads, 4 kv heads of 128
ZERO3 = STRATEGY_BY_KEY["zero3"]
LONG = Setup(activation_checkpointing=True, mlp_tile_tokens=4096, seq_length=65_536)
# 20 heads and 6 kv heads: neither divides by 8, and 6 is neither a multiple nor a divisor of 8 (or of 4).
ODD = ModelShape("odd", 1280, 3456, 4, 20, 6, 64, 32000, False)


def test_local_tokens_pad_to_a_multiple_of_sp() -> None:
    assert local_tokens(Setup(seq_length=65_536, sequence_parallel_size=8), 1) == 8192
    # 1,001 tokens over 8 ranks: the runtime pads to 1,008, each rank computes 126 positions
    assert local_tokens(Setup(seq_length=1001, sequence_parallel_size=8), 2) == 2 * 126
    assert Setup(gpus_per_node=8, nodes=2, sequence_parallel_size=4).data_parallel_size == 4


@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("tile", [0, 1024])
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_a_rank_at_sp_n_holds_what_sp_1_holds_at_s_over_n(
    sp: int, checkpointing: bool, tile: int, precision: str
) -> None:
    """The difference: the all-to-all buffers of one layer's attention (k and v are saved at the kv width in both:
    sdpa runs grouped-query attention itself, and Llama 3 8B's 8 kv heads need no replication up to sp 8)."""
    base = Setup(seq_length=32_768, activation_checkpointing=checkpointing, mlp_tile_tokens=tile, precision=precision)
    split = replace(base, sequence_parallel_size=sp)
    short = replace(base, seq_length=32_768 // sp)
    a_b, tokens = (2 if precision == "bf16-mixed" else 4), 32_768 // sp
    exchange = attention_exchange_bytes(LLAMA_8B, split, 1)
    assert exchange == 2 * a_b * (2 * 4096 + 2 * 1024) * tokens and attention_exchange_bytes(LLAMA_8B, short, 1) == 0
    repeated_kv = 0
    per_layer = activation_bytes_per_layer(LLAMA_8B, split, 1)
    assert per_layer == activation_bytes_per_layer(LLAMA_8B, short, 1) + repeated_kv
    kept_layers = 1 if checkpointing else 32
    expected = activation_bytes(LLAMA_8B, short, 1) + exchange + kept_layers * repeated_kv
    assert activation_bytes(LLAMA_8B, split, 1) == expected
    for chunking in ("on", "off"):
        assert logits_bytes(LLAMA_8B, replace(split, loss_chunking=chunking), 1) == logits_bytes(
            LLAMA_8B, replace(short, loss_chunking=chunking), 1
        )


def test_attention_exchange_by_hand() -> None:
    # Llama 3 8B, sp 8, 65,536 tokens: 8,192 per rank; send + receive of q (4096), k, v (1024 each) and the output
    # (4096), 2 B each: 2 x 2 x (4096 + 1024 + 1024 + 4096) x 8192 = 335,544,320 B
    setup = Setup(seq_length=65_536, sequence_parallel_size=8)
    assert attention_exchange_bytes(LLAMA_8B, setup, 1) == 2 * 2 * 10_240 * 8192 == 335_544_320
    # Qwen3-30B-A3B has 4 kv heads < sp 8: replicated to 8 heads first, so k and v count 8 x 128 = 1024 each
    assert attention_exchange_bytes(QWEN3_MOE, setup, 1) == 2 * 2 * (2 * 4096 + 2 * 1024) * 8192
    # the k, v the attention saves are the replicated 8 heads (1024 wide), not the model's 4 (512): 2 B x 2 x
    # (1024 - 512) more per token than at sp 1 with s/8 tokens
    short = Setup(seq_length=8192)
    extra = activation_bytes_per_layer(QWEN3_MOE, setup, 1) - activation_bytes_per_layer(QWEN3_MOE, short, 1)
    assert extra == 2 * 2 * (1024 - 512) * 8192


def test_tiled_mlp_by_hand() -> None:
    # SwiGLU intermediates of Llama 3 8B: 4 x 2 B x 14336 = 114,688 B per token; 8,192 tokens, tiles of 1,024
    swiglu, tokens, tile = 4 * 2 * 14_336, 8192, 1024
    plain = Setup(seq_length=tokens)
    tiled = replace(plain, mlp_tile_tokens=tile)
    assert mlp_tile_bytes(LLAMA_8B, tiled, 1) == swiglu * tile and mlp_tile_bytes(LLAMA_8B, plain, 1) == 0
    # no layer checkpointing: every layer stops saving its intermediates, one tile exists at a time
    saved = 32 * swiglu * tokens
    assert activation_bytes(LLAMA_8B, tiled, 1) == activation_bytes(LLAMA_8B, plain, 1) - saved + swiglu * tile
    # checkpointing: the recomputed layer peaks at one tile instead of all its tokens
    plain_ckpt, tiled_ckpt = (
        replace(plain, activation_checkpointing=True),
        replace(tiled, activation_checkpointing=True),
    )
    expected = activation_bytes(LLAMA_8B, plain_ckpt, 1) - swiglu * tokens + swiglu * tile
    assert activation_bytes(LLAMA_8B, tiled_ckpt, 1) == expected
    # 3,000-token tiles: ceil(8192 / 3000) = 3 tiles, tensor_split into 2,731 + 2,731 + 2,730 positions
    assert mlp_tile_bytes(LLAMA_8B, replace(plain, mlp_tile_tokens=3000), 1) == swiglu * 2731
    # tokens that fit one tile run the plain MLP (models.tiling): every kept layer saves its intermediates
    one_tile = replace(plain, mlp_tile_tokens=tokens)
    assert mlp_tile_bytes(LLAMA_8B, one_tile, 1) == 0
    assert activation_bytes(LLAMA_8B, one_tile, 1) == activation_bytes(LLAMA_8B, plain, 1)
    # ... counted per micro-batch: 2 rows of 8,192 are 2 tiles of 8,192
    assert mlp_tile_bytes(LLAMA_8B, one_tile, 2) == swiglu * tokens
    # a mixture of experts is not tiled
    moe = Setup(seq_length=tokens, activation_checkpointing=True)
    assert activation_bytes(QWEN3_MOE, replace(moe, mlp_tile_tokens=tile), 1) == activation_bytes(QWEN3_MOE, moe, 1)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.key)
def test_model_states_and_buffers_stay_sharded_over_all_ranks(strategy: object) -> None:
    one, eight = Setup(gpus_per_node=8), Setup(gpus_per_node=8, sequence_parallel_size=8)
    assert model_states(LLAMA_8B, strategy, eight) == model_states(LLAMA_8B, strategy, one)  # type: ignore[arg-type]
    assert buffer_bytes(LLAMA_8B, strategy, eight) == buffer_bytes(LLAMA_8B, strategy, one)  # type: ignore[arg-type]


def test_every_impossible_setting_in_one_message() -> None:
    setup = Setup(gpus_per_node=12, sequence_parallel_size=8, attention="eager", mlp_tile_tokens=-1)
    problems = sequence_parallel_problems(ODD, setup)
    assert len(problems) == 5, problems
    with pytest.raises(GymUserError) as error:
        estimate(ODD, ZERO3, setup)
    message = str(error.value)
    assert "\n" not in message
    for part in (
        "mlp_tile_tokens must be an integer >= 0",
        "sequence_parallel_size 8 does not divide the 12 GPUs",
        "odd has 20 attention heads, not divisible by sequence_parallel_size 8",
        "odd has 6 key/value heads, neither a multiple nor a divisor of sequence_parallel_size 8",
        "attention eager stores the s x s scores",
    ):
        assert part in message
    with pytest.raises(GymUserError, match="sequence_parallel_size must be an integer >= 1, got 0"):
        longest_sequence(LLAMA_8B, ZERO3, Setup(sequence_parallel_size=0))


def test_what_is_allowed() -> None:
    # kv heads dividing sp (replicated), eager at sp 1, a length sp does not divide (padded)
    assert sequence_parallel_problems(QWEN3_MOE, Setup(sequence_parallel_size=8)) == []
    assert sequence_parallel_problems(LLAMA_8B, Setup(attention="eager")) == []
    assert sequence_parallel_problems(LLAMA_8B, Setup(sequence_parallel_size=8, seq_length=1001)) == []
    with pytest.raises(GymUserError, match="heads, not divisible by sequence_parallel_size 8"):
        plan("qwen2.5-7b", sequence_parallel_size=8)  # 28 heads


def test_longest_sequence_is_the_boundary() -> None:
    setup = replace(LONG, sequence_parallel_size=8)
    longest = longest_sequence(LLAMA_8B, ZERO3, setup)
    step = sequence_step(setup)
    assert step == 1024 and longest % step == 0 and longest > 1_000_000
    assert estimate(LLAMA_8B, ZERO3, replace(setup, seq_length=longest)).fits_gpu
    assert not estimate(LLAMA_8B, ZERO3, replace(setup, seq_length=longest + step)).fits_gpu
    # sp 3 (12 heads, 3 kv heads, 6 GPUs): the lengths are multiples of lcm(1024, 3) = 3072
    shape = ModelShape("twelve-heads", 1536, 4096, 4, 12, 3, 128, 32000, False)
    three = Setup(gpus_per_node=6, sequence_parallel_size=3, activation_checkpointing=True)
    longest = longest_sequence(shape, ZERO3, three)
    assert longest > 0 and longest % 3072 == 0


def test_longest_sequence_grows_with_sp_and_memory() -> None:
    by_sp = [longest_sequence(LLAMA_8B, ZERO3, replace(LONG, sequence_parallel_size=sp)) for sp in (1, 2, 4, 8)]
    assert by_sp == sorted(by_sp) and len(set(by_sp)) == 4, by_sp
    memories = (24, 40, 80, 141)
    by_memory = [longest_sequence(LLAMA_8B, ZERO3, replace(LONG, gpu_memory=gb * 2**30)) for gb in memories]
    assert by_memory == sorted(by_memory) and len(set(by_memory)) == 4, by_memory


def test_longest_sequence_is_zero_when_nothing_fits() -> None:
    assert longest_sequence(LLAMA_8B, STRATEGY_BY_KEY["ddp"], LONG) == 0  # 16Ψ = 120 GiB of model states
    qlora = Setup(lora_r=16, quantization="nf4")  # QLoRA with offloading: not modelled, never "fits"
    assert longest_sequence(LLAMA_8B, STRATEGY_BY_KEY["zero3_offload"], qlora) == 0


def test_flags_parse() -> None:
    args = build_parser().parse_args(
        ["--model", "llama-3-8b", "--sequence_parallel_size", "8", "--mlp_tile_tokens", "4096", "--longest_sequence"]
    )
    assert (args.sequence_parallel_size, args.mlp_tile_tokens, args.longest_sequence) == (8, 4096, True)
    defaults = build_parser().parse_args(["--model", "llama-3-8b"])
    assert (defaults.sequence_parallel_size, defaults.mlp_tile_tokens, defaults.longest_sequence) == (1, 0, False)


def test_table_column_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["plan", "--model", "llama-3-8b", "--activation_checkpointing", "--sequence_parallel_size", "8"]
    main([*flags, "--mlp_tile_tokens", "4096", "--seq_length", "1000"])
    table = capsys.readouterr().out
    assert "longest seq" not in table
    assert "(125 tokens each), 1 data-parallel group(s). MLP tiling: the 125 tokens fit one tile, none." in table
    main([*flags, "--mlp_tile_tokens", "4096", "--seq_length", "1000000"])
    assert (
        "(125,000 tokens each), 1 data-parallel group(s). MLP in 31 tiles of at most 4,096" in capsys.readouterr().out
    )
    main([*flags, "--longest_sequence"])
    table = capsys.readouterr().out
    zero3 = next(line for line in table.splitlines() if line.startswith("ZeRO-3 "))
    setup = plan("llama-3-8b", activation_checkpointing=True, sequence_parallel_size=8).setup  # 80 GiB, not 80e9 B
    expected = longest_sequence(LLAMA_8B, ZERO3, setup)
    assert "longest seq" in table and zero3.endswith(f"{expected:,}")
    main([*flags, "--json"])
    report = json.loads(capsys.readouterr().out)
    by_key = {s["key"]: s for s in report["strategies"]}
    assert by_key["zero3"]["longest_sequence"] == expected and by_key["ddp"]["longest_sequence"] == 0
    assert report["setup"]["sequence_parallel_size"] == 8 and report["data_parallel_size"] == 1
    assert report["tokens_per_rank"] == 256


BAD_FLAGS = [
    (["--sequence_parallel_size", "0"], "sequence_parallel_size must be an integer >= 1, got 0"),
    (["--sequence_parallel_size", "3"], "does not divide the 8 GPUs into whole groups"),
    (["--model", "qwen2.5-7b", "--gpus_per_node", "7", "--sequence_parallel_size", "7"], "has 4 key/value heads"),
    (["--sequence_parallel_size", "2", "--attention", "eager"], "attention eager stores the s x s scores"),
    (["--mlp_tile_tokens", "-1"], "mlp_tile_tokens must be an integer >= 0"),
    (["--sequence_parallel_size", "two"], "argument --sequence_parallel_size: invalid int value: 'two'"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS)
def test_bad_flags_one_line_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "llama-3-8b", *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err
