"""The MemoryCallback's 2-rank training job: ``tests/callbacks/test_memory_monitor.py`` run as a script, every
strategy one after the other in one pair of processes (one process-group start for all of them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers.dist import rank_env

SCRIPT = Path(__file__).resolve().parents[1] / "callbacks" / "test_memory_monitor.py"
# The strategies whose memory the callback test and the planner's validation read.
STRATEGIES = ("gym_ddp", "zero1", "zero2", "zero3", "gym_fsdp")


def run_two_ranks(strategies: tuple[str, ...], out_root: Path, timeout: float = 900) -> dict[str, dict[str, Any]]:
    """Launch the memory test's job on 2 CPU ranks for ``strategies`` (in order, ``out_root/<strategy>`` each);
    return each one's memory.json."""
    cmd = [sys.executable, str(SCRIPT), ",".join(strategies), str(out_root)]
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        tails = f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        raise RuntimeError(f"{','.join(strategies)} runs failed ({done.returncode}):\n{tails}")
    return {name: json.loads((out_root / name / "memory.json").read_text()) for name in strategies}
