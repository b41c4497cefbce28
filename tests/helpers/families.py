"""Tiny random Hugging Face folders of the model families users bring, as a user has them: ``save_pretrained`` in
bf16, split into several safetensors files (with an index), the shipped tokenizer beside them.

Every folder has hidden size 64 and 2 layers; the mixtures of experts keep their real structure (router, top-k of
several experts, shared experts where the family has them, a dense first layer for DeepSeek-V3), so what
``from_pretrained`` does to their checkpoints (per-expert tensors fused into 3-D expert tensors) happens here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from helpers.dist import REPO_ROOT

TOKENIZER = REPO_ROOT / "gym_lightning" / "assets" / "tokenizer"
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
# What each family needs beyond COMMON to be itself at this size (expert counts, MLA ranks, ...).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "gemma3_text": {"sliding_window": 32, "tie_word_embeddings": True},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # DeepseekV3Config sets head_dim = qk_rope_head_dim; the rotary embedding is that wide
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
}
# Families without q_proj / v_proj: fused attention (Phi-3), multi-head latent attention (DeepSeek-V3).
LORA_TARGETS = {"phi3": ["qkv_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"]}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def family_config(family: str, **overrides: Any) -> Any:
    """The tiny config of ``family`` (vocabulary: the shipped tokenizer's)."""
    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER))
    return AutoConfig.for_model(family, vocab_size=vocab, **{**COMMON, **FAMILIES[family], **overrides})


def make_family_folder(family: str, folder: Path, seed: int = 0, max_shard_size: str = "200KB") -> Path:
    """A tiny random bf16 ``family`` model saved (several safetensors files) with the shipped tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------ gym fit runs
PROBE_IDS = (torch.arange(2 * 24).reshape(2, 24) * 7 + 3) % 500  # two rows of token ids every model accepts


class LogitsProbe(pl.Callback):
    """Every rank runs the model on ``PROBE_IDS`` (a collective under sharding) before the first step and at the
    end of fit; rank 0 saves both logits and the dtype the weights are held in: the first is compared with the
    source folder (the sharded load), the second with the reloaded export.

    Args:
        path: Where rank 0 writes ``{"start": ..., "end": ..., "dtype": ...}``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["start"], _ = self._logits(pl_module)
        pl_module.model.train()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["end"], dtype = self._logits(pl_module)
        if trainer.is_global_zero:
            torch.save({**self.seen, "dtype": str(dtype)}, self.path)

    @staticmethod
    def _logits(pl_module: pl.LightningModule) -> tuple[torch.Tensor, torch.dtype]:
        """The probe's logits (fp32, on the host) and the dtype the model computed them in: the dtype its weights
        are held in for compute (gym_fsdp's bf16 gathered parameters, not its fp32 shards; ZeRO-3's bf16 module)."""
        pl_module.model.eval()
        with torch.no_grad():
            logits = pl_module.model(input_ids=PROBE_IDS.to(pl_module.device), use_cache=False).logits
        return logits.float().cpu(), logits.dtype


class StepLossProbe(pl.Callback):
    """Writes every micro-batch's share of the optimizer step's loss, summed over ranks, to ``path`` (rank 0).

    Each rank's training loss is its summed token loss x ranks x accumulation / the step's target tokens
    (``gym_lightning.loss.step_loss_scale``); divided by the ranks and summed over them it is the part of the step's
    token mean that the micro-batch holds, whatever the ranks hold of it (whole rows, or a slice of every row under
    sequence parallelism), so one process and any number of ranks write the same numbers.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"].detach().float().reshape(1) / trainer.world_size
        if trainer.world_size > 1:
            torch.distributed.all_reduce(loss)
        self.losses.append(loss.item())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            torch.save(torch.tensor(self.losses), self.path)


def family_run_config(
    family: str,
    strategy: str,
    lora: bool,
    folder: Path,
    out: Path,
    checkpoints: bool = True,
    step_losses: bool = False,
    **changes: Any,
) -> Path:
    """The shipped YAML of ``strategy`` as a user points it at a ``family`` folder: 2 optimizer steps in
    bf16-mixed, a checkpoint at the end (unless ``checkpoints=False``), the end-of-fit export in float32 (so it
    holds exactly the trained weights) and the ``LogitsProbe``; MoE families ask their config for the router
    load-balancing loss. ``step_losses``: also the ``StepLossProbe`` (``losses.pt``)."""
    from helpers.cli_runs import run_config

    probes = [{"class_path": "helpers.families.LogitsProbe", "init_args": {"path": str(out / "logits.pt")}}]
    if step_losses:
        probes.append({"class_path": "helpers.families.StepLossProbe", "init_args": {"path": str(out / "losses.pt")}})
    settings: dict[str, Any] = {
        "trainer.max_steps": 2,
        "trainer.precision": "bf16-mixed",
        "model.model": str(folder),
        "model.tokenizer": str(folder),
        "export.dtype": "float32",
        "data.batch_size": 2,
    }
    if lora and family in LORA_TARGETS:
        settings["model.lora.target_modules"] = LORA_TARGETS[family]
    if family in MOE_FAMILIES and family != "deepseek_v3":  # DeepSeek-V3 balances without an auxiliary loss
        settings["model.config_overrides"] = {"output_router_logits": True}
    return run_config(strategy, lora, out, callbacks=probes, checkpoints=checkpoints, **{**settings, **changes})


def reloaded_logits(folder: Path, dtype: str) -> torch.Tensor:
    """``PROBE_IDS``' logits from ``folder`` loaded in plain transformers, every weight held in ``dtype`` as in
    the run (from_pretrained keeps some in fp32, e.g. DeepSeek-V3's router, which DeepSpeed holds in bf16)."""
    held = getattr(torch, dtype.removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=held)
    for param in model.parameters():  # parameters only: buffers such as the rotary inv_freq stay fp32, as in the run
        param.data = param.data.to(held)
    with torch.no_grad():
        return model.eval()(input_ids=PROBE_IDS, use_cache=False).logits.float()
