"""Greedy or sampled completion of left-padded prompts, and the exact-match score of completions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class GenerationArgs:
    """How completions are generated (validation's exact match and ``predict``).

    Args:
        max_new_tokens: Tokens generated after each prompt (>= 1).
        do_sample: False for greedy decoding, True for sampling with ``temperature``/``top_p``/``top_k``.
        temperature: Softmax temperature when sampling (> 0).
        top_p: Nucleus-sampling mass in (0, 1].
        top_k: Keep only the k most likely tokens when sampling; 0 disables it.
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def problems(self) -> list[str]:
        found = []
        if self.max_new_tokens < 1:
            found.append(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            found.append(f"generation.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            found.append(f"generation.top_p must be in (0, 1], got {self.top_p}")
        return found


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    args: GenerationArgs,
    synced_gpus: bool,
) -> list[str]:
    """Decode the tokens generated after each (left-padded) prompt.

    ``synced_gpus`` keeps every rank stepping until all are done, which sharded models (ZeRO-3, FSDP) need
    because each forward pass is a collective.
    """
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k} if args.do_sample else {}
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced_gpus,
        **sampling,
    )
    new_tokens = output[:, input_ids.shape[1] :]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def exact_match(predictions: list[str], references: list[str]) -> torch.Tensor:
    """1.0 where the prediction equals the reference after stripping surrounding white space, else 0.0."""
    return torch.tensor([float(p.strip() == r.strip()) for p, r in zip(predictions, references, strict=True)])
