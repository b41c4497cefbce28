"""Where and how the callbacks write their JSON reports."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def report_dir(trainer: pl.Trainer) -> Path:
    """The run's log directory (``trainer.log_dir``), else ``default_root_dir``. Collective: call on every rank."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def format_bytes(num: float) -> str:
    """Human-readable binary size: ``1536 -> '1.50 KiB'``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while abs(num) >= 1024 and index < len(units) - 1:
        num /= 1024
        index += 1
    return f"{num:.0f} B" if index == 0 else f"{num:.2f} {units[index]}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
