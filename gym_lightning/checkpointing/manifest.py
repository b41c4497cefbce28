"""Checkpoint manifests: every file's size and checksum, written before the commit rename, verified before loading.

A checkpoint of a sharded run is many files written by many ranks; one of them cut short (a full disk on one
node, a copy interrupted), or altered on disk, used to end in a traceback that named no file, in a peer's
"Connection closed by peer", or, for ZeRO-3 optimizer state with bytes flipped, in no error at all: the damaged
state loaded and training diverged two steps later. Here:

- when ``StepCheckpoint`` has written a checkpoint under its staging name, each rank hashes the files it wrote
  (``owner_of``: the rank named in a shard's file name, rank 0 for the rest; files written through ``HashingFile``,
  single-file checkpoints and DeepSpeed's, were hashed as they were written), rank 0 gathers the records and writes
  ``gym_manifest.json`` into the checkpoint folder (or ``<name>.manifest.json`` beside a single-file checkpoint),
  and only then is the checkpoint renamed into place;
- before a checkpoint is loaded, each rank checks the files it owns and the ranks agree (one ``all_gather_object``)
  before any of them reads a file: a damaged checkpoint is one ``GymUserError`` on every rank, naming the file,
  the size and hash the manifest records and what was found, and the previous checkpoint to resume from, so no
  rank is left waiting in a collective for a rank that failed to read. ``gym export`` checks every file the same way.

The hash is xxHash's XXH3-128 (``xxhash``, already installed with ``datasets``): a checksum against damage, not a
signature against tampering (whoever can rewrite a file can rewrite the manifest), several times faster than
hashlib's BLAKE2b (docs/benchmarks-history.md, "Checkpoint manifests' hash").
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gym_lightning.atomic import atomic_file
from gym_lightning.errors import EveryRankError, GymUserError

MANIFEST_NAME = "gym_manifest.json"  # inside a checkpoint folder
SIDECAR_SUFFIX = ".manifest.json"  # beside a single-file checkpoint: <name>.manifest.json
HASH_NAME = "xxh3_128"
FORMAT_VERSION = 1
READ_CHUNK = 8 << 20  # bytes per read while hashing
# The rank that writes (and, on the same number of ranks, reads) a shard file, from its name: torch distributed
# checkpoint's ``__<rank>_<n>.distcp`` and DeepSpeed's ``[bf16_]zero_pp_rank_<rank>_mp_rank_<m>_*.pt``. Every other
# file (metadata, DeepSpeed's model states of stages 1-2, a single-file checkpoint) is rank 0's.
_RANK_IN_NAME = (re.compile(r"^__(\d+)_\d+\.distcp$"), re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_"))


def manifest_path(checkpoint: str | os.PathLike[str]) -> Path:
    """Where the manifest of ``checkpoint`` (a folder, or a single file) lives."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        return checkpoint / MANIFEST_NAME
    return checkpoint.parent / f"{checkpoint.name}{SIDECAR_SUFFIX}"


def checkpoint_files(checkpoint: str | os.PathLike[str]) -> list[str]:
    """The files of ``checkpoint`` as paths relative to it (a single file: its own name), sorted; the manifest and
    hidden temporary files are not among them."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return [checkpoint.name]
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    return sorted(p.relative_to(checkpoint).as_posix() for p in files)


def owner_of(relative: str, world_size: int) -> int:
    """The rank that hashes and verifies the file ``relative`` on ``world_size`` ranks (see ``_RANK_IN_NAME``)."""
    name = relative.rsplit("/", 1)[-1]
    for pattern in _RANK_IN_NAME:
        if match := pattern.match(name):
            return int(match[1]) % max(1, world_size)
    return 0


# Digests taken while a file was written (``HashingFile``), by path, with the size and mtime they belong to: the
# manifest then need not read the file back. Per process; a file changed since no longer matches its entry.
_WRITTEN: dict[str, tuple[int, int, str]] = {}
_HASH_SECONDS = [0.0]  # time this process spent hashing (inline and read-back), for benchmarks/checkpoint_manifest.py


def hashing_seconds() -> float:
    """Seconds this process has spent computing checkpoint digests so far."""
    return _HASH_SECONDS[0]


class HashingFile:
    """A binary file's ``write`` that also feeds the bytes to XXH3-128: ``torch.save`` into it hashes the checkpoint
    as it is written, so the manifest costs no second read of it (``remember``, after the file is complete).

    Args:
        file: The binary file open for writing.
    """

    def __init__(self, file: Any) -> None:
        import xxhash

        self.file, self._digest = file, xxhash.xxh3_128()

    def write(self, data: Any) -> int:
        start = time.perf_counter()
        self._digest.update(data)
        _HASH_SECONDS[0] += time.perf_counter() - start
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def remember(self, path: str | os.PathLike[str]) -> None:
        """Record the digest as that of the finished file at ``path`` (renamed there, or written in place)."""
        stat = os.stat(path)
        _WRITTEN[os.path.abspath(path)] = (stat.st_size, stat.st_mtime_ns, self._digest.hexdigest())


def file_digest(path: str | os.PathLike[str]) -> str:
    """The XXH3-128 hex digest of a file's bytes: as taken while it was written by this process (``HashingFile``)
    if it is unchanged since, else read in ``READ_CHUNK`` pieces."""
    import xxhash

    stat = os.stat(path)
    known = _WRITTEN.get(os.path.abspath(path))
    if known is not None and known[:2] == (stat.st_size, stat.st_mtime_ns):
        return known[2]
    start = time.perf_counter()
    digest = xxhash.xxh3_128()
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            digest.update(view[:read])
    _HASH_SECONDS[0] += time.perf_counter() - start
    return digest.hexdigest()


def _root(checkpoint: Path) -> Path:
    return checkpoint if checkpoint.is_dir() else checkpoint.parent


def hash_owned_files(checkpoint: str | os.PathLike[str], rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """``{relative path: {size, hash, rank}}`` of the files of ``checkpoint`` that ``rank`` owns."""
    checkpoint = Path(checkpoint)
    records = {}
    for relative in checkpoint_files(checkpoint):
        if owner_of(relative, world_size) == rank:
            path = _root(checkpoint) / relative
            records[relative] = {"size": path.stat().st_size, HASH_NAME: file_digest(path), "rank": rank}
    return records


def write_manifest(
    staging: str | os.PathLike[str],
    final: str | os.PathLike[str],
    records: Iterable[dict[str, dict[str, Any]]],
    info: dict[str, Any],
) -> Path:
    """Write the manifest of the checkpoint being staged at ``staging`` (to be renamed to ``final``): inside the
    folder, or beside ``final`` for a single file. ``records``: every rank's ``hash_owned_files``."""
    files: dict[str, dict[str, Any]] = {}
    for part in records:
        files.update(part)
    staging = Path(staging)
    if staging.is_file():  # records name the staged file; the manifest names the final one
        files = {Path(final).name: record for record in files.values()}
    target = manifest_path(staging) if staging.is_dir() else manifest_path(final)
    manifest = {"format": FORMAT_VERSION, "hash": HASH_NAME, **info, "files": dict(sorted(files.items()))}
    with atomic_file(target) as file:
        file.write(json.dumps(manifest, indent=1).encode())
    return target


def read_manifest(checkpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of ``checkpoint``, ``None`` if it has none (written before manifests, or by plain Lightning)."""
    path = manifest_path(checkpoint)
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("hash") != HASH_NAME or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"unknown hash {manifest.get('hash')!r} or no file list")
    except (OSError, ValueError, AttributeError) as err:
        raise GymUserError(
            f"The checkpoint manifest {path} is unreadable ({err}): the checkpoint cannot be verified. "
            f"{previous_checkpoint_advice(checkpoint)}"
        ) from err
    return manifest


@functools.lru_cache(maxsize=64)
def _file_problem(path: str, size: int, digest: str, _stat: tuple[int, int] | None) -> str | None:
    """What is wrong with one file (``None``: nothing); cached on the file's size and mtime, so a file checked by
    the command line is not hashed again by the strategy in the same process."""
    if _stat is None:
        return f"{path} is missing"
    if _stat[0] != size:
        return f"{path} has {_stat[0]:,} bytes, the manifest records {size:,}"
    found = file_digest(path)
    if found != digest:
        return f"{path} has the recorded size ({size:,} bytes) but {HASH_NAME} {found}, the manifest records {digest}"
    return None


def forget_checked_files() -> None:
    """Read and check every file again from now on, as a new process would (checks and digests taken while writing
    are remembered per file, size and mtime within a process)."""
    _file_problem.cache_clear()
    _WRITTEN.clear()


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def file_problems(checkpoint: str | os.PathLike[str], rank: int = 0, world_size: int = 1) -> list[str]:
    """The damage the manifest reveals in the files of ``checkpoint`` that ``rank`` owns (all files for
    ``world_size=1``); ``[]`` when they are intact or there is no manifest."""
    checkpoint = Path(checkpoint).resolve()
    manifest = read_manifest(checkpoint)
    if manifest is None:
        return []
    problems = []
    for relative, record in manifest["files"].items():
        if owner_of(relative, world_size) != rank:
            continue
        path = _root(checkpoint) / relative
        if problem := _file_problem(str(path), int(record["size"]), str(record[HASH_NAME]), _stat(path)):
            problems.append(problem)
    return problems


def damaged_checkpoint_error(checkpoint: str | os.PathLike[str], problems: list[str]) -> EveryRankError:
    """The one error every rank raises for a damaged checkpoint."""
    return EveryRankError(
        f"The checkpoint {Path(checkpoint).resolve()} is damaged and was not loaded: {'; '.join(problems)}. "
        f"{previous_checkpoint_advice(checkpoint)}"
    )


def previous_checkpoint_advice(checkpoint: str | os.PathLike[str]) -> str:
    """What to resume from instead: the newest ``step-*`` checkpoint older than ``checkpoint``, by path."""
    checkpoint = Path(checkpoint).resolve()
    older = sorted(p for p in checkpoint.parent.glob("step-*.ckpt") if p.name < checkpoint.name)
    if older:
        previous = older[-1]
        return f"Use the previous checkpoint instead: --ckpt_path {previous} (gym export: --checkpoint {previous})."
    return "There is no earlier checkpoint beside it: start the run again without --ckpt_path."


def all_gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group); a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def verify_checkpoint(
    checkpoint: str | os.PathLike[str],
    rank: int = 0,
    world_size: int = 1,
    gather: Callable[[list[str]], list[list[str]]] = all_gather,
) -> None:
    """Check ``rank``'s files of ``checkpoint`` against its manifest, then (``gather``, a collective when a process
    group is up) learn every rank's findings: all ranks raise the same ``GymUserError`` if any file is damaged,
    before any of them has read one."""
    problems = file_problems(checkpoint, rank, world_size)
    found = [problem for part in gather(problems) for problem in part]
    if found:
        raise damaged_checkpoint_error(checkpoint, found)


__all__ = [
    "FORMAT_VERSION",
    "HASH_NAME",
    "MANIFEST_NAME",
    "SIDECAR_SUFFIX",
    "HashingFile",
    "all_gather",
    "checkpoint_files",
    "damaged_checkpoint_error",
    "file_digest",
    "file_problems",
    "forget_checked_files",
    "hash_owned_files",
    "hashing_seconds",
    "manifest_path",
    "owner_of",
    "previous_checkpoint_advice",
    "read_manifest",
    "verify_checkpoint",
    "write_manifest",
]
