"""Training worker for multi-rank strategy tests: ``python strategy_worker.py SPEC.json``.

Every local rank runs this script with the same argv (``helpers.dist.run_ranks``), so every rank reads the same spec.
The spec lists phases that run one after the other in the same processes (one process-group start for several
assertions): each phase is a ``Trainer.fit`` whose per-micro-batch global losses and final full weights (gathered
through ``helpers.full_state.full_model_state_dict``) are written by global rank 0.

Models: ``"mlp"`` is a plain LightningModule classifier that knows nothing of gym_lightning (the "import into an
existing project" case); ``"causal"`` is gym_lightning's ``CausalLMModule`` on a tiny Llama with variable-length,
partly masked sequences, so that the token-normalised loss across ranks and accumulation steps is exercised.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset
from torchmetrics import MeanMetric

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from helpers.full_state import full_model_state_dict

# --------------------------------------------------------------------------------------------- plain Lightning model


def same_order_sampler(trainer: pl.Trainer, dataset: Dataset) -> Sampler | None:
    """On one process, the order Lightning's distributed sampler gives the union of the ranks' batches.

    Lightning always replaces a training sampler by ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)`` on
    several ranks; rank r takes permutation[r::world]. So batch j of a single process with ``world x`` the batch
    size over the same permutation holds exactly the samples of batch j on all ranks.
    """
    if trainer.world_size > 1:
        return None  # Lightning installs the distributed sampler itself
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)


class ClassifierMLP(pl.LightningModule):
    """A two-layer MLP classifier; deliberately plain Lightning (no gym_lightning imports)."""

    def __init__(self, lr: float = 0.05, optimizer: str = "adamw", metric_in_step: bool = False) -> None:
        super().__init__()
        self.lr, self.optimizer = lr, optimizer
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        # The usual Lightning pattern: a torchmetrics metric called (as a module) in training_step and logged.
        self.train_acc = MeanMetric() if metric_in_step else None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        if self.train_acc is not None:
            self.train_acc((logits.argmax(-1) == y).float().mean())
            self.log("train/acc", self.train_acc, on_step=True)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":  # plain SGD: any error in the gradient's scale shows in the weights
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def mlp_dataset(size: int) -> Dataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(size, 16, generator=generator)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return TensorDataset(x, y)


class MLPData(pl.LightningDataModule):
    def __init__(self, size: int, batch_size: int) -> None:
        super().__init__()
        self.size, self.batch_size = size, batch_size

    def train_dataloader(self) -> DataLoader:
        dataset = mlp_dataset(self.size)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=same_order_sampler(self.trainer, dataset))


# --------------------------------------------------------------------------------------------- CausalLMModule


class TokenDataset(Dataset):
    """Sequences of 5..16 tokens whose first 2..4 tokens are prompt (label -100): lengths differ per rank."""

    def __init__(self, size: int, vocab: int = 200) -> None:
        generator = torch.Generator().manual_seed(4321)
        self.rows = []
        for index in range(size):
            length = 5 + (index * 7) % 12
            ids = torch.randint(3, vocab, (length,), generator=generator)
            labels = ids.clone()
            labels[: 2 + index % 3] = -100
            self.rows.append((ids, labels))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[index]


def collate_tokens(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    batch = {key: torch.zeros(len(rows), width, dtype=torch.long) for key in ("input_ids", "attention_mask")}
    batch["labels"] = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = ids
        batch["attention_mask"][i, : len(ids)] = 1
        batch["labels"][i, : len(ids)] = labels
    batch["position_ids"] = torch.arange(width).expand(len(rows), width).clone()
    return batch


class TokenData(pl.LightningDataModule):
    def __init__(self, size: int, batch_size: int) -> None:
        super().__init__()
        self.size, self.batch_size = size, batch_size

    def train_dataloader(self) -> DataLoader:
        from gym_lightning.data.loader import StepTokenDataLoader

        dataset = TokenDataset(self.size)
        return StepTokenDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=same_order_sampler(self.trainer, dataset),
            collate_fn=collate_tokens,
            accumulate_grad_batches=self.trainer.accumulate_grad_batches,
        )


def causal_module(
    spec: dict[str, Any], preset: bool = False, lora: bool = False, loss_chunk_tokens: int = 0
) -> pl.LightningModule:
    """``loss_chunk_tokens`` > 0: the chunked loss with chunks of that many positions (else the tiny vocabulary's
    default, unchunked); ``lora``: LoRA adapters on q_proj and v_proj."""
    from gym_lightning.lora import LoRAArgs
    from gym_lightning.module import CausalLMModule

    chunking = {"loss_chunking": "on", "loss_chunk_tokens": loss_chunk_tokens} if loss_chunk_tokens else {}
    if spec.get("model_dir") and not preset:
        # Same initial weights everywhere (ZeRO-3's init draws random numbers differently).
        adapters = LoRAArgs(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
        # A larger step for adapters: LoRA's B starts at zero, and the export checks need it to have moved.
        lr = spec.get("lr", 3e-3) * (10 if lora else 1)
        return CausalLMModule(model=spec["model_dir"], lr=lr, scheduler="constant", lora=adapters, **chunking)
    return CausalLMModule(
        model="tiny-llama", config_overrides=TINY_OVERRIDES, lr=spec.get("lr", 3e-3), scheduler="constant", **chunking
    )


TINY_OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64}


def records() -> list[dict[str, str]]:
    """24 prompt/completion pairs whose completions differ in length (so token weighting across ranks matters)."""
    completions = [" ".join(str(i * 7 + k) for k in range(1 + (i * 5) % 6)) for i in range(24)]
    return [{"prompt": f"{i}+{i}=", "completion": completion} for i, completion in enumerate(completions)]


def save_tiny_pretrained(folder: Path) -> Path:
    """A tiny Llama with HF's own initialisation, saved as a local pretrained folder (weights + tokenizer)."""
    from gym_lightning.models.loading import build_causal_lm
    from gym_lightning.tokenizer import load_tokenizer

    torch.manual_seed(0)
    build_causal_lm("tiny-llama", config_overrides=TINY_OVERRIDES).save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------------------------- running phases


class RecordLosses(Callback):
    """Global mean (over ranks) of each micro-batch's returned loss, on every rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))


class RecordZero3Trace(Callback):
    """After each batch, the state of DeepSpeed ZeRO-3's module trace ("record", "complete" or "invalid")."""

    def __init__(self) -> None:
        self.modes: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from gym_lightning.strategies.zero.trace import zero3_parameter_offload

        offload = zero3_parameter_offload(trainer.strategy.model)
        if offload is None:  # not a ZeRO-3 engine
            return
        coordinator = offload.get_param_coordinator()
        checks = {"complete": coordinator.is_complete_trace, "invalid": coordinator.is_invalid_trace}
        self.modes.append(next((mode for mode, check in checks.items() if check()), "record"))


@contextmanager
def zero3_trace_fix(enabled: bool) -> Generator[None, None, None]:
    """Run with gym_lightning's ZeRO-3 trace fix switched off when not ``enabled`` (the control run)."""
    import gym_lightning.strategies.zero.strategy as gym_deepspeed

    original = gym_deepspeed.keep_zero3_trace_valid
    if not enabled:
        gym_deepspeed.keep_zero3_trace_valid = lambda engine: 0
    try:
        yield
    finally:
        gym_deepspeed.keep_zero3_trace_valid = original


def build_strategy(spec: dict[str, Any], phase: dict[str, Any]) -> Any:
    import gym_lightning.strategies as strategies

    strategy = phase.get("strategy", spec.get("strategy", "auto"))
    if isinstance(strategy, dict):
        return getattr(strategies, strategy["class"])(**strategy.get("kwargs", {}))
    return strategy


def shard_report(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """Local vs. full element counts of the parameters (what this rank actually stores)."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for param in module.parameters():
        if isinstance(param, DTensor):
            local += param.to_local().numel()
            full += param.numel()
        elif hasattr(param, "ds_numel"):  # DeepSpeed ZeRO-3 partition
            local += param.ds_tensor.numel()
            full += param.ds_numel
        else:
            local += param.numel()
            full += param.numel()
    return {"local_numel": local, "full_numel": full}


PROBE = [[5, 9, 12, 40, 7, 3, 22, 8, 17, 2]]


def export_callbacks(phase: dict[str, Any], out: Path) -> list[Callback]:
    """``HFExport`` at the end of fit, one per LoRA mode the phase asks for, into ``<out>/<name>.export-<mode>``."""
    from gym_lightning.callbacks.hf_export import HFExport

    return [HFExport(output_dir=str(out / f"{phase['name']}.export-{mode}"), lora=mode) for mode in phase["export"]]


def probe_logits(module: pl.LightningModule) -> torch.Tensor:
    """The trained model's logits on a fixed input; every rank runs it (a collective under sharding)."""
    module.model.eval()
    with torch.no_grad():
        return module.model(input_ids=torch.tensor(PROBE)).logits.float().cpu()


def run_phase(spec: dict[str, Any], phase: dict[str, Any], out: Path) -> dict[str, Any]:
    pl.seed_everything(spec.get("seed", 7), workers=True)
    is_causal = spec["model"] == "causal"
    module = (
        causal_module(spec, phase.get("preset", False), phase.get("lora", False), phase.get("loss_chunk_tokens", 0))
        if is_causal
        else ClassifierMLP(optimizer=phase.get("optimizer", "adamw"), metric_in_step=phase.get("metric_in_step", False))
    )
    data_cls = TokenData if is_causal else MLPData
    data = data_cls(phase.get("dataset_size", spec["dataset_size"]), spec["batch_size"])
    recorder, tracer = RecordLosses(), RecordZero3Trace()
    callbacks: list[Callback] = [recorder, tracer]
    if phase.get("save_dir"):
        callbacks.append(ModelCheckpoint(dirpath=out / phase["save_dir"], save_last=True, save_top_k=0))
    if phase.get("export"):
        callbacks += export_callbacks(phase, out)
    trainer = pl.Trainer(
        accelerator=spec.get("accelerator", "cpu"),
        devices=spec.get("devices", 2),
        num_nodes=spec.get("num_nodes", 1),
        strategy=build_strategy(spec, phase),
        precision=phase.get("precision", spec.get("precision", "32-true")),
        max_epochs=phase["max_epochs"],
        accumulate_grad_batches=phase.get("accumulate", spec.get("accumulate", 1)),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(phase.get("save_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=False,
    )
    ckpt = str(out / phase["resume_from"] / "last.ckpt") if phase.get("resume_from") else None
    with zero3_trace_fix(phase.get("zero3_trace_fix", True)):
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    target = module.model if is_causal else module.net
    state = full_model_state_dict(trainer.strategy, target)
    logits = probe_logits(module) if phase.get("export") else None
    if trainer.is_global_zero:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / f"{phase['name']}.pt")
        if logits is not None:
            torch.save(logits, out / f"{phase['name']}.logits.pt")
    report = shard_report(trainer, module)
    trainer.strategy.barrier()
    return {"losses": recorder.losses, "global_step": trainer.global_step, "zero3_trace": tracer.modes, **report}


PhaseRunner = Callable[[dict[str, Any], dict[str, Any], Path], dict[str, Any]]


def main(spec_path: str, run: PhaseRunner = run_phase) -> None:
    """Run the spec's phases with ``run`` in this process (each rank does) and write rank 0's results."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    torch.set_num_threads(1)
    results = {phase["name"]: run(spec, phase, out) for phase in spec["phases"]}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    if torch.distributed.is_initialized():
        # While Python is fully alive, as torch asks (pytorch #190489): a group left to the interpreter's
        # finalisation aborted a finished 2-node gym_fsdp run now and then ("terminate called without an active
        # exception", exit -6).
        torch.distributed.destroy_process_group()
    # ...and it still did once in CI (2-node gym_fsdp, node 1 exit -6 after node 0 had finished): gloo's C++ threads
    # can outlive the group and need the GIL while the interpreter finalises (pytorch #179291). Nothing is left to do
    # once the results are written and the group is gone, so the worker ends without that finalisation; faulthandler
    # (``helpers.dist.rank_env``) prints the Python stacks should a rank abort anywhere else.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
