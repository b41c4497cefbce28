"""Training throughput of ``Trainer.fit`` (CausalLMModule + CausalLMDataModule) against a plain PyTorch loop.

Both sides train the same initial weights on the same collated batches, in the same order (the data module's own
training loader, seeded), with the same AdamW parameter groups and learning-rate schedule, in this one CPU process.
They step alternately within one run (a plain step just before each even fit step and just after each odd one, see
``InterleavedSteps``), so that whatever slows the machine down hits both sides alike; the first ``--warmup``
steps of every run are not timed. Both sides process the same tokens per step, so a ratio of step times is a ratio
of throughputs; the one printed is run.py's (benchmarks/ratios.py: the median of the per-step-pair ratios, with a
bootstrap interval).

The fit run is configured the way a user would for a speed run: no validation, no checkpointing, no export,
progress bar refreshed every 50 steps, metrics logged every 50 steps (CSV logger).

    python -m benchmarks.fit_vs_plain            # 5 runs of 120 timed steps per side
    python -m benchmarks.fit_vs_plain --quick    # 3 runs of 50 timed steps per side
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.optim.lr_scheduler import LambdaLR

from benchmarks.common.ratios import CONFIDENCE, speed_ratio
from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.data.loader import STEP_TOKENS_KEY
from gym_lightning.loss import summed_cross_entropy
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.optim import build_optimizer, lr_multiplier, resolve_warmup_steps, weight_decay_groups

LR, WARMUP_RATIO = 3e-3, 0.1  # the schedule both sides use (the module's and the plain loop's)


class StepClock(pl.Callback):
    """Timestamps the end of training batch ``start`` and of every later batch (nothing else per step).

    ``step_seconds``: the duration of each timed step (from the end of one batch to the end of the next), the
    per-step samples benchmarks/run.py computes medians and confidence intervals from.
    """

    def __init__(self, start: int) -> None:
        self.start, self.t0, self.t1 = start, 0.0, 0.0
        self.step_seconds: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if trainer.global_step == self.start:
            self.t0 = now
        elif trainer.global_step > self.start:
            self.step_seconds.append(now - self.t1)
        self.t1 = now


def make_datamodule(args: argparse.Namespace) -> CausalLMDataModule:
    dm = CausalLMDataModule(dataset=args.dataset, batch_size=args.batch_size, max_seq_length=64, seed=args.seed)
    dm.setup("fit")
    return dm


def timed_tokens(dm: CausalLMDataModule, warmup: int, steps: int) -> tuple[int, list[int]]:
    """Non-padding tokens of the timed batches, and a fingerprint of the first batches (to check both sides)."""
    batches = list(zip(range(warmup + steps), dm.train_dataloader(), strict=False))
    if len(batches) < warmup + steps:
        raise ValueError(f"The data has {len(batches)} batches per epoch; ask for fewer than warm-up + steps.")
    tokens = sum(int(b["attention_mask"].sum()) for _, b in batches[warmup:])
    return tokens, [int(b["input_ids"].sum()) for _, b in batches[:3]]


class PlainLoop:
    """The hand-written loop, one step at a time: its own copy of the initial weights, the module's default AdamW
    (``optim="adamw_torch_fused"``: the same kernel and parameter groups) and cosine schedule, and its own iterator
    over the data module's training loader (the same batches in the same order as ``Trainer.fit`` gets).

    Args:
        init: Initial weights (copied).
        dm: The data module (set up).
        total: Steps of the run (warm-up included), for the schedule.
    """

    def __init__(self, init: torch.nn.Module, dm: CausalLMDataModule, total: int) -> None:
        self.model = copy.deepcopy(init).train()
        groups = weight_decay_groups(self.model.named_parameters(), 0.0)
        self.optimizer = build_optimizer("adamw_torch_fused", groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
        warmup_steps = resolve_warmup_steps(0, WARMUP_RATIO, total)
        schedule = partial(lr_multiplier, name="cosine", warmup_steps=warmup_steps, total_steps=total, min_lr_ratio=0.0)
        self.scheduler = LambdaLR(self.optimizer, schedule)
        self.batches = iter(dm.train_dataloader())

    def step(self) -> int:
        """One optimizer step on the next batch; returns the batch's ``input_ids`` sum (to check the data)."""
        batch = next(self.batches, None)
        if batch is None:
            raise ValueError("The training loader ran out of batches.")
        logits = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
        loss = summed_cross_entropy(logits, batch["labels"]) / batch[STEP_TOKENS_KEY].clamp(min=1)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return int(batch["input_ids"].sum())


class InterleavedSteps(pl.Callback):
    """Runs one step of a peer loop beside every ``Trainer.fit`` step, alternately just before it (even batches) and
    just after it (odd ones), and times both sides step by step, on this rank's clock.

    Why interleave steps rather than whole runs: here the same loop's median step moves by up to 34 % from one run
    to the next in one process (41-55 ms at batch 64, 1 Dec 2026), while two copies of the plain loop stepping
    alternately stay within 0.7-2.8 % of each other in every run (``A/B`` 0.972-0.993 over 6 runs of 120 steps). With
    whole runs alternating, that drift set the width of the interval (half-widths of 3-17 % in three verdict passes
    of 30 Nov 2026, docs/benchmarks-history.md).

    ``fit_seconds``: each fit step's duration, from one ``on_train_batch_end`` to the next minus the peer steps run
    in between (so Lightning's loop, data fetching, hooks and logging are all counted). ``peer_seconds``: each peer
    step's duration. Both from batch ``warmup`` on (``warmup >= 1``: a fit step is timed from the one before it).

    Args:
        peer_step: Runs the peer's step for fit batch ``batch_idx`` (on every rank, so that collectives match).
        warmup: Untimed steps.
    """

    def __init__(self, peer_step: Callable[[int], None], warmup: int) -> None:
        if warmup < 1:
            raise ValueError("InterleavedSteps needs warmup >= 1: a fit step is timed from the end of the one before.")
        self.peer_step, self.warmup = peer_step, warmup
        self.fit_seconds: list[float] = []
        self.peer_seconds: list[float] = []
        self.last_end, self.excluded = 0.0, 0.0

    def _peer(self, batch_idx: int) -> None:
        start = time.perf_counter()
        self.peer_step(batch_idx)
        seconds = time.perf_counter() - start
        self.excluded += seconds
        if batch_idx >= self.warmup:
            self.peer_seconds.append(seconds)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % 2 == 0:
            self._peer(batch_idx)

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if batch_idx >= self.warmup:
            self.fit_seconds.append(now - self.last_end - self.excluded)
        self.last_end, self.excluded = now, 0.0
        if batch_idx % 2 == 1:
            self._peer(batch_idx)


def paired_run(
    init: torch.nn.Module, dm: CausalLMDataModule, warmup: int, steps: int, logdir: str, fingerprint: list[int]
) -> tuple[list[float], list[float]]:
    """Seconds of each timed step of the plain loop and of ``Trainer.fit``, stepping alternately in one run (see
    ``InterleavedSteps``), on the same initial weights and batches.

    The fit is configured the way a user would for a speed run: no validation, no checkpointing, progress bar and
    CSV logging every 50 steps; no ``NonFiniteGuard`` (``gym fit`` adds it to every run, the plain loop checks
    nothing, so benchmarks/overhead.py reports the guard's cost as its own lines).
    """
    module = CausalLMModule(model="tiny-llama", lr=LR, warmup_ratio=WARMUP_RATIO, scheduler="cosine")
    module.model = copy.deepcopy(init)  # configure_model keeps a model that is already there
    plain = PlainLoop(init, dm, warmup + steps)

    def plain_step(batch_idx: int) -> None:
        seen = plain.step()
        if batch_idx < len(fingerprint) and seen != fingerprint[batch_idx]:
            raise RuntimeError("The plain loop saw different batches than the data module's loader.")

    pairing = InterleavedSteps(plain_step, warmup)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=50,
        logger=CSVLogger(logdir),
        callbacks=[pairing, TQDMProgressBar(refresh_rate=50)],
    )
    trainer.fit(module, datamodule=dm)
    return pairing.peer_seconds, pairing.fit_seconds


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 runs of 50 timed steps (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="runs (each: both sides, steps interleaved)")
    parser.add_argument("--steps", type=int, default=120, help="timed steps per run (warm-up + steps <= 1 epoch)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of every run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="tiny-llama", help="a preset name")
    parser.add_argument("--dataset", default="addition")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a busy CPU)")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warmup = 3, 50, 10
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(args.seed, verbose=False)
    init = build_causal_lm(args.model)
    dm = make_datamodule(args)
    tokens, fingerprint = timed_tokens(dm, args.warmup, args.steps)
    plain, fit = [], []
    with tempfile.TemporaryDirectory() as logdir:
        for _ in range(args.repeats):
            plain_seconds, fit_seconds = paired_run(init, dm, args.warmup, args.steps, logdir, fingerprint)
            plain.append(plain_seconds)
            fit.append(fit_seconds)
    report(args, tokens, plain, fit)


def report(args: argparse.Namespace, tokens: int, plain: list[list[float]], fit: list[list[float]]) -> None:
    """Per-run median step times of both sides, and the ratio as run.py's section 1 computes it."""
    ratio, low, high = speed_ratio(fit, plain, paired_steps=True)
    plain_ms, fit_ms = ([statistics.median(run) * 1e3 for run in side] for side in (plain, fit))
    print(
        f"\n{args.model}, batch {args.batch_size}, {args.steps} timed steps after {args.warmup} warm-up steps, "
        f"{tokens:,} non-padding tokens per run, {args.repeats} runs, steps interleaved, {args.threads} thread(s).\n"
        "fit: no validation, no checkpointing, progress bar every 50 steps, CSV logging every 50 steps.\n"
    )
    print("| loop | median ms per step, per run: median (min-max) |\n|---|---|")
    print(f"| plain PyTorch | {summary(plain_ms)} |\n| Trainer.fit | {summary(fit_ms)} |")
    print(
        f"\nratio plain/fit step (= fit/plain tokens/s), median of the per-step-pair ratios: {ratio:.3f} "
        f"[{CONFIDENCE:.0%} interval {low:.3f}, {high:.3f}] (benchmarks/ratios.py)"
    )


if __name__ == "__main__":
    main()
