"""Chunked LM head + cross-entropy: the same loss and gradients as the full-logits loss, in fp32."""

from __future__ import annotations

import pytest
import torch

from gym_lightning import CausalLMModule
from gym_lightning.lora import LoRAArgs
from gym_lightning.loss import (
    CHUNKED_LOSS_MIN_VOCAB,
    IGNORE_INDEX,
    chunked_summed_cross_entropy,
    num_loss_chunks,
    summed_cross_entropy,
    use_chunked_loss,
)

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
    assert module._loss_is_chunked() == (chunking == "on")
    loss, count, _ = module._summed_loss(batch)
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
    loss, _, _ = module._summed_loss(batch)
    monkeypatch.undo()
    assert torch.isfinite(loss) and reads == []


def test_auto_chunks_large_vocabularies_only() -> None:
    small = CausalLMModule("tiny-llama", config_overrides={**VOCAB_SHAPE, "vocab_size": 1024})
    large = CausalLMModule("tiny-llama", config_overrides={**VOCAB_SHAPE, "vocab_size": 70_000})
    off = CausalLMModule("tiny-llama", config_overrides={**VOCAB_SHAPE, "vocab_size": 70_000}, loss_chunking="off")
    for module in (small, large, off):
        module.configure_model()
    assert [m._loss_is_chunked() for m in (small, large, off)] == [False, True, False]
    boundary = [use_chunked_loss("auto", CHUNKED_LOSS_MIN_VOCAB - 1), use_chunked_loss("auto", CHUNKED_LOSS_MIN_VOCAB)]
    assert boundary == [False, True] and use_chunked_loss("on", 10) and not use_chunked_loss("off", 10**6)
