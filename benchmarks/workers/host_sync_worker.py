"""``gym fit`` runs with the host-sync census on (tests/test_host_syncs.py, benchmarks/host_syncs.py).

    python -m benchmarks.workers.host_sync_worker SPEC.json                          # world size 1
    torchrun --nproc_per_node 2 -m benchmarks.workers.host_sync_worker SPEC.json     # world size 2

``SPEC.json``: ``{"out": DIR, "cases": [{"name": NAME, "args": [...]}, ...]}``, optionally ``"census": false`` (time
the batches only) and ``"keep_going": true`` (a run that exits with an error, e.g. a refused setting, is recorded
and the next one runs); each case is ``gym fit ARGS`` (the command line's own entry point,
``gym_lightning.cli.main``), run one after the other in the same processes (one import and one process-group start
for the series). Every rank writes ``DIR/NAME.RANK.json``: the counted events
(``benchmarks.common.host_syncs.SyncEvent``), each training batch's wall time and the seconds the fit took, or the
error it exited with.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from contextlib import nullcontext, redirect_stderr
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common.host_syncs import HostSyncCounter, count_training_batches, counting_host_syncs
from gym_lightning.cli import main


def run_case(name: str, args: list[str], out: Path, census: bool = True, keep_going: bool = False) -> None:
    """``gym fit ARGS`` with the census on (``census``) or timed only; writes this rank's events and times."""
    counter = HostSyncCounter()
    undo = count_training_batches(counter)
    start, error, stderr = time.perf_counter(), "", io.StringIO()
    try:
        with counting_host_syncs(counter) if census else nullcontext(), redirect_stderr(Tee(stderr, sys.stderr)):
            main(["fit", *args])
    except SystemExit as done:
        if done.code not in (None, 0):
            error = stderr.getvalue().strip().splitlines()[-1:] or [f"exit {done.code}"]
            if not keep_going:
                raise SystemExit(f"gym fit {' '.join(args)} exited with {done.code}: {error[0]}") from None
            error = error[0]
    finally:
        undo()
    rank = int(os.environ.get("RANK", "0"))
    payload = {"seconds": time.perf_counter() - start, "batch_seconds": counter.seconds, "error": error}
    payload["events"] = [asdict(event) for event in counter.events]
    (out / f"{name}.{rank}.json").write_text(json.dumps(payload))
    print(f"host_sync_worker: {name} done in {payload['seconds']:.1f} s, {len(counter.events)} events", flush=True)


class Tee(io.TextIOBase):
    """Writes to both streams: the console still shows what the run prints, and the last line is kept."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", type=Path, help="SPEC.json: {out, cases, census, keep_going}")
    spec = json.loads(parser.parse_args().spec.read_text())
    for case in spec["cases"]:
        run_case(case["name"], case["args"], Path(spec["out"]), spec.get("census", True), spec.get("keep_going", False))
