"""``StepCheckpoint``: periodic checkpoints by optimizer steps, ``last``, keep the newest k, every write atomic.

Lightning's ``ModelCheckpoint`` writes straight to the final name and makes ``last`` by deleting the old one and
then linking or copying, so a process killed at the wrong moment leaves a truncated file or folder under a name that
``fit(ckpt_path="last")`` picks up, or no ``last`` at all. Here:

- each checkpoint (a file for DDP, a folder for FSDP's torch distributed checkpoint and DeepSpeed) is written by
  all ranks under a hidden staging name (``.step-00000012.ckpt.partial``), then renamed into place by rank 0 once
  every rank has finished (``rename`` is atomic on POSIX file systems);
- ``last.ckpt`` is a symbolic link that is replaced atomically (a new link renamed over the old one) right after
  the new checkpoint is in place and before any old checkpoint is deleted, so it always names a complete one;
- old checkpoints are renamed to a hidden name before they are deleted, so a half-deleted one is never listed;
- before the rename, every file's size and checksum go into the checkpoint's manifest (``checkpointing.manifest``),
  which the strategies and ``gym export`` check before they read a file.

The per-rank random number generator states are gathered into the checkpoint and restored on resume (Lightning
does not store them), so dropout and other random draws continue as in an uninterrupted run.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from weakref import proxy

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from gym_lightning._compat import rank_zero_warn, record_checkpoint_saved, save_topk_and_last_checkpoint
from gym_lightning.atomic import remove_path
from gym_lightning.checkpointing.loader_state import ResumeLoaderPositions
from gym_lightning.checkpointing.manifest import all_gather, hash_owned_files, manifest_path, write_manifest
from gym_lightning.checkpointing.rng import capture_rng_state, restore_rng_state
from gym_lightning.errors import GymUserError

RNG_KEY = "gym_rng_states"
# A write that fails for lack of room (full disk, exhausted quota, file size limit) is the user's to fix, not a bug.
DISK_FULL_ERRNOS: tuple[int, ...] = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
STAGING_SUFFIX = ".partial"


def staging_path(target: str | os.PathLike[str]) -> Path:
    """The hidden name a checkpoint is written under before it is renamed to ``target``."""
    target = Path(target)
    return target.parent / f".{target.name}{STAGING_SUFFIX}"


def _disk_full(filepath: str, err: OSError) -> GymUserError:
    folder = Path(filepath).parent
    free = shutil.disk_usage(folder).free if folder.exists() else 0
    return GymUserError(
        f"Could not write checkpoint {filepath}: {os.strerror(err.errno or 0)} ({free / 2**20:.1f} MiB free in "
        f"{folder}). The partial file was removed; the previous checkpoints and last.ckpt are intact. Free space, "
        "point StepCheckpoint(dirpath=...) at a larger disk, or keep fewer checkpoints (keep_last)."
    )


def publish(staging: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Rename the complete ``staging`` file or folder to ``target``, replacing what was there."""
    target = Path(target)
    if target.is_dir() and not target.is_symlink():
        remove_path(target)  # rename cannot replace a folder; only an older copy of this same step is lost
    os.replace(staging, target)


def link_atomically(target: str | os.PathLike[str], link: str | os.PathLike[str]) -> None:
    """Point the symbolic link ``link`` at ``target`` (relative), replacing any old link in one rename."""
    link = Path(link)
    temporary = link.parent / f".{link.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(os.path.relpath(target, link.parent), temporary)
    if link.is_dir() and not link.is_symlink():
        remove_path(link)  # a real folder named last (written by plain ModelCheckpoint): rename cannot replace it
    os.replace(temporary, link)


class StepCheckpoint(ResumeLoaderPositions, ModelCheckpoint):
    """Checkpoint every ``every_n_steps`` optimizer steps, keep the newest ``keep_last``, link ``last.ckpt``.

    Files are named ``step-00000012.ckpt`` (a file for DDP and single-device runs, a folder for FSDP and DeepSpeed).
    Resume with ``trainer.fit(..., ckpt_path="last")`` (``fit --ckpt_path last`` on the command line); when there is
    no checkpoint yet, training starts from scratch (so an elastic launcher can always pass ``last``).

    Args:
        dirpath: Folder of the checkpoints; ``None`` uses Lightning's default (``<default_root_dir>/checkpoints`` or
            the logger's folder).
        every_n_steps: Save after every this many optimizer steps (>= 1). Saves happen right after an optimizer step,
            so a checkpoint never holds half an accumulation window.
        keep_last: Number of step checkpoints to keep (>= 1), or -1 for all.
        save_final: Also save at the end of training when the last step is not a multiple of ``every_n_steps``.
        save_weights_only: Save only the model weights (no optimizer, scheduler, loop or data state: such a
            checkpoint can be exported but not resumed exactly).
        verbose: Log every save.
    """

    FILENAME = "step-{step:08d}"

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        every_n_steps: int = 100,
        keep_last: int = 3,
        save_final: bool = True,
        save_weights_only: bool = False,
        verbose: bool = False,
    ) -> None:
        problems = []
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            problems.append(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or not (keep_last >= 1 or keep_last == -1):
            problems.append(f"keep_last must be an integer >= 1 or -1 (keep all), got {keep_last!r}")
        if problems:
            raise GymUserError("Invalid StepCheckpoint settings: " + "; ".join(problems) + ".")
        super().__init__(
            dirpath=dirpath,
            filename=self.FILENAME,
            monitor="step",  # "keep the newest k" is top-k on the step count
            mode="max",
            save_top_k=keep_last,
            save_last="link",
            every_n_train_steps=every_n_steps,
            save_on_train_epoch_end=False,
            auto_insert_metric_name=False,
            enable_version_counter=False,
            save_weights_only=save_weights_only,
            verbose=verbose,
        )
        self.save_final = save_final

    @property
    def last_link(self) -> str:
        """Path of the ``last.ckpt`` link."""
        return os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        staging = staging_path(filepath)
        if trainer.is_global_zero and (staging.exists() or staging.is_symlink()):
            remove_path(staging)  # left by a process killed while saving
        trainer.strategy.barrier("gym_checkpoint_stage")
        try:
            trainer.save_checkpoint(str(staging), self.save_weights_only)  # every rank writes; ends with a barrier
            self._write_manifest(trainer, staging, filepath)
        except OSError as err:
            if err.errno not in DISK_FULL_ERRNOS:
                raise
            remove_path(staging, missing_ok=True)  # the previous checkpoints and last.ckpt were not touched
            raise _disk_full(filepath, err) from err
        if trainer.is_global_zero:
            publish(staging, filepath)
            if os.path.abspath(filepath) != os.path.abspath(self.last_link):
                link_atomically(filepath, self.last_link)  # before any older checkpoint is deleted
        trainer.strategy.barrier("gym_checkpoint_publish")
        record_checkpoint_saved(self, trainer.global_step, filepath)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    @staticmethod
    def _write_manifest(trainer: pl.Trainer, staging: Path, filepath: str) -> None:
        """Every rank hashes the files it wrote; rank 0 writes the manifest (collective)."""
        records = all_gather(hash_owned_files(staging, trainer.global_rank, trainer.world_size))
        if trainer.is_global_zero:
            info = {"global_step": trainer.global_step, "world_size": trainer.world_size}
            write_manifest(staging, filepath, records, {**info, "strategy": type(trainer.strategy).__name__})

    @staticmethod
    @override
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link_atomically(filepath, linkpath)
        trainer.strategy.barrier("gym_checkpoint_link")

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            remove_path(filepath)
            remove_path(manifest_path(filepath), missing_ok=True)  # a single file's manifest lies beside it

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_final:
            save_topk_and_last_checkpoint(self, trainer)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[RNG_KEY] = all_gather(capture_rng_state())  # collective: every rank saves together

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get(RNG_KEY)
        if not states:
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"The checkpoint holds random states of {len(states)} rank(s), this run has {trainer.world_size}: "
                "random draws (dropout, sampling) will not continue exactly as before."
            )
        restore_rng_state(states[trainer.global_rank % len(states)], trainer.local_rank)
