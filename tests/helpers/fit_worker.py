"""``gym fit`` of several YAML files, one after the other, in the same ranks: ``torchrun ... fit_worker.py
A.yaml B.yaml ...``. Each run goes through the command line's own entry point (``gym_lightning.cli.main``), so a
series of runs (the family matrix, the shared command-line runs) pays for one process-group start and one import
instead of one per run."""

from __future__ import annotations

import sys
import time

from gym_lightning.cli import end_process, main

if __name__ == "__main__":
    for config in sys.argv[1:]:
        start = time.perf_counter()
        try:
            main(["fit", "--config", config])
        except SystemExit as done:
            if done.code not in (None, 0):
                raise SystemExit(f"gym fit --config {config} exited with {done.code}") from None
        print(f"fit_worker: {config} done in {time.perf_counter() - start:.1f} s", flush=True)
    # As `gym fit` ends (main() without argv): no interpreter finalisation, where gloo's threads now and then abort
    # a finished run (-6, "terminate called without an active exception"; gym_lightning.cli.end_process).
    end_process(0)
