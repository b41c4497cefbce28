"""The LM engine: one forward pass of a causal LM for every training objective (``gym_lightning.objectives``).

It runs a Hugging Face causal LM over a batch of the shared contract (``data.collate``) and returns what objectives
need, never a loss of its own choosing:

- ``token_loss``: the summed next-token cross-entropy over the target tokens and their count (supervised
  finetuning, continued pretraining);
- ``sequence_logps``: per sequence, the sum of its target tokens' log-probabilities and their count (preference
  objectives compare the sums of a policy and a reference), for padded rows (one sequence a row) and padding-free
  packed rows (``cu_seq_lens``: several a row).

Both keep the memory rules of the forward: the LM head and the cross-entropy in chunks for large vocabularies
(``loss.chunked_summed_cross_entropy``), Liger's fused linear cross-entropy where configured (token sums only: its
kernel has no per-sequence output), MLP tiling (``models.tiling``), and call counts every rank agrees on, because
ZeRO-3 gathers the LM head's and each MLP's weight on every call (``protocols.AgreesCallCounts``). The engine holds
no model: it is handed the one to run (the policy, or a frozen reference), so it knows nothing of parallelism.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from gym_lightning.errors import GymUserError
from gym_lightning.loss import (
    LOSS_CHUNKS,
    MLP_TILES,
    AgreedCounts,
    chunked_sequence_logps,
    chunked_summed_cross_entropy,
    count_target_tokens,
    labels_of,
    num_loss_chunks,
    sequence_ids,
    summed_cross_entropy,
    summed_sequence_logps,
    use_chunked_loss,
)
from gym_lightning.models.fused import FusedOps, liger_summed_linear_cross_entropy
from gym_lightning.models.tiling import TileCount, num_mlp_tiles, tile_mlps
from gym_lightning.protocols import SHIFT_LABELS_KEY

LossChunking = Literal["auto", "on", "off"]
AgreeCounts = Callable[[list[int]], AgreedCounts]


class SummedLoss(NamedTuple):
    """One micro-batch's summed target-token cross-entropy, its target-token count and, for a mixture of experts
    whose config sets ``output_router_logits``, its router load-balancing loss (``None`` otherwise)."""

    loss: torch.Tensor
    tokens: torch.Tensor
    router_aux: torch.Tensor | None = None


class SequenceLogps(NamedTuple):
    """Per sequence of a micro-batch: the summed log-probabilities of its target tokens (fp32) and how many there are,
    ``[num_sequences]`` each, in the batch's order (rows, or the documents of packed rows), plus the router loss."""

    logps: torch.Tensor
    tokens: torch.Tensor
    router_aux: torch.Tensor | None = None


@dataclass(frozen=True)
class EngineSettings:
    """How the forward runs (the module's ``loss_chunking``, ``loss_chunk_tokens``, ``mlp_tile_tokens``,
    ``fused_ops`` arguments document each)."""

    loss_chunking: LossChunking = "auto"
    loss_chunk_tokens: int = 1024
    mlp_tile_tokens: int | None = None
    fused_ops: FusedOps | None = None


@dataclass
class DecoderOutput:
    """The final hidden states a forward hook took from the decoder (``hooked``: a hook was placed)."""

    hooked: bool
    value: torch.Tensor | None = None


@contextmanager
def decoder_output(model: nn.Module) -> Iterator[DecoderOutput]:
    """Take the final hidden states (after the last norm) of ``model``'s decoder during the calls inside.

    Why not ``output_hidden_states=True``: transformers 5 records hidden states through hooks on the layers' own
    submodules that read a ContextVar, which dynamo cannot trace: inside a compiled decoder layer under activation
    checkpointing every layer fell back to eager (0 graphs). The decoder's output is the same tensor and the hook
    runs outside the layers. Models without ``get_decoder`` keep ``output_hidden_states``.
    """
    try:
        decoder = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        decoder = None
    # transformers' get_decoder falls back to the model itself, whose first output is the (empty) logits.
    captured = DecoderOutput(hooked=isinstance(decoder, nn.Module) and decoder is not model)
    if not captured.hooked:
        yield captured
        return

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        captured.value = output[0]  # ModelOutput and tuple alike: last_hidden_state first

    handle = decoder.register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model (inside a peft wrapper when LoRA is on)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _aux(outputs: Any) -> torch.Tensor | None:
    """The model's router load-balancing loss, where its forward computed one (transformers' MoE outputs)."""
    return getattr(outputs, "aux_loss", None)


def _model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch.get("attention_mask"),  # None for padding-free packed rows (data.collate)
        "position_ids": batch.get("position_ids"),
        "use_cache": False,
    }


class LMEngine:
    """Runs a causal LM for the objectives: token sums or per-sequence log-probability sums (module docstring).

    Args:
        settings: How the forward runs (chunked LM head, tiles, fused ops).
        agree_counts: Turns this rank's ``[loss chunks, MLP tiles]`` into the counts every rank makes (the
            strategy's agreement, started before the forward; ``loss.agreed_counts_of``).
    """

    def __init__(self, settings: EngineSettings, agree_counts: AgreeCounts) -> None:
        self.settings = settings
        self.agree_counts = agree_counts
        self.tiles = TileCount()  # set before each training forward (models.tiling)
        self._chunked: bool | None = None  # decided on the first forward, once a model exists

    def tile(self, model: nn.Module) -> int:
        """Make ``model``'s dense MLPs run in the tiles this engine sets (``mlp_tile_tokens``); returns how many."""
        return tile_mlps(model, self.tiles) if self.settings.mlp_tile_tokens is not None else 0

    def token_loss(self, model: nn.Module, batch: dict[str, Any]) -> SummedLoss:
        """The summed target-token cross-entropy of ``model`` on ``batch``, its target tokens and router loss."""
        labels, shifted = labels_of(batch)
        chunked = self.chunked(model)
        counts = self._start_counts(labels, shifted, chunked)
        if not chunked:
            outputs = model(**_model_inputs(batch))
            loss = summed_cross_entropy(outputs.logits, labels, shifted)
            return SummedLoss(loss, count_target_tokens(labels, shifted), _aux(outputs))
        hidden, outputs = self._hidden_states(model, batch, labels)
        head = base_model_of(model).get_output_embeddings()
        chunks = counts[LOSS_CHUNKS]  # agreed over host memory while the forward ran: no device is waited for
        if self._liger_loss(head):
            loss = liger_summed_linear_cross_entropy(hidden, head.weight, labels, shifted, head.bias)
            return SummedLoss(loss, count_target_tokens(labels, shifted), _aux(outputs))
        loss = chunked_summed_cross_entropy(hidden, head, labels, self.settings.loss_chunk_tokens, chunks, shifted)
        return SummedLoss(loss, count_target_tokens(labels, shifted), _aux(outputs))

    def sequence_logps(self, model: nn.Module, batch: dict[str, Any]) -> SequenceLogps:
        """Per sequence of ``batch`` (rows, or packed documents), ``model``'s summed target-token log-probabilities
        and target-token counts. A sequence-parallel rank holds slices of sequences, not whole ones: refused."""
        if SHIFT_LABELS_KEY in batch:
            raise GymUserError(
                "Per-sequence log-probabilities need whole sequences on each rank; sequence parallelism splits them. "
                "Set the strategy's sequence_parallel_size to 1 for this objective."
            )
        labels = batch["labels"]
        ids, count = sequence_ids(batch)
        chunked = self.chunked(model)
        counts = self._start_counts(labels, False, chunked)
        if not chunked:
            outputs = model(**_model_inputs(batch))
            logps, tokens = summed_sequence_logps(outputs.logits, labels, ids, count)
            return SequenceLogps(logps, tokens, _aux(outputs))
        hidden, outputs = self._hidden_states(model, batch, labels)
        head = base_model_of(model).get_output_embeddings()
        chunk_tokens = self.settings.loss_chunk_tokens
        logps, tokens = chunked_sequence_logps(hidden, head, labels, ids, count, chunk_tokens, counts[LOSS_CHUNKS])
        return SequenceLogps(logps, tokens, _aux(outputs))

    def _hidden_states(self, model: nn.Module, batch: dict[str, Any], labels: torch.Tensor) -> tuple[Any, Any]:
        """The whole model runs (so FSDP's root hooks unshard and keep the head's weight for backward) with no
        position kept for the LM head: it returns ``[batch, 0, vocab]`` logits; the final hidden states are the
        decoder's output, taken by a hook on it."""
        base = base_model_of(model)
        keep_none = torch.empty(0, dtype=torch.long, device=labels.device)
        with decoder_output(base) as captured:
            outputs = model(**_model_inputs(batch), logits_to_keep=keep_none, output_hidden_states=not captured.hooked)
        hidden = captured.value if captured.hooked else outputs.hidden_states[-1]
        if hidden is None:
            raise RuntimeError(f"{type(base).__name__}'s decoder was not called in its forward")
        return hidden, outputs

    def _liger_loss(self, head: nn.Module) -> bool:
        """Whether the loss runs Liger's fused linear cross-entropy (``fused_ops.kernels: liger``): it reads the head's
        weight itself, so only where that weight is a whole plain tensor here (not a ZeRO-3 partition, an FSDP
        DTensor shard or a LoRA-wrapped head, which the chunked loss calls as a module instead)."""
        ops = self.settings.fused_ops
        if ops is None or ops.kernels != "liger" or not ops.linear_cross_entropy:
            return False
        weight = getattr(head, "weight", None)
        return type(head) is nn.Linear and type(weight) is nn.Parameter and weight.dim() == 2

    def chunked(self, model: nn.Module) -> bool:
        """Whether the LM head runs in chunks (``loss_chunking``; ``auto``: large vocabularies), decided once."""
        if self._chunked is None:
            base = base_model_of(model)
            supported = "logits_to_keep" in inspect.signature(base.forward).parameters
            setting = self.settings.loss_chunking
            if setting == "on" and not supported:
                raise GymUserError(
                    f"loss_chunking='on' needs a model whose forward takes logits_to_keep; {type(base).__name__} "
                    "does not. Set loss_chunking to 'auto' or 'off'."
                )
            vocab = getattr(base.config, "vocab_size", 0) or 0
            ops = self.settings.fused_ops
            if setting == "auto" and ops is not None and ops.linear_cross_entropy:
                setting = "on"  # the fused linear cross-entropy: the LM head and the loss together, never whole logits
            self._chunked = supported and use_chunked_loss(setting, vocab)
        return self._chunked

    def _start_counts(self, labels: torch.Tensor, shifted: bool, chunked: bool) -> AgreedCounts:
        """The number of LM-head chunks and of MLP tiles this micro-batch runs, ``[chunks, tiles]``
        (``loss.LOSS_CHUNKS``, ``loss.MLP_TILES``), as every rank agrees on them: the strategy decides which need
        agreeing and how. The agreement starts before the forward so that, for the loss chunks, it overlaps it; it
        runs on host memory, so reading it never waits for the device. The tiles are set for the MLPs at once;
        tiling applies to gradient-tracking forwards only."""
        settings = self.settings
        tiled = settings.mlp_tile_tokens is not None and torch.is_grad_enabled()
        local = [
            num_loss_chunks(labels, settings.loss_chunk_tokens, shifted) if chunked else 1,
            num_mlp_tiles(labels.numel(), settings.mlp_tile_tokens) if tiled else 1,
        ]
        counts = self.agree_counts(local) if chunked or tiled else AgreedCounts(local)
        if tiled:
            self.tiles.value = counts[MLP_TILES]  # this rank's own unless the strategy gathers MLPs per call
        return counts


__all__ = [
    "DecoderOutput",
    "EngineSettings",
    "LMEngine",
    "SequenceLogps",
    "SummedLoss",
    "base_model_of",
    "decoder_output",
]
