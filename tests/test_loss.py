"""Chunked LM head + cross-entropy: the same loss and gradients as the full-logits loss, in fp32."""

from __future__ import annotations

import multiprocessing
import socket
from types import SimpleNamespace

import pytest
import torch

from gym_lightning import CausalLMModule
from gym_lightning.lora import LoRAArgs
from gym_lightning.loss import (
    CHUNKED_LOSS_MIN_VOCAB,
    IGNORE_INDEX,
    AgreedCounts,
    chunked_summed_cross_entropy,
    labels_of,
    num_loss_chunks,
    start_max_counts,
    summed_cross_entropy,
    use_chunked_loss,
)
from gym_lightning.protocols import SHIFT_LABELS_KEY, AgreesCallCounts
from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeRO3Strategy

# A vocabulary large enough that a chunk is a small part of it; tiny layers keep the test under a few seconds.
VOCAB_SHAPE = {"vocab_size": 8192, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}


def _labels(batch: int, seq: int, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, -7:] = IGNORE_INDEX  # right padding
    return labels


@pytest.mark.parametrize(("chunk_tokens", "num_chunks"), [(7, 0), (64, 0), (1000, 0), (16, 9)])
def test_chunked_cross_entropy_equals_the_full_one(chunk_tokens: int, num_chunks: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 21, 16, requires_grad=True)
    head = torch.nn.Linear(16, 500, bias=False)
    labels = _labels(3, 21, 500)
    full = summed_cross_entropy(head(hidden), labels)
    full_grads = torch.autograd.grad(full, [hidden, head.weight])
    chunked = chunked_summed_cross_entropy(hidden, head, labels, chunk_tokens, num_chunks)
    chunked_grads = torch.autograd.grad(chunked, [hidden, head.weight])
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-5)
    for got, expected in zip(chunked_grads, full_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_num_loss_chunks_counts_shifted_positions() -> None:
    labels = torch.zeros(2, 9, dtype=torch.long)  # 2 x 8 shifted positions
    assert [num_loss_chunks(labels, n) for n in (1, 8, 15, 16, 100)] == [16, 2, 2, 1, 1]


def _loss_and_grads(chunking: str, lora: LoRAArgs | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    module = CausalLMModule(
        "tiny-qwen3", config_overrides=VOCAB_SHAPE, attn_implementation="eager", lora=lora,
        loss_chunking=chunking, loss_chunk_tokens=13,
    )  # fmt: skip
    module.configure_model()
    generator = torch.Generator().manual_seed(5)
    batch = {
        "input_ids": torch.randint(0, 8192, (2, 24), generator=generator),
        "attention_mask": torch.ones(2, 24, dtype=torch.long),
        "labels": _labels(2, 24, 8192),
    }
    batch["attention_mask"][1, -7:] = 0
    assert module.engine.chunked(module.model) == (chunking == "on")
    loss, count, _ = module.engine.token_loss(module.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert count == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    return loss.detach(), grads


@pytest.mark.parametrize("lora", [None, LoRAArgs(r=4, target_modules=["q_proj", "v_proj", "lm_head"])])
def test_module_loss_and_gradients_do_not_change_with_chunking(lora: LoRAArgs | None) -> None:
    """Tied embeddings (the presets tie them) and LoRA, the LM head adapted too: chunking changes no number."""
    torch.manual_seed(1)
    full_loss, full_grads = _loss_and_grads("off", lora)
    torch.manual_seed(1)
    chunked_loss, chunked_grads = _loss_and_grads("on", lora)
    torch.testing.assert_close(chunked_loss, full_loss, rtol=1e-6, atol=1e-5)
    assert chunked_grads.keys() == full_grads.keys() and chunked_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_chunk_count_of_one_rank_is_never_read_back_from_a_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU every .item() stops the host until the forward has run: the count comes from the labels' shape.
    module = CausalLMModule("tiny-qwen3", config_overrides=VOCAB_SHAPE, loss_chunking="on", loss_chunk_tokens=13)
    module.configure_model()
    batch = {"input_ids": torch.randint(0, 8192, (2, 24)), "labels": _labels(2, 24, 8192)}
    reads: list[torch.Tensor] = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    loss, _, _ = module.engine.token_loss(module.model, batch)
    monkeypatch.undo()
    assert torch.isfinite(loss) and reads == []


def test_auto_chunks_large_vocabularies_only() -> None:
    small = CausalLMModule("tiny-llama", config_overrides={**VOCAB_SHAPE, "vocab_size": 1024})
    large = CausalLMModule("tiny-llama", config_overrides={**VOCAB_SHAPE, "vocab_size": 70_000})
    off = CausalLMModule("tiny-llama", config_overrides={**VOCAB_SHAPE, "vocab_size": 70_000}, loss_chunking="off")
    for module in (small, large, off):
        module.configure_model()
    assert [m.engine.chunked(m.model) for m in (small, large, off)] == [False, True, False]
    boundary = [use_chunked_loss("auto", CHUNKED_LOSS_MIN_VOCAB - 1), use_chunked_loss("auto", CHUNKED_LOSS_MIN_VOCAB)]
    assert boundary == [False, True] and use_chunked_loss("on", 10) and not use_chunked_loss("off", 10**6)


def test_labels_of_takes_a_sequence_parallel_slice_s_shifted_targets() -> None:
    labels, shifted = torch.zeros(1, 4), torch.ones(1, 4)
    assert labels_of({"labels": labels}) == (labels, False)
    got, is_shifted = labels_of({"labels": labels, SHIFT_LABELS_KEY: shifted})
    assert got is shifted and is_shifted


class FixedCounts:
    """A strategy that agrees on fixed counts (``protocols.AgreesCallCounts``), recording what it was asked."""

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.asked = counts, []

    def start_agreed_counts(self, local: list[int]) -> AgreedCounts:
        self.asked.append(local)
        return AgreedCounts(self.counts)


def test_the_strategy_s_agreed_counts_set_the_lm_head_calls_and_mlp_tiles() -> None:
    """Another rank's longer batch: the counts the strategy answers, not this rank's, decide the calls (ZeRO-3)."""
    module = CausalLMModule(
        "tiny-qwen3", config_overrides=VOCAB_SHAPE, loss_chunking="on", loss_chunk_tokens=13, mlp_tile_tokens=16
    )
    module.configure_model()
    strategy = FixedCounts([7, 5])
    module._trainer = SimpleNamespace(strategy=strategy)  # the one thing the loss asks of the Trainer
    head_calls: list[int] = []
    module.model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    batch = {"input_ids": torch.randint(0, 8192, (2, 24)), "labels": _labels(2, 24, 8192)}
    loss, _, _ = module.engine.token_loss(module.model, batch)
    assert strategy.asked == [[4, 3]] and module.engine.tiles.value == 5  # 2 x 23 positions / 13; 48 / 16
    assert len(head_calls) == 1 + 7 and torch.isfinite(loss)  # the model's own call on no position, then 7 chunks


@pytest.mark.parametrize("cls", [GymDDPStrategy, GymFSDPStrategy, ZeRO3Strategy])
def test_the_gym_strategies_provide_the_protocol_and_keep_one_rank_s_counts(cls: type) -> None:
    strategy = cls()
    strategy.parallel_devices = [torch.device("cpu")]  # one rank, no process group: the counts are its own
    counts = strategy.start_agreed_counts([3, 4])
    assert isinstance(strategy, AgreesCallCounts) and (counts[0], counts[1]) == (3, 4)


def _max_counts_on_rank(rank: int, port: int, results: multiprocessing.Queue) -> None:
    torch.distributed.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        counts = start_max_counts([1 + rank, 5 - 3 * rank])
        results.put((rank, counts[1], counts[0], counts[1]))  # read twice: the all-reduce is waited for once
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_agree_on_the_largest_counts_over_a_host_tensor() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_max_counts_on_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    got = sorted(results.get(timeout=60) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert got == [(0, 5, 2, 5), (1, 5, 2, 5)]
