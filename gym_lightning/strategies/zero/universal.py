"""Resume a ZeRO checkpoint on another number of data-parallel ranks, through DeepSpeed's universal checkpoints.

ZeRO-1/2/3 store optimizer state (and under stage 3 the parameters) as one flat partition per rank, so a folder
written by 8 ranks cannot be loaded by 16 ("DP world size of 8 but the current world size is 16", DeepSpeed issues
2898, 3810, 6441). DeepSpeed's answer is the universal checkpoint: ``ds_to_universal`` rewrites the partitions as
one folder per parameter (``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``) and an engine configured with
``checkpoint.load_universal`` slices them for its own ranks. Here that happens by itself on resume:

- the ranks that wrote the checkpoint are counted from its optimizer-state files (``checkpoint_world_size``);
- when they differ from this run's, global rank 0 converts the checkpoint once, into ``<checkpoint>/universal``
  (staged under a hidden name and renamed, so an interrupted conversion is redone, never half-used) with
  ``latest_universal`` beside ``latest``; later resumes on any rank count reuse it;
- every rank then loads it with the engine's universal flag set (``gym_lightning._compat.load_universal_next``),
  and under ZeRO-3 two slips of DeepSpeed's universal load are undone (``repair_zero3_universal_load``).

``ds_to_universal`` reads the checkpoint with ``torch.load(weights_only=False)``, and the engine reads the universal
files the same way, so every file of both folders is first loaded with ``weights_only=True`` (the DeepSpeed classes
of ``checkpointing.safe_load`` allowed, memory-mapped, tensors not read): nothing in them can run code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import torch

from gym_lightning.atomic import remove_path
from gym_lightning.checkpointing.safe_load import deepspeed_safe_globals, refuse_unsafe_pickles

UNIVERSAL_TAG = "universal"
LATEST_UNIVERSAL = "latest_universal"  # the file DeepSpeed reads the universal tag from


def checkpoint_world_size(checkpoint: str | os.PathLike[str]) -> int | None:
    """Data-parallel ranks that wrote a DeepSpeed checkpoint folder (one optimizer-state file each), or ``None``."""
    tag = _tag(Path(checkpoint))
    files = list((Path(checkpoint) / tag).glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt")) if tag else []
    return len(files) or None


def _tag(checkpoint: Path) -> str | None:
    latest = checkpoint / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def has_universal(checkpoint: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint`` already holds its complete universal conversion."""
    checkpoint = Path(checkpoint)
    latest = checkpoint / LATEST_UNIVERSAL
    return latest.is_file() and latest.read_text().strip() == UNIVERSAL_TAG and (checkpoint / UNIVERSAL_TAG).is_dir()


def refuse_unsafe_files(folder: Path) -> None:
    """Load every ``*.pt`` under ``folder`` with ``weights_only=True`` (memory-mapped: the pickles, not the tensors);
    an ``UnsafeCheckpointError`` names the first file that would run code."""
    for path in sorted(folder.rglob("*.pt")):
        with torch.serialization.safe_globals(deepspeed_safe_globals()), refuse_unsafe_pickles(path):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def convert_to_universal(checkpoint: str | os.PathLike[str]) -> Path:
    """``<checkpoint>/universal`` made by DeepSpeed's ``ds_to_universal`` (on one process, once); returns it."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    checkpoint = Path(checkpoint)
    target = checkpoint / UNIVERSAL_TAG
    if has_universal(checkpoint):
        refuse_unsafe_files(target)
        return target
    tag = _tag(checkpoint)
    if tag is None:
        raise FileNotFoundError(f"{checkpoint} has no 'latest' file: not a DeepSpeed checkpoint folder")
    refuse_unsafe_files(checkpoint / tag)
    staging = checkpoint / f".{UNIVERSAL_TAG}.partial"
    remove_path(staging, missing_ok=True)
    args = argparse.Namespace(
        input_folder=str(checkpoint / tag), output_folder=str(staging), num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True, inject_missing_state=True,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # step-by-step prints and progress bars of the script
        ds_to_universal(args)
    remove_path(target, missing_ok=True)
    os.replace(staging, target)
    # ds_to_universal named the staging folder in latest_universal; point it at the final name, atomically.
    partial = checkpoint / f".{LATEST_UNIVERSAL}.partial"
    partial.write_text(UNIVERSAL_TAG)
    os.replace(partial, checkpoint / LATEST_UNIVERSAL)
    return target


def repair_zero3_universal_load(engine: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Undo what DeepSpeed 0.19's ZeRO-3 universal load gets wrong (``stage3.py``,
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``), both found by tests/checkpointing/test_world_size.py:

    - it sets one tensor, read from the checkpoint, as the ``step`` of every fp32 sub-group's state, and torch's
      Adam/AdamW advance ``step`` in place once per sub-group: with 3 sub-groups the count went 4, 7, 10 and every
      update's bias correction after the resume was off (step 6's loss 3.6e-4 away, step 5's exact);
    - it gives every parameter group the hyperparameters of the first ("we can obtain from any parameter"): the
      no-decay group (biases, norms) got the decay group's weight decay. Each group gets its own back from the
      converted checkpoint's ``zero/optimizer_state.pt``.
    """
    from gym_lightning._compat import wrapped_optimizer

    optimizer = wrapped_optimizer(getattr(engine, "optimizer", None))
    if optimizer is None:
        return
    seen: set[int] = set()
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))
    path = Path(checkpoint) / UNIVERSAL_TAG / "zero" / "optimizer_state.pt"
    with torch.serialization.safe_globals(deepspeed_safe_globals()), refuse_unsafe_pickles(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)["optimizer_state_dict"]["param_groups"]
    if len(saved) == len(optimizer.param_groups):
        for group, settings in zip(optimizer.param_groups, saved, strict=True):
            group.update({key: value for key, value in settings.items() if key != "params"})


__all__ = [
    "LATEST_UNIVERSAL",
    "UNIVERSAL_TAG",
    "checkpoint_world_size",
    "convert_to_universal",
    "has_universal",
    "refuse_unsafe_files",
    "repair_zero3_universal_load",
]
