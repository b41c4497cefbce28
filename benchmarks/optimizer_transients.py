"""Peak host memory of one AdamW step beyond its states: for-loop vs foreach vs fused, on this CPU.

    python -m benchmarks.optimizer_transients [--vocab 151936] [--hidden 896] [--layers 4]

Each variant runs in its own process (so ``ru_maxrss`` is its own peak): parameters shaped like a Qwen2.5-0.5B-wide
model (an embedding ``vocab x hidden`` and ``layers`` blocks of 4 ``hidden^2`` + 3 ``hidden x 4.86 hidden``
matrices), gradients set; the figure is the peak RSS of the first step (which also creates the AdamW states) minus
the RSS after it, i.e. the step's transient buffers. Prints one markdown table. The readings are
``benchmarks.common.memory``'s (``gym_lightning.metrics.memory``), so each process has imported gym_lightning before
it measures: about 0.3 GB more RSS after the step and at the peak than a bare torch process, none in their difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch

from benchmarks.common.launch import child_env, python_module
from benchmarks.common.memory import peak_rss, rss
from benchmarks.common.paths import REPO_ROOT

VARIANTS = {
    "for-loop (foreach=False)": {"foreach": False},
    "foreach=True": {"foreach": True},
    "fused=True": {"fused": True},
}


def _params(vocab: int, hidden: int, layers: int) -> list[torch.nn.Parameter]:
    shapes = [(vocab, hidden)] + [(hidden, hidden)] * 4 * layers + [(int(hidden * 4.86), hidden)] * 3 * layers
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    return params


def measure(variant: str, vocab: int, hidden: int, layers: int) -> dict[str, float]:
    """One process: RSS before the timed step and the step's peak over it, in MiB."""
    torch.set_num_threads(1)
    params = _params(vocab, hidden, layers)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **VARIANTS[variant])
    optimizer.step()  # creates exp_avg / exp_avg_sq, then runs the update
    # ru_maxrss is the process's lifetime peak, reached in this first step; the states stay, the transients go.
    peak, after = peak_rss(), rss()
    numel = sum(p.numel() for p in params)
    return {
        "numel": numel,
        "largest": max(p.numel() for p in params),
        "rss_mib": after / 2**20,
        "peak_mib": peak / 2**20,
        "transient_mib": max(0, peak - after) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.vocab, args.hidden, args.layers)))
        return
    shape = ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    print("| AdamW step on CPU | parameters | largest tensor | RSS after the step | peak RSS | peak above RSS after |")
    print("|---|---|---|---|---|---|")
    for variant in VARIANTS:
        command = python_module(__spec__.name, *shape, "--one", variant)
        out = subprocess.run(command, cwd=REPO_ROOT, env=child_env(threads=None), capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {variant} | {row['numel'] / 1e6:.0f}M ({row['numel'] * 4 / 2**20:.0f} MiB fp32) | "
            f"{row['largest'] * 4 / 2**20:.0f} MiB | {row['rss_mib']:.0f} MiB | {row['peak_mib']:.0f} MiB | "
            f"{row['transient_mib']:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
