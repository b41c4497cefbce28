"""Results as JSON lines, one object per finished check or run, flushed at once: a command killed at its time limit
(benchmarks/gpu.sh on the device machine) still hands back every record it finished."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line and flush it to disk now (what a killed command leaves is complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as stream:
        stream.write(json.dumps(finite_json(record)) + "\n")
        stream.flush()


def measured_or_saved(json_out: Path, measure: Callable[[], dict[str, Any]], render_only: bool) -> dict[str, Any]:
    """The figures of a run: ``measure()`` saved to ``json_out``, or (``render_only``) what an earlier run saved."""
    if render_only:
        return json.loads(json_out.read_text())
    figures = measure()
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(figures, indent=1))
    return figures


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
