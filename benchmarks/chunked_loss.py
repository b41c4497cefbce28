"""Peak host memory and time of one forward + backward with the full-logits loss vs the chunked loss, ~150k vocabulary.

    python -m benchmarks.chunked_loss [--vocab 151936 --hidden 512 --layers 2 --batch 2 --seq 1024 --chunk 1024]

Each variant runs in its own process (``ru_maxrss`` is per process): a random-init ``tiny-qwen3`` resized to Qwen3's
151,936-entry vocabulary (tied embeddings, as Qwen3-0.6B), fp32, one forward + backward of ``batch x seq`` random
tokens through ``CausalLMModule.engine.token_loss`` (the training step's loss). Reported: peak RSS above the RSS before
the step, the step's wall time (1 thread), and the loss (the two must agree). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from benchmarks.common.launch import child_env, python_module
from benchmarks.common.memory import peak_rss, rss
from benchmarks.common.paths import REPO_ROOT


def measure(chunking: str, args: argparse.Namespace) -> dict[str, float]:
    from gym_lightning import CausalLMModule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers}
    module = CausalLMModule(
        "tiny-qwen3", config_overrides={**shape, "intermediate_size": 3 * args.hidden}, attn_implementation="sdpa",
        loss_chunking=chunking, loss_chunk_tokens=args.chunk,
    )  # fmt: skip
    module.configure_model()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    before = rss()
    start = time.perf_counter()
    loss = module.engine.token_loss(module.model, batch).loss
    loss.backward()
    seconds = time.perf_counter() - start
    peak = peak_rss()
    return {"above_mib": (peak - before) / 2**20, "seconds": seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = {"vocab": 151_936, "hidden": 512, "layers": 2, "batch": 2, "seq": 1024, "chunk": 1024}
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return
    flags = [f"--{name}={getattr(args, name)}" for name in defaults]
    tokens = args.batch * (args.seq - 1)
    print(f"{tokens} positions x {args.vocab} vocab: fp32 logits {tokens * args.vocab * 4 / 2**20:,.0f} MiB")
    print("| loss | peak RSS above the step's start | forward + backward | summed loss |")
    print("|---|---|---|---|")
    for chunking, label in (("off", "full logits"), ("on", f"chunked ({args.chunk} positions)")):
        command = python_module(__spec__.name, *flags, "--one", chunking)
        out = subprocess.run(command, cwd=REPO_ROOT, env=child_env(threads=None), capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {label} | {row['above_mib']:,.0f} MiB | {row['seconds']:.2f} s | {row['loss']:.4f} |")


if __name__ == "__main__":
    main()
