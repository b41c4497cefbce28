"""Atomic writes of folders and files: readers see the old one or the complete new one, never a half-written one."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


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


def remove_path(path: str | os.PathLike[str], missing_ok: bool = False) -> None:
    """Delete a file, link or folder; a folder is first renamed to a hidden name so no half of it stays listed.

    ``missing_ok``: another rank may remove the same path at the same time (cleaning up after a failed save).
    """
    path = Path(path)
    if missing_ok:
        with contextlib.suppress(FileNotFoundError):
            remove_path(path)
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        trash = path.parent / f".{path.name}.trash-{uuid.uuid4().hex[:8]}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


PARTIAL_SUFFIX = ".partial"


def fsync_directory(folder: str | os.PathLike[str]) -> None:
    """Flush ``folder``'s entries (a rename in it) to disk; a no-op where folders cannot be opened (Windows)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def atomic_file(target: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Yield a binary file open at ``<target>.partial`` in ``target``'s folder; on success it replaces ``target``.

    The bytes are written once, where they will live: flushed and fsynced, renamed over ``target`` (atomic on one
    file system) and the folder fsynced, so after a crash ``target`` is the old file or the complete new one. On
    error the partial file is removed. Nothing goes through the system temp directory.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f"{target.name}{PARTIAL_SUFFIX}"
    try:
        with open(partial, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
