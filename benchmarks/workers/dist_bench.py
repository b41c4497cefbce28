"""2-rank CPU worker for benchmarks/run.py: gym_lightning strategies against the plain loops users would write instead.

Launched by ``torchrun --nproc_per_node 2 --master_port <free port> -m benchmarks.workers.dist_bench spec.json``
(``OMP_NUM_THREADS=1``). ``spec.json`` lists runs executed IN ORDER in this one job, so all runs share the process
group, the warm imports and the same load from other processes. A gym run with a ``"peer"`` kind steps that plain
loop alternately with its own steps (``fit_vs_plain.InterleavedSteps``): benchmarks/run.py compares each wrapper with
its peer that way, step k of both sides within milliseconds of each other. Every run trains the same synthetic
batches (per rank), the same model shape and AdamW; the first ``warmup`` optimizer steps are not timed. Rank 0
appends one JSON line per run (two for a run with a peer, one per side) to ``<out>/results.jsonl``:
``{"name", "kind", "seconds", "steps", "tokens", "step_tokens", "step_seconds"[, "probe"]}`` (tokens: the job's
tokens in the timed steps; step_seconds: rank 0's duration of each timed step; probe: workers/probe.py's per-step
component timings of a probed gym run). The plain data-parallel loops all-reduce each step's target-token count and
normalise the loss by it, as the wrappers do.

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
import itertools
import json
import os
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.fit_vs_plain import InterleavedSteps, StepClock
from benchmarks.workers.probe import StepProbe
from gym_lightning.data.loader import STEP_TOKENS_KEY
from gym_lightning.loss import count_target_tokens, summed_cross_entropy
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.optim import build_optimizer, weight_decay_groups

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
    """CausalLMModule's optimizer: its default ``optim="adamw_torch_fused"`` (the fused kernel on CPU) over its two
    parameter groups (matrices / biases and norms), weight decay 0. The group count matters: ZeRO-1/2 run one
    gradient-norm all-reduce and one parameter all-gather per group, so one group on the peer's side only would be a
    different workload; so does the kernel (fused against the for-loop AdamW)."""
    groups = weight_decay_groups(model.named_parameters(), 0.0)
    return build_optimizer("adamw_torch_fused", groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)


def forward_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal LM's logits for a collated batch, called as ``CausalLMModule`` calls it."""
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    ).logits


def step_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss a data-parallel loop needs for a token mean over the whole step: the local sum of token losses
    times world size / the step's target tokens summed over ranks (the gradient averaging divides by world size
    again). One all-reduce of the count per step, launched before the forward and waited for after it, as
    ``CausalLMModule`` does and as the HF Trainer does for ``num_items_in_batch``."""
    tokens = batch[STEP_TOKENS_KEY].to(torch.float32).reshape(1).clone()
    pending = dist.all_reduce(tokens, op=dist.ReduceOp.SUM, async_op=True)
    logits = forward_logits(model, batch)
    loss_sum = summed_cross_entropy(logits, batch["labels"])
    pending.wait()
    return loss_sum * (dist.get_world_size() / tokens[0].clamp(min=1.0))


def local_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The 1-rank reference (``single``): mean token cross-entropy of the local batch, nothing to reduce."""
    logits = forward_logits(model, batch)
    return summed_cross_entropy(logits, batch["labels"]) / batch[STEP_TOKENS_KEY].clamp(min=1)


def timed_loop(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], step_fn: Any) -> list[float]:
    """Seconds of each step after the warm-up steps (rank-local clock, end of one step to the end of the next)."""
    ends = []
    for index, batch in enumerate(batches):
        step_fn(batch)
        if index + 1 >= run["warmup"]:
            ends.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(ends)]


# ------------------------------------------------------------------------------------------------- plain loops
Step = Callable[[dict[str, torch.Tensor]], None]


def peer_stepper(run: dict[str, Any], kind: str) -> tuple[Step, Callable[[], None]]:
    """The training step of a plain loop (``ds_engine``, ``fsdp2``, ``ddp``, ``ddp_nosync``) on a fresh model, and
    what releases it after the run."""
    if kind == "ds_engine":
        return _ds_engine_step(run)
    model = build_model(run)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:  # one unit per decoder layer, then the root (torchtitan's recipe)
            fully_shard(layer)
        fully_shard(model)
        return _torch_step(run, model), lambda: None
    if kind in ("ddp", "ddp_nosync"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        return _torch_step(run, model, sync=model.no_sync if kind == "ddp_nosync" else nullcontext), lambda: None
    raise ValueError(f"{kind!r} is not a plain data-parallel loop; expected ds_engine, fsdp2, ddp or ddp_nosync")


def _ds_engine_step(run: dict[str, Any]) -> tuple[Step, Callable[[], None]]:
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
        loss = step_loss(engine, batch)
        engine.backward(loss)
        engine.step()

    return step, engine.destroy


def run_peer(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], kind: str) -> list[float]:
    """A plain loop alone (section 4's scaling runs, and any spec run without a ``peer``)."""
    step, close = peer_stepper(run, kind)
    seconds = timed_loop(run, batches, step)
    close()
    return seconds


def run_single(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], flag: Path) -> list[float]:
    """Rank 0 trains alone; rank 1 sleeps (polling a file, so it burns no CPU in a collective) until it is done."""
    seconds = [0.0]
    if dist.get_rank() == 0:
        seconds = timed_loop(run, batches, _torch_step(run, build_model(run), loss_fn=local_loss))
        flag.write_text("done")
    else:
        while not flag.exists():
            time.sleep(0.05)
    dist.barrier()
    if dist.get_rank() == 0:
        flag.unlink()
    return seconds


def _torch_step(run: dict[str, Any], model: Any, sync: Any = nullcontext, loss_fn: Any = None) -> Step:
    """A plain training step; the loss is ``step_loss`` (token count all-reduced) unless the run sets
    ``"step_tokens": false`` (section 4's scaling runs compare against one rank, which has nothing to reduce)."""
    optimizer = adamw(model)
    if loss_fn is None:
        loss_fn = step_loss if run.get("step_tokens", True) else local_loss

    def step(batch: dict[str, torch.Tensor]) -> None:
        with sync():
            loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------------------------- gym_lightning
def gym_strategy(run: dict[str, Any]) -> Any:
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

    if run["kind"] == "gym_zero":
        return ZeROStrategy(config=copy.deepcopy(run["ds_config"]))
    if run["kind"] == "gym_fsdp":
        return GymFSDPStrategy()
    return GymDDPStrategy()


def run_gym(run: dict[str, Any], batches: list[dict[str, torch.Tensor]], out: Path) -> dict[str, Any]:
    """``Trainer.fit`` of ``CausalLMModule`` on the same batches, set up for speed (no validation, no checkpoints).

    ``run["guard"]``: add ``NonFiniteGuard`` (``gym fit`` adds it to every run; the plain loops have no such check,
    so the ratio runs go without it). ``run["probe"]``: time the wrapper's own per-step costs (workers/probe.py).
    ``run["peer"]``: a plain loop's kind, stepped alternately with the fit on the same batches
    (``fit_vs_plain.InterleavedSteps``); its per-step seconds come back as ``peer_step_seconds``.
    """
    from gym_lightning.callbacks import NonFiniteGuard
    from gym_lightning.module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(
        model="tiny-llama", config_overrides=run.get("overrides") or None, lr=LR, scheduler="constant"
    )
    peer = peer_stepper(run, run["peer"]) if run.get("peer") else None
    clock = InterleavedSteps(lambda index: peer[0](batches[index]), run["warmup"]) if peer else StepClock(run["warmup"])
    guard = NonFiniteGuard() if run.get("guard") else None
    probe = StepProbe(run["warmup"]) if run.get("probe") else None
    callbacks = [c for c in (clock, guard, probe) if c is not None]
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
        callbacks=callbacks,
    )
    if probe is not None:
        probe.install(trainer, module, guard)
    trainer.fit(module, datamodule=ReadyBatches(batches, run["batch_size"]))
    if peer is not None:
        peer[1]()
        return {"step_seconds": clock.fit_seconds, "peer_step_seconds": clock.peer_seconds}
    if probe is None:
        return {"step_seconds": clock.step_seconds}
    probe.uninstall()
    return {"step_seconds": clock.step_seconds, "probe": probe.per_step()}


class ReadyBatches(pl.LightningDataModule):
    """A data module over ready batches: collation is not compared here (fit_vs_plain covers the data path).

    ``batch_size`` is what ZeROStrategy reads as DeepSpeed's ``train_micro_batch_size_per_gpu``.
    """

    def __init__(self, batches: list[dict[str, torch.Tensor]], batch_size: int) -> None:
        super().__init__()
        self.batches, self.batch_size = batches, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)


def execute(run: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one spec entry; ``{"step_seconds": [...]}`` (and ``"probe"`` for probed gym runs)."""
    from gym_lightning.models.presets import preset_config

    vocab = preset_config("tiny-llama").vocab_size
    batches = make_batches(run, dist.get_rank(), vocab)
    kind = run["kind"]
    if kind.startswith("gym_"):
        return run_gym(run, batches, out)
    if kind == "single":
        return {"step_seconds": run_single(run, batches, out / "single.flag")}
    if kind in KINDS:
        return {"step_seconds": run_peer(run, batches, kind)}
    raise ValueError(f"unknown run kind {kind!r}; expected one of {KINDS}")


def record(run: dict[str, Any], kind: str, measured: dict[str, Any], out: Path) -> None:
    """Append one side's result line to ``<out>/results.jsonl`` and print its throughput."""
    seconds = sum(measured["step_seconds"])
    world = 1 if kind == "single" else dist.get_world_size()
    tokens = world * run["steps"] * run["batch_size"] * run["seq_len"]
    line = {"name": run["name"], "kind": kind, "seconds": seconds, "steps": run["steps"], "tokens": tokens}
    line |= {"step_tokens": world * run["batch_size"] * run["seq_len"], **measured}
    with (out / "results.jsonl").open("a") as handle:
        handle.write(json.dumps(line) + "\n")
    print(f"{run['name']:>24} {kind:>10} {tokens / seconds:10,.0f} tok/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", type=Path, help="the job's spec.json (written by benchmarks.run)")
    spec = json.loads(parser.parse_args().spec.read_text())
    out = Path(spec["out"])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    for run in spec["runs"]:
        dist.barrier()
        measured = execute(run, out)
        peer_seconds = measured.pop("peer_step_seconds", None)
        if dist.get_rank() == 0:
            record(run, run["kind"], measured, out)
            if peer_seconds is not None:
                record(run, run["peer"], {"step_seconds": peer_seconds}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
