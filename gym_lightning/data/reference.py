"""Precomputed reference log-probabilities (TRL's ``precompute_ref_log_probs``), stored beside the prepared data.

One pass before training runs the reference model over every row of a preference split, in order, and keeps each
row's two summed log-probabilities (chosen and rejected; or completion and KL row) as ``[rows, 2]`` float32 in
``reference-<split>-<key>.npy`` inside the split's cache entry (``gym_lightning.data.prepare``). Training then holds
no reference model: ``PreferenceRows`` hands the values out and the collate puts them into batches as
``reference_logps`` ``[2B]``. The key hashes the cache entry (the tokenized data), the split, the cut settings
(``max_length``, ``truncation_mode``), the KL chunk (``kto``) and ``reference_id``, the reference model's name
(``model_fingerprint``): a resumed run finds the file and computes nothing, another model or data gets another file.

The pass is data-parallel: rank r of W takes rows r, r + W, ... (padded by wrapping around, so that every rank runs
the same number of forwards: a sharded reference's forward is a collective), and the rows' indices and values are
gathered from every rank. Before that the ranks agree on whether all of them have the file (each node has its own
cache), so that they compute together or not at all. Each rank then writes the gathered values to its node's cache if
the file is missing there (atomically, under a file lock: the first writer wins, the others find it).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from gym_lightning.atomic import atomic_file
from gym_lightning.errors import GymUserError

LogpsFn = Callable[[dict[str, Any]], torch.Tensor]  # a CPU batch -> [2B] summed log-probabilities, batch row order
Gather = Callable[[torch.Tensor], torch.Tensor]  # a rank's tensor -> [world, *shape] (all ranks', in rank order)


def model_fingerprint(source: str, **details: Any) -> str:
    """A ``reference_id`` for ``precompute``: a local folder's files (relative path, size, mtime) or a Hub name,
    and ``details`` that change the values (revision, dtype, ``adapters_off=True``, ...)."""
    path = Path(source)
    if path.is_dir():
        files = [
            (file.relative_to(path).as_posix(), file.stat().st_size, file.stat().st_mtime_ns)
            for file in sorted(path.rglob("*"))
            if file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts)
        ]
    else:
        files = [source]
    payload = json.dumps({"files": files, "details": details}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def reference_path(entry: Path, split: str, cut: dict[str, Any], reference_id: str) -> Path:
    """Where a split's reference log-probabilities live in its cache entry ``entry`` (see the module docstring)."""
    payload = json.dumps(
        {"entry": Path(entry).name, "split": split, "cut": cut, "reference": reference_id}, sort_keys=True
    )
    return Path(entry) / f"reference-{split}-{hashlib.sha256(payload.encode()).hexdigest()[:20]}.npy"


def load_reference(path: Path, num_rows: int) -> np.ndarray | None:
    """The stored ``[num_rows, 2]`` values, or ``None`` when there are none (or they are for another row count)."""
    if not path.is_file():
        return None
    values = np.load(path, allow_pickle=False)
    return values if values.shape == (num_rows, 2) else None


def save_reference(path: Path, values: np.ndarray) -> None:
    """Write ``values`` to ``path`` unless another process did (atomic: a reader sees all of it or nothing)."""
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return
        with atomic_file(path) as file:
            np.save(file, values.astype(np.float32), allow_pickle=False)


def rank_rows(num_rows: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s rows: ``rank, rank + W, ...``, wrapped around so every rank has ``ceil(rows / W)``."""
    return [(rank + step * world_size) % num_rows for step in range(math.ceil(num_rows / world_size))]


def compute(
    rows: Dataset,
    collate: Callable[[list[Any]], dict[str, Any]],
    logps: LogpsFn,
    batch_size: int,
    place: tuple[int, int] = (0, 1),
    gather: Gather | None = None,
    desc: str = "Reference log-probabilities",
) -> np.ndarray:
    """``[len(rows), 2]`` float32: each row's two sequences' summed log-probabilities, by ``logps`` over this rank's
    share (``place`` = (rank, world size)) of the rows, gathered from every rank (``gather``; ``None``: one rank)."""
    rank, world = place
    mine = rank_rows(len(rows), rank, world)
    parts, indices = [], []
    for start in tqdm(range(0, len(mine), batch_size), desc=desc, disable=rank != 0):
        chosen = mine[start : start + batch_size]
        values = logps(collate([rows[i] for i in chosen])).detach().float()
        if values.shape != (2 * len(chosen),):
            raise ValueError(f"logps returned shape {tuple(values.shape)} for {len(chosen)} rows; expected [2B].")
        parts.append(values.view(2, -1).T)
        indices.append(torch.tensor(chosen, dtype=torch.long, device=values.device))
    local, where = torch.cat(parts), torch.cat(indices)
    if gather is not None:  # every rank's share (ranks of a model-parallel group give the same rows: harmless)
        local, where = gather(local).reshape(-1, 2), gather(where).reshape(-1)
    out = np.full((len(rows), 2), np.nan, dtype=np.float32)
    out[where.cpu().numpy()] = local.cpu().numpy()
    if np.isnan(out).any():
        raise RuntimeError("reference log-probabilities are missing for some rows after gathering every rank's")
    return out


def agree(has_it: bool, gather: Gather | None) -> bool:
    """Whether every rank has the stored values (a collective decision: all compute, or none)."""
    flag = torch.tensor([int(has_it)])
    return bool(gather(flag).min()) if gather is not None else has_it


def precompute(
    splits: dict[str, tuple[Dataset, Path]],
    collate: Callable[[list[Any]], dict[str, Any]],
    logps: LogpsFn,
    cut: dict[str, Any],
    reference_id: str,
    batch_size: int,
    place: tuple[int, int] = (0, 1),
    gather: Gather | None = None,
) -> dict[str, np.ndarray]:
    """Each split's reference values (``{name: (rows, cache entry)}``), read from the cache or computed and stored."""
    if not reference_id:
        raise GymUserError("precompute_ref_log_probs needs a reference_id naming the reference model (its folder).")
    out = {}
    for name, (rows, entry) in splits.items():
        path = reference_path(entry, name, cut, reference_id)
        stored = load_reference(path, len(rows))
        if agree(stored is not None, gather) and stored is not None:
            out[name] = stored
            continue
        desc = f"Reference log-probabilities ({name})"
        out[name] = compute(rows, collate, logps, batch_size, place, gather, desc)
        save_reference(path, out[name])
    return out


__all__ = ["LogpsFn", "model_fingerprint", "precompute", "reference_path"]
