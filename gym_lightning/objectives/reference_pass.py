"""TRL's ``precompute_ref_log_probs``: the reference model runs once over the preference data before training, and
the data module stores the values beside its prepared data (``protocols.StoresReferenceLogps``), so that training
holds no reference model at all and a resume reuses the stored values.

The pass runs in ``on_fit_start`` on every rank together (the data module splits the rows, every rank makes the
same forwards, as ZeRO-3's gathers need), with the reference ``objectives.preference.precompute_reference`` picks:
the policy with its adapters off (LoRA), a frozen copy of ``ref_model``, or the policy itself before its first step
(a full finetune).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from gym_lightning._compat import rank_zero_info
from gym_lightning.data.reference import model_fingerprint
from gym_lightning.protocols import StoresReferenceLogps


def reference_id(module: pl.LightningModule, ref_model: str | None, adapters_off: bool) -> str:
    """Names the reference whose values are stored: its source folder's files (or hub name) and what changes them."""
    source = ref_model or module.model_source
    hp = module.hparams
    details: dict[str, Any] = {"dtype": hp.get("torch_dtype"), "overrides": hp.get("config_overrides")}
    if adapters_off:
        details["adapters_off"] = True
    if not Path(source).is_dir() and ref_model is None and not hp.get("pretrained", True):
        details["random_init_seed"] = torch.initial_seed()  # a random policy: its values come from the seed
    return model_fingerprint(source, **details)


def precompute_reference_pass(
    module: pl.LightningModule, provider: Any, ref_model: str | None, adapters_off: bool
) -> None:
    """Store the log-probabilities ``provider`` (an ``objectives.preference.ReferenceLogps``) gives the data module's
    preference data (see the module docstring); ``ref_model`` and ``adapters_off`` name that reference."""
    store = getattr(module.trainer, "datamodule", None)
    if not isinstance(store, StoresReferenceLogps):
        # A user's own DataLoader: its batches must carry reference_logps themselves (the objective says so if not).
        rank_zero_info(
            f"gym_lightning: precompute_ref_log_probs: the data module ({type(store).__name__}) stores no reference "
            "log-probabilities; every batch must carry 'reference_logps' (CausalLMDataModule computes them)."
        )
        return
    provider.setup(module)
    device = module.device

    def logps(batch: dict[str, Any]) -> torch.Tensor:
        moved = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        with torch.no_grad():
            return provider.logps(module, moved).float().cpu()

    store.precompute_reference_logps(logps, reference_id(module, ref_model, adapters_off))


__all__ = ["precompute_reference_pass", "reference_id"]
