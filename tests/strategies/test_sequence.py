"""The pieces of sequence parallelism (``gym_lightning.strategies.sequence``) and tiled MLP (``models.tiling``):
batch slicing, document-aware causal attention, the Ulysses exchange on 2 real gloo ranks, the one-line errors,
and the ``gym train`` flag. The whole runs against one process are in ``test_sequence_parallel.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers.dist import free_port
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from gym_lightning.cli import main
from gym_lightning.commands.train import parse_train_args, to_cli_args
from gym_lightning.data.collate import Collator, packed_batch
from gym_lightning.data.formats import TokenizedSample
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX, count_target_tokens, summed_cross_entropy
from gym_lightning.models.tiling import TileCount, dense_mlps, tile_mlps
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ParallelDims, ZeRO3Strategy
from gym_lightning.strategies import sequence as sp

SAMPLES = [
    TokenizedSample([5, 6, 7, 8, 9], [-100, -100, 7, 8, 9]),
    TokenizedSample([1, 2, 3], [1, 2, 3]),
]


def _whole(slices: list[dict], key: str) -> torch.Tensor:
    return torch.cat([s[key] for s in slices], dim=1)


def test_slices_put_back_together_are_the_padded_batch_with_shifted_labels() -> None:
    batch = Collator(pad_token_id=0)(SAMPLES)
    batch[sp.STEP_TOKENS_KEY] = torch.tensor(9)
    slices = [sp.shard_batch(batch, 2, rank)[0] for rank in range(2)]
    assert [s["input_ids"].shape for s in slices] == [torch.Size([2, 3])] * 2  # 5 tokens padded to 6, halved
    assert _whole(slices, "input_ids").tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 0, 0, 0]]
    # Each position's next-token target; the last real token of a row has none.
    assert _whole(slices, "shift_labels").tolist() == [[-100, 7, 8, 9, -100, -100], [2, 3, -100, -100, -100, -100]]
    assert _whole(slices, "position_ids").tolist() == [list(range(6))] * 2  # padded rows stay one sequence
    assert all("labels" not in s and "attention_mask" not in s for s in slices)
    total = sum(count_target_tokens(s["shift_labels"], shifted=True) for s in slices)
    assert total == count_target_tokens(batch["labels"])
    assert [s[sp.STEP_TOKENS_KEY].item() for s in slices] == [4.5, 4.5]  # summed over the group: the batch's 9
    assert sp.shard_batch(batch, 2, 0)[1] is None  # no packed documents: one causal call


def test_packed_rows_keep_their_documents() -> None:
    row = TokenizedSample([5, 6, 7, 1, 2, 3], [-100, 6, 7, -100, 2, 3])
    batch = packed_batch([row], [[3, 3]], pad_token_id=0)
    sliced, spans = sp.shard_batch(batch, 4, 1)
    assert spans == [[(0, 3), (3, 8)]]  # two documents; the padding to 8 continues the second (no targets)
    assert sliced["position_ids"].tolist() == [[2, 0]]
    assert "cu_seq_lens" not in sliced


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list) -> torch.Tensor:
    """Attention with an explicit block-diagonal causal mask (what transformers builds for packed rows)."""
    length = q.size(2)
    mask = torch.zeros(q.size(0), 1, length, length, dtype=torch.bool)
    for row, documents in enumerate(spans):
        for a, b in documents:
            mask[row, 0, a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_causal_attention_keeps_documents_apart_like_a_block_diagonal_mask() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    spans = [[(0, 4), (4, 10)], [(0, 7), (7, 9), (9, 10)]]
    torch.testing.assert_close(sp.causal_attention(q, k, v, spans, None, 0.0), _dense_reference(q, k, v, spans))
    whole = [[(0, 10)], [(0, 10)]]
    torch.testing.assert_close(sp.causal_attention(q, k, v, None, None, 0.0), _dense_reference(q, k, v, whole))


class _Attention(torch.nn.Module):
    training = True


def _exchange_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    group, group_rank = sp.new_sequence_group(ParallelDims(2, sequence=2))
    sp.activate(sp.SequenceShard(2, group_rank, group, SPANS))
    local = slice(6 * group_rank, 6 * group_rank + 6)
    for kv_heads in KV_HEADS:
        q, k, v = _whole_inputs(kv_heads)  # the same whole tensors on both ranks
        out_local, _ = sp.ulysses_attention(_Attention(), q[:, :, local], k[:, :, local], v[:, :, local], None)
        out_local.square().sum().backward()  # each rank's loss on its own tokens; gradients come back through a2a
        torch.save({"out": out_local.detach(), "grads": [t.grad for t in (q, k, v)]}, f"{out}.{kv_heads}.{rank}")
    torch.distributed.destroy_process_group()


SPANS = [[(0, 5), (5, 12)], [(0, 12)]]
KV_HEADS = (2, 1)  # one kv head per rank; one kv head repeated on both ranks


def _whole_inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(kv_heads)
    return tuple(torch.randn(2, h, 12, 8, requires_grad=True) for h in (4, kv_heads, kv_heads))


@pytest.mark.slow
def test_the_exchange_on_two_ranks_equals_attention_over_the_whole_sequence(tmp_path: Path) -> None:
    mp.spawn(_exchange_worker, args=(free_port(), str(tmp_path / "r")), nprocs=2, join=True)
    for kv_heads in KV_HEADS:
        ranks = [torch.load(tmp_path / f"r.{kv_heads}.{rank}", weights_only=True) for rank in range(2)]
        q, k, v = _whole_inputs(kv_heads)
        expected = sp.causal_attention(q, k, v, SPANS, None, 0.0).transpose(1, 2)
        expected.square().sum().backward()
        torch.testing.assert_close(torch.cat([r["out"] for r in ranks], dim=1), expected.detach())
        for i, tensor in enumerate((q, k, v)):  # the sum over ranks of each rank's gradient: what DDP/ZeRO reduce
            torch.testing.assert_close(ranks[0]["grads"][i] + ranks[1]["grads"][i], tensor.grad)


def test_every_impossible_setting_is_named_in_one_message() -> None:
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    config._attn_implementation = "eager"
    with pytest.raises(GymUserError) as error:
        sp.raise_if_unsplittable(config, 4, 6)
    message = str(error.value)
    assert "4 problem(s)" in message
    for part in ("does not divide the 6 rank(s)", "6 attention heads", "3 key/value heads", "'eager'"):
        assert part in message
    windowed = AutoConfig.for_model("gemma3_text", sliding_window=32, num_attention_heads=4, num_key_value_heads=2)
    windowed._attn_implementation = "sdpa"
    assert any("sliding_attention" in p for p in sp.model_problems(windowed, 2))
    fine = LlamaConfig(num_attention_heads=8, num_key_value_heads=2)
    fine._attn_implementation = "sdpa"
    assert sp.model_problems(fine, 4) == [] and sp.world_problems(4, 8) == []


def test_a_model_windowing_every_layer_is_refused_until_the_window_is_lifted() -> None:
    # Mistral names no layer kinds: its default sliding_window (4096) windows every layer.
    mistral = AutoConfig.for_model("mistral", num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    mistral._attn_implementation = "sdpa"
    assert mistral.sliding_window is not None
    (problem,) = sp.model_problems(mistral, 2)
    assert f"sliding window of {mistral.sliding_window} tokens" in problem and "sliding_window: null" in problem
    mistral.sliding_window = None
    assert sp.model_problems(mistral, 2) == []


def test_left_padded_rows_are_refused() -> None:
    batch = Collator(pad_token_id=0)(SAMPLES)
    batch["attention_mask"] = batch["attention_mask"].flip(1)  # the short row's padding now comes first
    with pytest.raises(GymUserError, match="right-padded"):
        sp.shard_batch(batch, 2, 0)


@pytest.mark.parametrize("strategy", [GymDDPStrategy, GymFSDPStrategy, ZeRO3Strategy])
def test_strategies_refuse_a_size_below_one(strategy: type) -> None:
    with pytest.raises(GymUserError, match="sequence_parallel_size must be an integer >= 1"):
        strategy(sequence_parallel_size=0)


def test_gym_fit_names_a_size_that_does_not_divide_the_ranks_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        *("fit", "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "1"),
        *("--trainer.strategy", "gym_lightning.strategies.GymDDPStrategy"),
        *("--trainer.strategy.sequence_parallel_size", "2", "--trainer.default_root_dir", str(tmp_path)),
        *("--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--data.dataset", "addition"),
    ]
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "sequence_parallel_size=2 does not divide the 1 rank(s)" in err
    assert "Training data" not in err  # refused before the data and the model were prepared


def test_gym_train_flag_sets_the_strategy_argument() -> None:
    base = ["--model_name_or_path", "tiny-llama", "--dataset", "addition", "--sequence_parallel_size", "2"]
    args = dict(a[2:].split("=", 1) for a in to_cli_args(parse_train_args(base), env={})[1:])
    strategy = json.loads(args["trainer.strategy"])
    assert strategy["class_path"] == "gym_lightning.strategies.ddp.GymDDPStrategy"
    assert strategy["init_args"]["sequence_parallel_size"] == 2
    ds = ["--deepspeed", "configs/deepspeed/ds_zero3.json"]
    args = dict(a[2:].split("=", 1) for a in to_cli_args(parse_train_args([*base, *ds]), env={})[1:])
    assert json.loads(args["trainer.strategy"])["init_args"]["sequence_parallel_size"] == 2


def test_shifted_labels_give_the_same_loss() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 7, 11), torch.randint(0, 11, (2, 7))
    labels[0, :3] = IGNORE_INDEX
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    torch.testing.assert_close(summed_cross_entropy(logits, labels), summed_cross_entropy(logits, shifted, True))


def test_tiled_mlps_give_the_same_loss_and_gradients() -> None:
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=97
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    tiled = LlamaForCausalLM(config)
    tiled.load_state_dict(plain.state_dict())
    count = TileCount(5)
    assert tile_mlps(tiled, count) == 2 == len(dense_mlps(plain))
    ids = torch.randint(0, 97, (2, 13))
    calls = {}
    for name, model in (("plain", plain), ("tiled", tiled)):
        calls[name] = 0
        model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls == {"plain": 1, "tiled": 10}  # 5 tiles in forward, each recomputed in backward
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert list(plain.state_dict()) == list(tiled.state_dict())  # the same names: checkpoints and exports agree


def test_an_alst_deepspeed_config_brings_its_sequence_parallel_size() -> None:
    config = {"zero_optimization": {"stage": 3}, "sequence_parallel_size": 2}
    strategy = ZeRO3Strategy(config=config)
    assert strategy.sequence_parallel_size == 2
    assert "sequence_parallel_size" not in strategy.config  # DeepSpeed would divide its data-parallel world by it
    assert config["sequence_parallel_size"] == 2  # the caller's dict is left alone
    with pytest.raises(GymUserError, match="sequence_parallel_size=4 disagrees with the DeepSpeed config's 2"):
        ZeRO3Strategy(config=config, sequence_parallel_size=4)
