"""Load checkpoints with ``torch.load(weights_only=True)`` only, with an error that says what to do when refused.

``weights_only=False`` runs arbitrary code from the file (pickle ``REDUCE``/``GLOBAL`` opcodes), so a checkpoint
downloaded or shared between users could execute anything. Everything gym_lightning writes (Lightning's checkpoint
dict, DCP metadata, DeepSpeed's model/optimizer files) loads under ``weights_only=True``; the few DeepSpeed classes
its files hold (loss scalers, the stage enum, ZeRO-1/2 fragment addresses) are data containers, allow-listed below.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gym_lightning._compat import deepspeed_engine_config
from gym_lightning.errors import GymUserError


class UnsafeCheckpointError(GymUserError):
    """A checkpoint file holds pickled Python objects that ``weights_only=True`` refuses to run."""


def _refusal(path: str | os.PathLike[str], err: BaseException) -> UnsafeCheckpointError:
    # torch's message is long; the line that mentions "GLOBAL module.name" says which object was refused.
    lines = [line.strip().rstrip(".") for line in str(err).splitlines() if line.strip()]
    reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "unknown")
    return UnsafeCheckpointError(
        f"Refused to load {os.fspath(path)!r}: it holds pickled Python objects beyond tensors and plain containers, "
        "and gym_lightning loads checkpoints with torch.load(weights_only=True) so that a checkpoint cannot run code. "
        f"torch said: {reason}. If you wrote the file yourself and trust it, allow-list the class "
        "with torch.serialization.add_safe_globals([...]) before loading, or re-save it with tensors only."
    )


@contextmanager
def refuse_unsafe_pickles(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn torch's ``UnpicklingError`` from a ``weights_only`` load of ``path`` into an ``UnsafeCheckpointError``."""
    try:
        yield
    except pickle.UnpicklingError as err:
        raise _unpickling_error(path, err) from err


def _unpickling_error(path: str | os.PathLike[str], err: pickle.UnpicklingError) -> GymUserError:
    # A refused GLOBAL means a real pickle that would run code; any other unpickling failure is a broken file.
    return _refusal(path, err) if "GLOBAL" in str(err) else _not_a_checkpoint(path, err)


def load_weights_only(path: str | os.PathLike[str], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; an ``UnsafeCheckpointError`` if the file needs more, and a
    ``GymUserError`` naming the file if it is missing or not a PyTorch checkpoint at all (truncated, another format).

    torch reports a file that is not a checkpoint in many ways (``EOFError`` for an empty file, ``KeyError`` for text,
    ``RuntimeError`` from the zip reader for a truncated file, an ``UnpicklingError`` or ``IndexError`` for random
    bytes); all of them mean the same to a user, so they become one message. An ``UnpicklingError`` that names a
    refused ``GLOBAL`` is a real pickle that would run code: that stays an ``UnsafeCheckpointError``.
    """
    if not os.path.isfile(path):
        raise GymUserError(f"Checkpoint file not found: {os.fspath(path)!r}; pass the path of an existing .ckpt file.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise _unpickling_error(path, err) from err
    except RuntimeError as err:
        if mmap and "mmap can only be used" in str(err):  # torch's legacy (non-zip) format cannot be memory-mapped
            return load_weights_only(path, map_location=map_location, mmap=False)
        raise _not_a_checkpoint(path, err) from err
    except (EOFError, KeyError, ValueError, OSError, IndexError) as err:
        # IndexError: torch's weights-only unpickler pops an empty stack on some broken files (a legacy-format
        # header then STOP, b"\x80\x02."); 197 of 3,000 files of 2,000 random bytes raised it here (torch 2.13).
        raise _not_a_checkpoint(path, err) from err


def load_lightning_checkpoint(path: str | os.PathLike[str], required: tuple[str, ...] = ("state_dict",)) -> Any:
    """``load_weights_only(path, mmap=True)`` of a Lightning checkpoint file; a ``GymUserError`` naming the file if
    it is a PyTorch file without the ``required`` keys (a bare state dict, someone else's format)."""
    checkpoint = load_weights_only(path, mmap=True)
    missing = [key for key in required if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        found = sorted(map(str, checkpoint))[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise GymUserError(
            f"{os.fspath(path)!r} is a PyTorch file but not a Lightning checkpoint (no {', '.join(missing)}; found "
            f"{found}). Pass a .ckpt written by a gym_lightning/Lightning run, or its checkpoint folder."
        )
    return checkpoint


def _not_a_checkpoint(path: str | os.PathLike[str], err: BaseException) -> GymUserError:
    # torch's weights-only message is a paragraph of advice; its "WeightsUnpickler error: ..." line is the reason.
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:  # "...: WeightsUnpickler error: \n\nUnsupported operand 56\n\nCheck the documentation..."
        text = text.split(marker, 1)[1].strip().split("\n\n", 1)[0]
    reason = " ".join(text.split())[:160] or type(err).__name__
    return GymUserError(
        f"{os.fspath(path)!r} is not a readable PyTorch checkpoint ({type(err).__name__}: {reason}). Pass a .ckpt "
        "file (or checkpoint folder) written by a gym_lightning/Lightning run; this one may be truncated, empty or "
        "of another format."
    )


def deepspeed_safe_globals() -> list[Any]:
    """DeepSpeed classes stored in its own checkpoint files: plain data holders, safe to rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_checkpoint_engine(config_params: Any = None) -> Any:
    """A DeepSpeed ``TorchCheckpointEngine`` whose ``load`` uses ``weights_only=True`` (DeepSpeed's uses False) and
    whose ``save`` hashes each file as it writes it, for the checkpoint's manifest (``checkpointing.manifest``)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from gym_lightning.checkpointing.manifest import HashingFile

    class WeightsOnlyTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            with torch.serialization.safe_globals(deepspeed_safe_globals()), refuse_unsafe_pickles(path):
                return torch.load(path, map_location=map_location, weights_only=True)

        def save(self, state_dict: Any, path: str) -> None:
            with open(path, "wb") as file:
                hashing = HashingFile(file)
                torch.save(state_dict, hashing, _use_new_zipfile_serialization=self.zipfile_serialization)
            hashing.remember(path)

    return WeightsOnlyTorchCheckpointEngine(config_params)


def use_weights_only_engine(engine: Any) -> None:
    """Swap a DeepSpeed engine's default checkpoint engine for the ``weights_only=True`` one (others are kept)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is TorchCheckpointEngine:
        engine.checkpoint_engine = weights_only_checkpoint_engine(deepspeed_engine_config(engine))
