"""Atomic writes of whole folders: readers see the old folder or the complete new one, never a half-written one."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``target``, on error it is removed.

    The temporary folder lives next to ``target`` (same file system), so the final ``os.replace`` is a rename.
    An existing ``target`` is moved aside first and deleted only after the new folder is in place; a crash in
    between leaves it under a ``.old-`` name rather than losing it.
    """
    target = Path(target).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = target.parent / f".{target.name}.tmp-{tag}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    backup = target.parent / f".{target.name}.old-{tag}"
    if target.exists():
        os.replace(target, backup)
    os.replace(staging, target)
    shutil.rmtree(backup, ignore_errors=True)
