"""Several ``gym`` command lines, one after the other, in the same ranks: ``torchrun ... launch_worker.py runs.json``.

``runs.json`` is a list of ``{"name": ..., "argv": [...]}``; each ``argv`` goes through the command line's own entry
point (``gym_lightning.cli.main``, as ``gym train ...``/``gym fit ...`` would), so a matrix of launch lines pays for
one import and one process-group start instead of one per line. ``SystemExit`` 0/``None`` is success. A run that
fails is reported (its name, exit status or traceback) and the next one still runs, so one launch tells every line's
outcome; ``runs.json.rank<R>.json`` gets ``{name: {"ok", "seconds", "error"}}`` after each run, and the process exits
1 naming the failed runs at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from gym_lightning.cli import end_process, main


class Tee(io.TextIOBase):
    """A stream that writes to ``stream`` and keeps a copy: the one-line ``gym_lightning: error: ...`` of a user
    error goes to stderr before ``main`` exits 2, and the result should carry that line, not just the status."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_one(argv: list[str]) -> str | None:
    """Run ``gym ARGV``; ``None`` on success, else the reason (the error line with the exit status, or the
    traceback's last lines)."""
    tee = Tee(sys.stderr)
    try:
        with contextlib.redirect_stderr(tee):
            main(argv)
    except SystemExit as done:
        if done.code not in (None, 0):
            lines = [line for line in tee.copy.getvalue().splitlines() if line.startswith("gym_lightning: error")]
            return f"exited with {done.code}" + (f": {lines[-1]}" if lines else "")
    except BaseException:  # a bug's traceback: keep its end, the part that names the failing call
        return "".join(traceback.format_exc().splitlines(keepends=True)[-12:])
    return None


if __name__ == "__main__":
    spec = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    results: dict[str, dict[str, Any]] = {}
    for run in json.loads(spec.read_text()):
        start = time.perf_counter()
        error = run_one(run["argv"])
        seconds = time.perf_counter() - start
        results[run["name"]] = {"ok": error is None, "seconds": round(seconds, 1), "error": error}
        # Written after every run: a launch that hangs or is killed still tells which runs finished.
        spec.with_name(f"{spec.name}.rank{rank}.json").write_text(json.dumps(results, indent=1))
        status = "done" if error is None else f"FAILED ({error.strip().splitlines()[-1]})"
        print(f"launch_worker: rank {rank} {run['name']} {status} in {seconds:.1f} s", flush=True)
    if failed := [name for name, result in results.items() if not result["ok"]]:
        raise SystemExit(f"launch_worker: rank {rank}: failed: {', '.join(failed)}")
    end_process(0)  # as `gym fit`/`gym train` end: gym_lightning.cli.end_process
