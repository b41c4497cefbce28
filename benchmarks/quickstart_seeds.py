"""Quickstart reliability: train configs/quickstart.yaml once per seed and report held-out exact match per seed.

    python -m benchmarks.quickstart_seeds                    # seeds 0-4, prints a markdown table
    python -m benchmarks.quickstart_seeds --write-docs       # also replaces docs/benchmarks.md's quickstart section
    python -m benchmarks.quickstart_seeds --seeds 1 42 -- --model.lr 0.002   # flags after -- go to every run

Each seed sets both ``seed_everything`` (model initialisation) and ``data.seed`` (shuffling order). Every run is
the README's quickstart command with its output folders moved to a temporary directory and an explicit CSV logger,
so the figures are read from ``metrics.csv`` whatever the default logger is.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from benchmarks.common.docs import replace_section as replace_docs_section
from benchmarks.common.paths import CONFIGS, DOCS, REPO_ROOT

CONFIG = CONFIGS / "quickstart.yaml"
SECTION = "## Quickstart reliability"
THRESHOLD = 0.9


class SeedResult(NamedTuple):
    seed: int
    exact_match: float
    val_loss: float
    wall_s: float
    cpu_s: float


def last_metrics(metrics_csv: Path) -> dict[str, float]:
    """The last logged value of every metric in a CSV logger's ``metrics.csv``."""
    last: dict[str, float] = {}
    with metrics_csv.open() as file:
        for row in csv.DictReader(file):
            last.update({key: float(value) for key, value in row.items() if value not in ("", None)})
    return last


def run_seed(seed: int, config: Path, extra: list[str], workdir: Path) -> SeedResult:
    """Train the quickstart once with ``seed`` as model and data seed; raise with the log tail if it fails."""
    root = workdir / f"seed{seed}"
    command = [
        sys.executable, "-m", "gym_lightning", "fit", "--config", str(config),
        "--seed_everything", str(seed), "--data.seed", str(seed),
        "--trainer.default_root_dir", str(root), "--export.output_dir", "null",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
        *extra,
    ]  # fmt: skip
    root.mkdir(parents=True)
    start = time.perf_counter()
    with (root / "console.log").open("w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        # wait4 gives this child's own CPU time, also when several seeds run at once (--jobs).
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall, cpu = time.perf_counter() - start, usage.ru_utime + usage.ru_stime
    if proc.returncode != 0:
        tail = (root / "console.log").read_text()[-3000:]
        raise RuntimeError(f"seed {seed} failed (exit {proc.returncode}):\n{tail}")
    (metrics_csv,) = root.rglob("metrics.csv")
    metrics = last_metrics(metrics_csv)
    return SeedResult(seed, metrics["val/exact_match"], metrics["val/loss"], wall, cpu)


def markdown(results: list[SeedResult], command: str) -> str:
    """The quickstart section of docs/benchmarks.md: one row per seed, then min / median / max."""
    rows = [f"| {r.seed} | {r.exact_match:.3f} | {r.val_loss:.4f} | {r.wall_s:.1f} | {r.cpu_s:.1f} |" for r in results]
    summary = []
    for name, pick in (("min", min), ("median", statistics.median), ("max", max)):
        em, loss, wall, cpu = (pick(getattr(r, field) for r in results) for field in SeedResult._fields[1:])
        summary.append(f"| **{name}** | {em:.3f} | {loss:.4f} | {wall:.1f} | {cpu:.1f} |")
    passed = sum(r.exact_match >= THRESHOLD for r in results)
    return "\n".join(
        [
            SECTION,
            "",
            f"`configs/quickstart.yaml` once per seed (`seed_everything` and `data.seed` both set to the seed), "
            f"held-out greedy exact match on the 1,000 validation sums after the last epoch; {passed} of "
            f"{len(results)} seeds reach >= {THRESHOLD:.2f}. Wall and CPU (user + system) seconds include start-up "
            f"(imports, building the model and data); load average at the end: {_load()}.",
            "",
            f"Command: `{command}`",
            "",
            "| seed | val/exact_match | val/loss | wall s | CPU s |",
            "|---|---|---|---|---|",
            *rows,
            *summary,
            "",
        ]
    )


def _load() -> str:
    return " / ".join(f"{value:.2f}" for value in os.getloadavg()) + " (1/5/15 min)"


def replace_section(document: str, section: str) -> str:
    """``document`` with its quickstart section replaced by ``section`` (appended when it has none)."""
    return replace_docs_section(document, SECTION, section)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="data and model seeds")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the config to train")
    parser.add_argument("--jobs", type=int, default=1, help="seeds trained at once (wall times then overlap)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace '{SECTION}' in {DOCS.name}")
    args = parser.parse_args(own)
    with tempfile.TemporaryDirectory(prefix="quickstart-seeds-") as workdir, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_seed, seed, args.config, extra, Path(workdir)) for seed in args.seeds]
        results = []
        for future in futures:
            results.append(future.result())
            last = results[-1]
            print(
                f"seed {last.seed}: exact match {last.exact_match:.3f} in {last.wall_s:.1f} s ({last.cpu_s:.1f} CPU s)"
            )
    shown = " ".join(["python -m benchmarks.quickstart_seeds", *own, *(["--", *extra] if extra else [])])
    section = markdown(results, shown.replace(" --write-docs", ""))
    print(section)
    if args.write_docs:
        DOCS.write_text(replace_section(DOCS.read_text(), section))
        print(f"wrote {DOCS}")


if __name__ == "__main__":
    main()
