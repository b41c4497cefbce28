"""Training throughput of ``Trainer.fit`` (CausalLMModule + CausalLMDataModule) against a plain PyTorch loop.

Both sides train the same initial weights on the same collated batches, in the same order (the data module's own
training loader, seeded), with the same AdamW parameter groups and learning-rate schedule, in this one CPU process.
Runs alternate (plain, fit, plain, fit, ...) so that load from other processes hits both alike; the first
``--warmup`` steps of every run are not timed. Throughput counts non-padding tokens (``attention_mask`` ones).

The fit run is configured the way a user would for a speed run: no validation, no checkpointing, no export,
progress bar refreshed every 50 steps, metrics logged every 50 steps (CSV logger).

    python benchmarks/fit_vs_plain.py            # 5 pairs of 120 timed steps
    python benchmarks/fit_vs_plain.py --quick    # 3 pairs of 50 timed steps
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import tempfile
import time
import warnings
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.optim.lr_scheduler import LambdaLR

from gym_lightning import CausalLMDataModule, CausalLMModule, NonFiniteGuard
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


def plain_run(init: torch.nn.Module, dm: CausalLMDataModule, warmup: int, steps: int) -> tuple[list[float], list[int]]:
    """Seconds of each timed step of a hand-written loop, and the fingerprint of its first batches."""
    model = copy.deepcopy(init).train()
    # The module's default optimizer (``optim="adamw_torch_fused"``): the same AdamW kernel on both sides.
    groups = weight_decay_groups(model.named_parameters(), 0.0)
    optimizer = build_optimizer("adamw_torch_fused", groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    total = warmup + steps
    schedule = partial(
        lr_multiplier,
        name="cosine",
        warmup_steps=resolve_warmup_steps(0, WARMUP_RATIO, total),
        total_steps=total,
        min_lr_ratio=0.0,
    )
    scheduler = LambdaLR(optimizer, schedule)
    seen, ends = [], []
    for step, batch in enumerate(dm.train_dataloader()):
        if step < 3:
            seen.append(int(batch["input_ids"].sum()))
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
        loss = summed_cross_entropy(logits, batch["labels"]) / batch[STEP_TOKENS_KEY].clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step + 1 >= warmup:
            ends.append(time.perf_counter())
        if step + 1 == total:
            return [b - a for a, b in itertools.pairwise(ends)], seen
    raise ValueError("The training loader ran out of batches.")


def fit_run(
    init: torch.nn.Module, dm: CausalLMDataModule, warmup: int, steps: int, logdir: str, guard: bool = False
) -> list[float]:
    """Seconds of each timed step of ``Trainer.fit`` on the same data module and initial weights.

    ``guard``: add ``NonFiniteGuard`` (``gym fit`` adds it to every run). The plain loop checks nothing, so the
    ratio runs without it and benchmarks/overhead.py reports the guard's cost as its own line.
    """
    module = CausalLMModule(model="tiny-llama", lr=LR, warmup_ratio=WARMUP_RATIO, scheduler="cosine")
    module.model = copy.deepcopy(init)  # configure_model keeps a model that is already there
    clock = StepClock(warmup)
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
        callbacks=[clock, TQDMProgressBar(refresh_rate=50), *([NonFiniteGuard()] if guard else [])],
    )
    trainer.fit(module, datamodule=dm)
    return clock.step_seconds


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 pairs of 50 timed steps (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (plain, fit)")
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
            step_seconds, seen = plain_run(init, dm, args.warmup, args.steps)
            if seen != fingerprint:
                raise RuntimeError("The plain loop saw different batches than the data module's loader.")
            plain.append(tokens / sum(step_seconds))
            fit.append(tokens / sum(fit_run(init, dm, args.warmup, args.steps, logdir)))
    report(args, tokens, plain, fit)


def report(args: argparse.Namespace, tokens: int, plain: list[float], fit: list[float]) -> None:
    ratio = statistics.median(fit) / statistics.median(plain)
    pairs = [f / p for f, p in zip(fit, plain, strict=True)]
    print(
        f"\n{args.model}, batch {args.batch_size}, {args.steps} timed steps after {args.warmup} warm-up steps, "
        f"{tokens:,} non-padding tokens per run, {args.repeats} alternating pairs, {args.threads} thread(s).\n"
        "fit: no validation, no checkpointing, progress bar every 50 steps, CSV logging every 50 steps.\n"
    )
    print("| loop | tokens/s, median (min-max) |\n|---|---|")
    print(f"| plain PyTorch | {summary(plain)} |\n| Trainer.fit | {summary(fit)} |")
    print(f"\nratio fit/plain (medians): {ratio:.3f} (per pair {min(pairs):.3f}-{max(pairs):.3f}); target >= 0.95")


if __name__ == "__main__":
    main()
