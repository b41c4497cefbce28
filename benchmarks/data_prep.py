"""Data preparation at size: first tokenization, cache hit and per-rank memory growth, on 2 ranks.

Generates alpaca records (instruction, input, output of random common words; ~250 tokens each with the shipped
tokenizer) and multi-turn ShareGPT conversations (system + 3 exchanges) as JSONL, then starts 2 processes at once, as
the 2 local ranks of a node, each building ``CausalLMDataModule(...)`` and calling ``prepare_data()`` and
``setup("fit")`` and reading one batch. Reported per rank: wall time and RSS growth from before the data module to
after the first batch. Run twice: the first preparation, then the cache hit.

``--impl old`` runs the same on the data layer of ``--old-ref`` (git archive into a temporary folder; it has no
cache and tokenizes on every rank, so only one pass is timed); use a smaller ``--alpaca`` there and extrapolate.

Full size (the targets: growth < 300 MB per rank, cache hit < 5 s, first preparation < 2 min):
    python -m benchmarks.data_prep --alpaca 1000000 --sharegpt 200000

``--floor`` measures, instead of a preparation, what any preparation of the alpaca file must spend on this machine
before gym_lightning's own work: ``datasets.load_dataset`` of the JSONL (wall and CPU seconds, its Arrow cache in a
fresh folder), and the Rust tokenizer alone (``encode_batch_fast``, one thread) on every text segment of every
record, in batches of 1,000 records as ``Dataset.map`` hands them over, ``ENCODE_CHUNK`` texts per call as the
preparation makes them, in CPU seconds. With all the machine's cores tokenizing, a preparation cannot take less than
the load plus tokenizer CPU / cores:
    python -m benchmarks.data_prep --alpaca 1000000 --sharegpt 0 --floor --workdir /tmp/dp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.launch import child_env
from benchmarks.common.paths import REPO_ROOT

ROOT = REPO_ROOT
WORDS_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look two "
    "more write go see number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part "
)
WORDS = WORDS_TEXT.split()

RANK = """
import json, os, sys, time
import psutil
from gym_lightning.data.datamodule import CausalLMDataModule  # the code under test: first on PYTHONPATH
process = psutil.Process()
before, start, cpu_before = process.memory_info().rss, time.perf_counter(), process.cpu_times()
kwargs = dict(train_files=sys.argv[1], max_seq_length=1024, batch_size=8)
if sys.argv[2] != "old":
    kwargs["cache_dir"] = sys.argv[2]
dm = CausalLMDataModule(**kwargs)
if sys.argv[2] != "old" and os.environ["LOCAL_RANK"] == "0":
    dm.prepare_data()  # as Lightning: local rank 0 only; the other rank's setup waits on the cache lock
dm.setup("fit")
next(iter(dm.train_dataloader()))
cpu = process.cpu_times()  # children: the num_proc tokenization workers (joined by now)
cpu_s = sum(cpu[:4]) - sum(cpu_before[:4])
print(json.dumps({"rank": int(os.environ["LOCAL_RANK"]), "seconds": time.perf_counter() - start, "cpu_s": cpu_s,
                  "rss_growth_mb": (process.memory_info().rss - before) / 2**20,
                  "rows": len(dm.train_dataloader().dataset)}))
"""


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def write_alpaca(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            record = {"instruction": words(rng, 15), "input": words(rng, 15), "output": words(rng, 80)}
            out.write(json.dumps(record) + "\n")


def write_sharegpt(path: Path, count: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            turns = []
            for _ in range(3):
                turns += [{"from": "human", "value": words(rng, 12)}, {"from": "gpt", "value": words(rng, 30)}]
            out.write(json.dumps({"system": words(rng, 8), "conversations": turns}) + "\n")


def floor(data: Path, work: Path) -> dict[str, float]:
    """The load and tokenizer floor of preparing ``data`` (alpaca JSONL); see the module docstring."""
    import shutil

    import datasets

    from gym_lightning.data.formats import plain_segments, segment_texts
    from gym_lightning.data.prepare import batch_records
    from gym_lightning.data.tokens import ENCODE_CHUNK, plain_backend
    from gym_lightning.tokenizer import load_tokenizer

    hf_cache = work / "floor-hf"
    shutil.rmtree(hf_cache, ignore_errors=True)
    wall, cpu = time.perf_counter(), time.process_time()
    rows = datasets.load_dataset("json", data_files=[str(data)], split="train", cache_dir=str(hf_cache))
    load_wall, load_cpu = time.perf_counter() - wall, time.process_time() - cpu
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: CPU seconds without rayon's coordination
    backend = plain_backend(load_tokenizer(None))
    tokens, tokenizer_cpu = 0, 0.0
    for start in range(0, len(rows), 1_000):
        batch = rows[start : start + 1_000]
        records = batch_records(batch, range(start, start + len(batch["instruction"])), str(data))
        texts = segment_texts([plain_segments(record, "alpaca")[0] for record in records])
        for chunk in range(0, len(texts), ENCODE_CHUNK):  # as the preparation feeds it
            cpu = time.process_time()
            encodings = backend.encode_batch_fast(texts[chunk : chunk + ENCODE_CHUNK], add_special_tokens=False)
            tokenizer_cpu += time.process_time() - cpu
            tokens += sum(len(encoding) for encoding in encodings)
    shutil.rmtree(hf_cache, ignore_errors=True)
    cores = os.cpu_count() or 1
    return {
        "records": len(rows), "tokens": tokens, "load_wall_s": load_wall, "load_cpu_s": load_cpu,
        "tokenizer_cpu_s": tokenizer_cpu, "tokens_per_cpu_s": tokens / tokenizer_cpu, "cores": cores,
        "floor_wall_s": load_wall + tokenizer_cpu / cores,
    }  # fmt: skip


def run_ranks(code_dir: Path, data: Path, cache: str) -> list[dict]:
    """Start 2 rank processes at once, ``code_dir``'s gym_lightning first on their path; their JSON lines."""
    script = Path(tempfile.mkdtemp()) / "rank.py"
    script.write_text(RANK)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(data), cache],
            env=child_env(code_dir, threads=None, LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


def old_code(ref: str) -> Path:
    folder = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", ref, "gym_lightning"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def table_row(name: str, passes: dict[str, dict]) -> str:
    """One markdown row: per rank seconds / CPU seconds / RSS growth, first pass and cache hit, load averages."""

    def ranks(result: dict | None, key: str, unit: str) -> str:
        return (
            " / ".join(f"{r[key]:.{1 if key != 'seconds' or r[key] > 5 else 2}f}{unit}" for r in result["ranks"])
            if result
            else ""
        )

    first, hit = passes.get("first"), passes.get("cache_hit")
    load = f"{first['load_before']:.1f} -> {first['load_after']:.1f}" if first else ""
    return (
        f"| {name} | {ranks(first, 'seconds', ' s')} | {ranks(first, 'cpu_s', ' s')} | {ranks(hit, 'seconds', ' s')} "
        f"| {ranks(first, 'rss_growth_mb', ' MB')} | {load} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpaca", type=int, default=1_000_000)
    parser.add_argument("--sharegpt", type=int, default=200_000)
    parser.add_argument("--impl", choices=["new", "old"], default="new", help="old: the pre-cache data layer")
    parser.add_argument("--old-ref", default="8abc300", help="git ref of the data layer for --impl old")
    parser.add_argument("--code-ref", default=None, help="run the current benchmark on gym_lightning of this git ref")
    parser.add_argument("--workdir", default=None, help="keeps the generated JSONL (and cache) between runs")
    parser.add_argument("--floor", action="store_true", help="measure the load + tokenizer floor instead")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="data_prep_"))
    work.mkdir(parents=True, exist_ok=True)
    code = old_code(args.old_ref) if args.impl == "old" else old_code(args.code_ref) if args.code_ref else ROOT
    results: dict[str, dict[str, dict]] = {}
    for name, count, writer in (("alpaca", args.alpaca, write_alpaca), ("sharegpt", args.sharegpt, write_sharegpt)):
        if not count:
            continue
        data = work / f"{name}_{count}.jsonl"
        if not data.exists():
            writer(data, count)
        if args.floor:
            if name == "alpaca":
                print(json.dumps({f"alpaca_{count}_floor": floor(data, work)}), flush=True)
            continue
        cache = "old" if args.impl == "old" else str(work / f"cache-{args.code_ref or 'worktree'}")
        passes = ["first"] if args.impl == "old" else ["first", "cache_hit"]
        for label in passes:
            started, load_before = time.perf_counter(), os.getloadavg()[0]
            ranks = run_ranks(code, data, cache)
            result = {
                "wall_s": time.perf_counter() - started,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
            results.setdefault(f"{count:,} {name}", {})[label] = {**result, "ranks": ranks}
            print(json.dumps({f"{name}_{count}_{label}": {**result, "ranks": ranks}}), flush=True)
    print(
        f"\ncode: {args.code_ref or args.old_ref if args.impl == 'old' or args.code_ref else 'working tree'}, "
        f"{os.cpu_count()} CPUs; per rank (rank 0 / rank 1), from creating the data module to its first batch"
    )
    print(
        "| data | first preparation, wall | first preparation, CPU (process + workers) | cache hit, wall "
        "| RSS growth (first) | load average (1 min) before -> after |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, passes in results.items():
        print(table_row(name, passes))


if __name__ == "__main__":
    main()
