"""Peak host memory of the Hugging Face export, live (end of fit, 2 ranks) and from the run's checkpoint.

    python -m benchmarks.export_peak                         # ~270M Llama-shaped model, gym_fsdp and zero3, ~6 min
    python -m benchmarks.export_peak --strategies zero3 --hidden 512 --layers 4   # a quick look
    python -m benchmarks.export_peak --write-docs            # also replaces the section in docs/benchmarks.md

For each strategy: a random-init Llama-shaped folder saved as sharded bf16 safetensors (what a downloaded checkpoint
looks like), trained for one optimizer step in fp32 on 2 CPU ranks with a step checkpoint, exported at the end of fit
(``HFExport``, bf16 = the source dtype, ``--max_shard_size`` shards), then exported again from the checkpoint by
``gym export`` in a fresh process. A sampling thread (every 2 ms) reads each process's ``RssAnon`` (its private
memory) and ``RssFile`` (file pages mapped in, i.e. the memory-mapped checkpoint, reclaimable page cache) from
``/proc/self/status``; the figures are the peaks above the value just before the export started, next to the bound
it is held to (one shard plus one layer) and to the exporter's own floor (the largest tensor, gathered in fp32
and cast to bf16: the safetensors files are streamed tensor by tensor).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.docs import replace_section
from benchmarks.common.launch import child_env, python_module
from benchmarks.common.memory import PeakSampler
from benchmarks.common.models import write_random_folder
from benchmarks.common.paths import DOCS, MIB, REPO_ROOT

SECTION = "## Export peak memory"
RSS_FIELDS = ("RssAnon", "RssFile")


def above_base(sampler: PeakSampler) -> dict[str, float]:
    """The export's peaks above the process just before it, MiB (``RssAnon_MiB``, ``RssFile_MiB``)."""
    return {f"{key}_MiB": value / MIB for key, value in sampler.above_base().items()}


def make_folder(folder: Path, hidden: int, layers: int, vocab: int) -> dict[str, int]:
    """A random-init Llama-shaped model saved as sharded bf16 safetensors with the shipped tokenizer."""
    fields = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": int(hidden * 2.75), "num_attention_heads": hidden // 64,
              "num_key_value_heads": hidden // 64, "tie_word_embeddings": False}  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    model = write_random_folder(folder, fields, max_shard_size="200MB")
    largest = max(p.numel() for p in model.parameters())
    return {"params": sum(p.numel() for p in model.parameters()), "largest_numel": largest}


def train_and_export(args: argparse.Namespace) -> None:
    """One rank of the 2-rank run (Lightning launches the other with the same argv)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from gym_lightning import CausalLMDataModule, CausalLMModule, HFExport

    class MeasuredExport(Callback):
        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            export = HFExport(output_dir=str(args.out / "live"), max_shard_size=args.max_shard_size)
            trainer.strategy.barrier()
            start = time.perf_counter()
            with PeakSampler(RSS_FIELDS) as sampler:
                export.on_fit_end(trainer, pl_module)
            result = {"seconds": time.perf_counter() - start, **above_base(sampler)}
            (args.out / f"live-rank{trainer.global_rank}.json").write_text(json.dumps(result))

    torch.set_num_threads(1)
    module = CausalLMModule(str(args.folder), torch_dtype="float32", lr=1e-5, scheduler="constant")
    data = CausalLMDataModule(dataset="addition", batch_size=1, max_seq_length=16)
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True, save_top_k=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=args.strategy, max_steps=1, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, MeasuredExport()],
    )  # fmt: skip
    trainer.fit(module, data)


def export_checkpoint_measured(args: argparse.Namespace) -> None:
    # Imported before the baseline: the figures are the export's data, not the code it imports.
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import gym_lightning.module  # noqa: F401
    from gym_lightning.checkpointing.reading import export_checkpoint

    start = time.perf_counter()
    with PeakSampler(RSS_FIELDS) as sampler:
        export_checkpoint(args.out / "ckpt" / "last.ckpt", args.out / "offline", max_shard_size=args.max_shard_size)
    result = {"seconds": time.perf_counter() - start, **above_base(sampler)}
    (args.out / "offline.json").write_text(json.dumps(result))


def run_strategy(args: argparse.Namespace, strategy: str, folder: Path) -> dict[str, Any]:
    out = args.workdir / strategy
    common = python_module(__spec__.name, "--folder", folder, "--out", out, "--max_shard_size", args.max_shard_size)
    env = child_env()
    subprocess.run([*common, "--role", "train", "--strategy", strategy], check=True, env=env, cwd=REPO_ROOT)
    subprocess.run([*common, "--role", "offline"], check=True, env=env, cwd=REPO_ROOT)
    live = [json.loads((out / f"live-rank{rank}.json").read_text()) for rank in (0, 1)]
    shards = sorted(p.name for p in (out / "live").glob("*.safetensors"))
    return {"live": live, "offline": json.loads((out / "offline.json").read_text()), "shards": len(shards)}


def render(results: dict[str, Any], shape: dict[str, Any], args: argparse.Namespace) -> str:
    from gym_lightning.hf_folder import parse_size

    shard = parse_size(args.max_shard_size) / MIB
    largest = shape["largest_numel"] * (4 + 2) / MIB  # gathered in fp32, then its bf16 copy
    bound = shard + largest
    lines = [
        SECTION,
        "",
        f"`python -m benchmarks.export_peak {' '.join(args.argv)}`".replace("  ", " ").replace(" `", "`"),
        "",
        f"Model: Llama-shaped, {shape['params'] / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, "
        f"vocabulary {args.vocab}, untied head), saved as sharded bf16 safetensors; trained 1 step in fp32 on 2 CPU "
        f"ranks, exported as bf16 with max_shard_size {args.max_shard_size}. Bound = one shard ({shard:.0f} MiB) + "
        f"the largest tensor in fp32 and bf16 ({largest:.0f} MiB) = {bound:.0f} MiB; floor = that tensor alone. "
        "Peaks are above the "
        "process's memory just before the export (RssAnon: private memory; RssFile: memory-mapped checkpoint pages, "
        "reclaimable page cache).",
        "",
        "| strategy | path | rank | RssAnon peak (MiB) | / floor | RssFile peak (MiB) | seconds | within bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for strategy, result in results.items():
        rows = [("live (end of fit)", rank, r) for rank, r in enumerate(result["live"])]
        rows.append(("checkpoint (gym export)", 0, result["offline"]))
        for path, rank, r in rows:
            ok = "yes" if r["RssAnon_MiB"] <= bound else "NO"
            lines.append(
                f"| {strategy} | {path} | {rank} | {r['RssAnon_MiB']:.0f} | {r['RssAnon_MiB'] / largest:.2f} | "
                f"{r['RssFile_MiB']:.0f} | "
                f"{r['seconds']:.1f} | {ok} |"
            )
    return "\n".join(lines) + "\n"


def write_docs(section: str) -> None:
    DOCS.write_text(replace_section(DOCS.read_text() if DOCS.exists() else "", SECTION, section))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["gym_fsdp", "zero3"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max_shard_size", default="200MB")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gym-export-peak"))
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--role", choices=["driver", "train", "offline"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "train":
        return train_and_export(args)
    if args.role == "offline":
        return export_checkpoint_measured(args)
    args.argv = [a for a in sys.argv[1:] if a != "--write-docs"]
    folder = args.workdir / "model"
    shape = make_folder(folder, args.hidden, args.layers, args.vocab)
    results = {strategy: run_strategy(args, strategy, folder) for strategy in args.strategies}
    section = render(results, shape, args)
    print(section)
    if args.write_docs:
        write_docs(section)


if __name__ == "__main__":
    main()
