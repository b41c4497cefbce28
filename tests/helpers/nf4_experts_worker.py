"""Worker for tests/quant/test_nf4_experts.py: ``python nf4_experts_worker.py SPEC.json`` (Lightning starts rank 1).

Each phase builds a 4-bit model (``model.quantization``) of a MoE folder under one sharding strategy and, at the
start of fit (before any step: the fit stops there), writes from rank 0 the full NF4 expert tensors as the ranks
hold them (gathered through the strategy). A phase with ``save`` first flips bit 0 of every NF4 expert tensor on
every rank (a state no load can give) and saves a checkpoint there; a phase with ``resume`` resumes from that
checkpoint, so what it writes is what the checkpoint restored. Each phase also reports the shapes of the 3-D floating
tensors with storage its build made (none, when the experts are built in NF4 from the start).

Spec keys: ``out``, ``folder`` and ``quantization`` (``QuantizationArgs`` fields), ``phases``: ``name``, ``strategy``
(``strategy_worker.build_strategy``), optional ``folder``/``quantization`` overrides, ``save``/``resume`` (a
checkpoint name in ``out``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from helpers.full_state import full_model_state_dict
from helpers.strategy_worker import build_strategy
from helpers.strategy_worker import main as run_phases


class FloatFactories(TorchDispatchMode):
    """Records the shape of every floating tensor with storage (not on the meta device) that a factory op makes
    (``torch.empty`` and friends, under ``zero.Init``'s wrappers too)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.zeros)
        if made and isinstance(out, torch.Tensor) and out.is_floating_point() and not out.is_meta:
            self.shapes.append(tuple(out.shape))
        return out


class NF4Holder(pl.LightningModule):
    """The 4-bit model of ``folder``, built as the strategy's plan asks; it never takes a step."""

    def __init__(self, folder: str, quantization: dict[str, Any]) -> None:
        super().__init__()
        self.folder, self.quantization = folder, quantization
        self.model: torch.nn.Module | None = None
        self.made_3d_floats: list[tuple[int, ...]] = []

    def configure_model(self) -> None:
        from gym_lightning.models.loading import build_causal_lm
        from gym_lightning.models.plan import plan_of
        from gym_lightning.quant import QuantizationArgs

        if self.model is None:
            plan = plan_of(self.trainer.strategy)
            args = QuantizationArgs(**self.quantization)
            with FloatFactories() as made:
                self.model = build_causal_lm(self.folder, plan=plan, quantization=args, dtype="float32")
            self.made_3d_floats = sorted({shape for shape in made.shapes if len(shape) == 3})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise AssertionError("the fit stops at its start: no step runs")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 8, dtype=torch.long)), batch_size=1)


def _local(param: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``param`` (a DTensor's shard, a ZeRO-3 partition, or the tensor)."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param


class RecordExperts(Callback):
    """At the start of fit: optionally flip and save, then write the gathered NF4 expert tensors and stop."""

    def __init__(self, path: Path, save: Path | None) -> None:
        self.path, self.save = path, save

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        from gym_lightning.quant import experts as nf4_experts

        codes = nf4_experts.nf4_expert_weights(module.model)
        names = {f"{key}{suffix}" for key in codes for suffix in nf4_experts.SUFFIXES}
        if self.save is not None:
            with torch.no_grad():
                for name, param in module.model.named_parameters():
                    if name in names:
                        _local(param).bitwise_xor_(1)
            trainer.save_checkpoint(self.save)
        state = full_model_state_dict(trainer.strategy, module.model)
        if trainer.is_global_zero:
            kept = {key: value for key, value in state.items() if key in names}
            kept["__local__"] = {
                name: list(_local(param).shape) for name, param in module.model.named_parameters() if name in names
            }
            torch.save(kept, self.path)
        trainer.should_stop = True


def run_phase(spec: dict[str, Any], phase: dict[str, Any], out: Path) -> dict[str, Any]:
    pl.seed_everything(3)
    save = out / phase["save"] if phase.get("save") else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=build_strategy(spec, phase),
        precision="32-true",
        max_steps=1,
        callbacks=[RecordExperts(out / f"{phase['name']}.pt", save)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    ckpt = str(out / phase["resume"]) if phase.get("resume") else None
    quantization = {**spec.get("quantization", {}), **phase.get("quantization", {})}
    module = NF4Holder(phase.get("folder", spec["folder"]), quantization)
    trainer.fit(module, ckpt_path=ckpt)
    return {"steps": trainer.global_step, "made_3d_floats": module.made_3d_floats}


if __name__ == "__main__":
    run_phases(sys.argv[1], run_phase)
