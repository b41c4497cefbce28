"""Peak host memory per rank while a strategy loads a pretrained model (configure_model + strategy setup).

Writes (once) a random-init Llama-shaped folder of about 250M parameters as sharded bf16 safetensors (hidden 1024,
16 layers, vocabulary 32000, ``save_pretrained(max_shard_size="200MB")``), then runs ``Trainer.fit`` on 2 CPU ranks
with ``precision="bf16-mixed"`` and no training batch, so that fit stops right after the strategy has built, loaded
and sharded the model and built the optimizer. Each rank reports its resident memory when the Lightning module's
``setup`` hook runs (before ``configure_model``), its resident memory after strategy setup and its peak resident
memory so far (``getrusage``), and rank 0 prints one line per rank.

    python benchmarks/load_peak.py                                # gym_fsdp, folder under the system temp dir
    python benchmarks/load_peak.py --strategy zero3 --folder /data/llama250m
    python benchmarks/load_peak.py --torch-dtype float32          # fp32 weights whatever the strategy does

Run it on an otherwise idle machine: resident memory does not depend on load, but the run takes longer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from gym_lightning import CausalLMModule
from gym_lightning.metrics.memory import host_rss_bytes, peak_host_rss_bytes

SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
}
DEFAULT_FOLDER = Path(tempfile.gettempdir()) / "gym_lightning_load_peak_llama250m"
MIB = 2**20


def write_folder(folder: Path) -> None:
    """The random-init model in bf16, in 200 MB safetensors shards (run in its own process: it holds the model)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")
    from gym_lightning.tokenizer import load_tokenizer

    load_tokenizer(None).save_pretrained(folder)
    print(f"wrote {folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


class LoadMemory(Callback):
    """Resident memory before configure_model, after strategy setup, and the peak so far, printed by rank 0."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = host_rss_bytes()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning calls on_fit_start after strategy.setup: the model is loaded and sharded, the optimizer built.
        mine = torch.tensor([self.before, host_rss_bytes(), peak_host_rss_bytes() or 0], dtype=torch.float64)
        rows = trainer.strategy.all_gather(mine)
        if trainer.is_global_zero:
            for rank, (before, after, peak) in enumerate(rows.reshape(-1, 3).tolist()):
                print(
                    f"rank {rank}: RSS before configure_model {before / MIB:,.0f} MiB, after strategy setup "
                    f"{after / MIB:,.0f} MiB, peak {peak / MIB:,.0f} MiB"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--strategy", default="gym_fsdp")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--torch-dtype", default=None, help="CausalLMModule(torch_dtype=...); default: transformers'")
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_only:
        write_folder(args.folder)
        return
    if "LOCAL_RANK" not in os.environ and not (args.folder / "config.json").exists():
        subprocess.run([sys.executable, __file__, "--write-only", "--folder", str(args.folder)], check=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    module = CausalLMModule(model=str(args.folder), torch_dtype=args.torch_dtype, lr=1e-4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        precision=args.precision,
        limit_train_batches=0,  # stop after setup: this measures loading only
        max_epochs=1,
        callbacks=[LoadMemory()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=DataLoader([{"input_ids": torch.zeros(1, dtype=torch.long)}]))


if __name__ == "__main__":
    main()
