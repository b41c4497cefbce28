"""Tiny random Hugging Face folders of the model families users bring, as a user has them: ``save_pretrained`` in
bf16, split into several safetensors files (with an index), the shipped tokenizer beside them.

Every folder has hidden size 64 and 2 layers; the mixtures of experts keep their real structure (router, top-k of
several experts, shared experts where the family has them, a dense first layer for DeepSeek-V3), so what
``from_pretrained`` does to their checkpoints (per-expert tensors fused into 3-D expert tensors) happens here too.
The folders are made by ``benchmarks.common.models`` (re-exported here); this module adds the tests' runs of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common.models import (  # noqa: F401  (re-exported to the tests)
    COMMON,
    FAMILIES,
    LORA_TARGETS,
    MOE_FAMILIES,
    TOKENIZER,
    family_config,
    make_family_folder,
)

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
