"""ZeRO-3 host memory phase by phase on 2 CPU ranks: DeepSpeed's stage-3 defaults + foreach-free AdamW vs the derived
limits + fused AdamW.

    python benchmarks/zero3_phases.py [--layers 12 --hidden 1024 --intermediate 2816 --seq 256 --batch 4]

Each variant is its own 2-process job (Lightning's launcher, gloo, 1 thread per rank): a random-init Llama-shaped
``CausalLMModule`` (shipped tokenizer, so the embedding is small and the layers dominate; 154M parameters with the
defaults) trains 2 steps on random tokens. A callback records each rank's RSS and its running peak (``ru_maxrss``)
before ``configure_model``, after ``deepspeed.initialize`` (train start), after optimizer step 1 and after step 2.
``before``: the ZeRO-3 config gym_lightning generated until now (no ``stage3_*`` limits: DeepSpeed's 1e9-element
defaults) and ``adamw_torch``; ``after``: the registered ``zero3`` (limits from the layer size) and the module's
default ``adamw_torch_fused``. Prints one markdown table (rank 0 and rank 1, MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import torch

PHASES = ("before configure_model", "after deepspeed.initialize", "after step 1", "after step 2")


class PhaseMemory(pl.Callback):
    """RSS and running peak RSS of this rank at each phase, written to ``<out>/rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, {}

    def _record(self, trainer: pl.Trainer, phase: str) -> None:
        rss = psutil.Process().memory_info().rss / 2**20
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        self.rows[phase] = (rss, peak)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._record(trainer, PHASES[0])

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, PHASES[1])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._record(trainer, PHASES[1 + trainer.global_step])


def _strategy(variant: str) -> Any:
    from gym_lightning.strategies import ZeRO3Strategy
    from gym_lightning.strategies.zero.config import zero_config

    if variant == "after":
        return "zero3"
    old = zero_config(3, "none", "none", None, False, 200_000_000)
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        old["zero_optimization"].pop(key)
    return ZeRO3Strategy(config=old)


def worker(args: argparse.Namespace) -> None:
    from gym_lightning import CausalLMModule

    torch.manual_seed(0)
    shape = {"num_hidden_layers": args.layers, "hidden_size": args.hidden, "intermediate_size": args.intermediate}
    optim = "adamw_torch_fused" if args.worker == "after" else "adamw_torch"
    module = CausalLMModule("tiny-llama", config_overrides={**shape, "num_key_value_heads": 4}, optim=optim)
    vocab = 256
    ids = torch.randint(3, vocab, (8 * args.batch, args.seq))
    rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]
    loader = torch.utils.data.DataLoader(rows, batch_size=args.batch)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(args.worker), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[PhaseMemory(Path(args.out))],
    )  # fmt: skip
    trainer.fit(module, loader)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("layers", 12), ("hidden", 1024), ("intermediate", 2816), ("seq", 256), ("batch", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    shape = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "intermediate", "seq", "batch")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    for variant in ("before", "after"):
        out = Path(tempfile.mkdtemp(prefix=f"zero3-{variant}-"))
        command = [sys.executable, __file__, *shape, "--worker", variant, "--out", str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        results[variant] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    print("| phase | before: RSS / peak (rank 0; rank 1) | after: RSS / peak (rank 0; rank 1) |")
    print("|---|---|---|")
    for phase in PHASES:
        cells = [
            "; ".join(f"{ranks[r][phase][0]:,.0f} / {ranks[r][phase][1]:,.0f}" for r in (0, 1))
            for ranks in results.values()
        ]
        print(f"| {phase} | {cells[0]} MiB | {cells[1]} MiB |")


if __name__ == "__main__":
    main()
