"""2-rank CPU worker for benchmarks/run.py: gym_lightning strategies against the plain loops users would write instead.

Launched by ``torchrun --nproc_per_node 2 --master_port <free port> benchmarks/workers/dist_bench.py spec.json``
(``OMP_NUM_THREADS=1``). ``spec.json`` lists runs executed IN ORDER in this one job (benchmarks/run.py interleaves
the two sides of each comparison), so both sides share the process group, the warm imports and the same load from
other processes. Every run trains the same synthetic batches (per rank), the same model shape and AdamW; the first
``warmup`` optimizer steps are not timed. Rank 0 appends one JSON line per run to ``<out>/results.jsonl``:
``{"name", "kind", "seconds", "steps", "tokens"}`` (tokens: the job's tokens in the timed steps).

Kinds:
    gym_zero    Trainer + ZeROStrategy(config=<the run's JSON config>)
    ds_engine   deepspeed.initialize(config=<the same JSON config>) + engine.backward / engine.step
    gym_fsdp    Trainer + GymFSDPStrategy
    fsdp2       fully_shard per decoder layer, then the root; loss.backward / optimizer.step
    gym_ddp     Trainer + GymDDPStrategy
    ddp         torch DistributedDataParallel loop
    ddp_nosync  the same loop under ``no_sync()`` every step: no gradient all-reduce (comm-free reference)
    single      rank 0 alone, no wrapper (the 1 rank x 1 thread reference); rank 1 sleeps until it is done
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (fit_vs_plain's StepClock)

from fit_vs_plain import StepClock

from gym_lightning.data.loader import STEP_TOKENS_KEY
from gym_lightning.loss import count_target_tokens, summed_cross_entropy
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.optim import weight_decay_groups

LR = 1e-3
KINDS = ("gym_zero", "ds_engine", "gym_fsdp", "fsdp2", "gym_ddp", "ddp", "ddp_nosync", "single")


def make_batches(run: dict[str, Any], rank: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """Fixed random token batches for ``rank`` (no padding), in the batch contract of gym_lightning."""
    generator = torch.Generator().manual_seed(1000 + rank)
    batch, seq = run["batch_size"], run["seq_len"]
    batches = []
    for _ in range(run["warmup"] + run["steps"]):
        ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        b = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": ids.clone(),
            "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
        }
        b[STEP_TOKENS_KEY] = count_target_tokens(b["labels"])
        batches.append(b)
    return batches


def build_model(run: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_causal_lm("tiny-llama", config_overrides=run.get("overrides") or None).train()


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """CausalLMModule's optimizer: AdamW over its two parameter groups (matrices / biases and norms), its default
    weight decay 0. The group count matters: ZeRO-1/2 run one gradient-norm all-reduce and one parameter all-gather
    per group, so one group on the peer's side only would be a different workload."""
    return torch.optim.AdamW(weight_decay_groups(model.named_parameters(), 0.0), lr=LR)


def local_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a hand-written loop does: mean token cross-entropy of the local batch."""
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    ).logits
    return summed_cross_entropy(logits, batch["labels"]) / batch[STEP_TOKENS_KEY].clamp(min=1)


def timed_loop(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], step_fn: Any) -> float:
    """Seconds from the end of the warm-up steps to the end of the last step (rank-local clock)."""
    t0 = 0.0
    for index, batch in enumerate(batches):
        step_fn(batch)
        if index + 1 == run["warmup"]:
            t0 = time.perf_counter()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------- plain loops
def run_ds_engine(run: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> float:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing process group
    model = build_model(run)
    optimizer = adamw(model)
    engine, _, _, _ = deepspeed.initialize(
        # DeepSpeed's device rank: on CPU it must be given (the local rank), as any CPU user of the engine does.
        args=argparse.Namespace(device_rank=int(os.environ["LOCAL_RANK"])),
        config=copy.deepcopy(run["ds_config"]),
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        dist_init_required=False,
    )

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss = local_loss(engine, batch)
        engine.backward(loss)
        engine.step()

    seconds = timed_loop(run, batches, step)
    engine.destroy()
    return seconds


def run_fsdp2(run: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> float:
    from torch.distributed.fsdp import fully_shard

    model = build_model(run)
    for layer in model.model.layers:  # one unit per decoder layer, then the root (torchtitan's recipe)
        fully_shard(layer)
    fully_shard(model)
    return _torch_loop(run, batches, model)


def run_ddp(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], no_sync: bool) -> float:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(run))
    return _torch_loop(run, batches, model, sync=model.no_sync if no_sync else nullcontext)


def run_single(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], flag: Path) -> float:
    """Rank 0 trains alone; rank 1 sleeps (polling a file, so it burns no CPU in a collective) until it is done."""
    seconds = 0.0
    if dist.get_rank() == 0:
        seconds = _torch_loop(run, batches, build_model(run))
        flag.write_text("done")
    else:
        while not flag.exists():
            time.sleep(0.05)
    dist.barrier()
    if dist.get_rank() == 0:
        flag.unlink()
    return seconds


def _torch_loop(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], model: Any, sync: Any = nullcontext):
    optimizer = adamw(model)

    def step(batch: dict[str, torch.Tensor]) -> None:
        with sync():
            local_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_loop(run, batches, step)


# ------------------------------------------------------------------------------------------------- gym_lightning
def gym_strategy(run: dict[str, Any]) -> Any:
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

    if run["kind"] == "gym_zero":
        return ZeROStrategy(config=copy.deepcopy(run["ds_config"]))
    if run["kind"] == "gym_fsdp":
        return GymFSDPStrategy()
    return GymDDPStrategy()


def run_gym(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], out: Path) -> float:
    """``Trainer.fit`` of ``CausalLMModule`` on the same batches, set up for speed (no validation, no checkpoints)."""
    from gym_lightning.callbacks import NonFiniteGuard
    from gym_lightning.module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(
        model="tiny-llama", config_overrides=run.get("overrides") or None, lr=LR, scheduler="constant"
    )
    clock = StepClock(run["warmup"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=gym_strategy(run),
        precision="32-true",
        max_steps=len(batches),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        logger=False,
        log_every_n_steps=50,
        use_distributed_sampler=False,  # each rank already has its own batches
        default_root_dir=str(out),
        callbacks=[clock, NonFiniteGuard()],  # gym fit adds it to every run (it used to live inside the module)
    )
    trainer.fit(module, datamodule=ReadyBatches(batches, run["batch_size"]))
    return clock.t1 - clock.t0


class ReadyBatches(pl.LightningDataModule):
    """A data module over ready batches: collation is not compared here (fit_vs_plain covers the data path).

    ``batch_size`` is what ZeROStrategy reads as DeepSpeed's ``train_micro_batch_size_per_gpu``.
    """

    def __init__(self, batches: list[dict[str, torch.Tensor]], batch_size: int) -> None:
        super().__init__()
        self.batches, self.batch_size = batches, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)


def execute(run: dict[str, Any], out: Path) -> float:
    from gym_lightning.models.presets import preset_config

    vocab = preset_config("tiny-llama").vocab_size
    batches = make_batches(run, dist.get_rank(), vocab)
    kind = run["kind"]
    if kind.startswith("gym_"):
        return run_gym(run, batches, out)
    if kind == "ds_engine":
        return run_ds_engine(run, batches)
    if kind == "fsdp2":
        return run_fsdp2(run, batches)
    if kind in ("ddp", "ddp_nosync"):
        return run_ddp(run, batches, no_sync=kind == "ddp_nosync")
    if kind == "single":
        return run_single(run, batches, out / "single.flag")
    raise ValueError(f"unknown run kind {kind!r}; expected one of {KINDS}")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    for run in spec["runs"]:
        dist.barrier()
        seconds = execute(run, out)
        world = 1 if run["kind"] == "single" else dist.get_world_size()
        tokens = world * run["steps"] * run["batch_size"] * run["seq_len"]
        if dist.get_rank() == 0:
            record = {**{k: run[k] for k in ("name", "kind")}, "seconds": seconds, "steps": run["steps"]}
            with (out / "results.jsonl").open("a") as handle:
                handle.write(json.dumps({**record, "tokens": tokens}) + "\n")
            print(f"{run['name']:>24} {run['kind']:>10} {tokens / seconds:10,.0f} tok/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
