"""What benchmarks/gpu.sh's two workers share: the import path, JSON-lines records, the DeepSpeed JIT guard.

``gpu_check.py`` (the correctness checks, one process) and ``gpu_bench.py`` (one benchmark run per process) append
one JSON object per line to their results file and flush it at once, so a command killed at its time limit still
hands back every record it finished.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# gym_lightning is imported from the working tree (the GPU image does not install it), before any installed copy.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The CPU accelerator's shared-memory collective: DeepSpeed loads it in every CPU process group (deepspeed.comm),
# so a CPU run cannot avoid it. Every other op (CPU Adam, fused Adam, async I/O) is refused.
CPU_ONLY_OPS = ("deepspeed_shm_comm",)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line and flush it to disk now (what a killed command leaves is complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as stream:
        stream.write(json.dumps(finite_json(record)) + "\n")
        stream.flush()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (none if it does not exist); a line cut off by a kill is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def one_line(err: BaseException | str) -> str:
    """``err`` as ``Type: message`` (or the text) on one line: a record's failure is one line, whatever the message."""
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    return " ".join(text.split())


def finite_json(value: Any) -> Any:
    """``value`` with NaN / infinity as strings: JSON has no such numbers, and a non-finite loss must still show."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def refuse_jit_builds(allowed: Collection[str] = ()) -> list[dict[str, Any]]:
    """Make every DeepSpeed op build raise, except the ops named in ``allowed``; returns the (growing) list of the
    allowed ops loaded, with their load time.

    A JIT build (``OpBuilder.jit_load``) compiles C++/CUDA for 30 s to minutes: the device check has 6 minutes, so
    a code path that would build one must fail at once and say which op, rather than eat the budget.
    """
    loads: list[dict[str, Any]] = []
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:  # no DeepSpeed: nothing can build
        return loads
    original = OpBuilder.jit_load

    def guarded(self: Any, verbose: bool = True) -> Any:
        name = getattr(self, "name", type(self).__name__)
        if name not in allowed:
            raise RuntimeError(f"refused to JIT-build DeepSpeed's {name} op (the device check builds no op)")
        start = time.perf_counter()
        module = original(self, verbose)
        loads.append({"op": name, "seconds": round(time.perf_counter() - start, 2)})
        return module

    OpBuilder.jit_load = guarded
    return loads
