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


class UnsafeCheckpointError(ValueError):
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
        raise _refusal(path, err) from err


def load_weights_only(path: str | os.PathLike[str], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; an ``UnsafeCheckpointError`` if the file needs more."""
    with refuse_unsafe_pickles(path):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def deepspeed_safe_globals() -> list[Any]:
    """DeepSpeed classes stored in its own checkpoint files: plain data holders, safe to rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_checkpoint_engine(config_params: Any = None) -> Any:
    """A DeepSpeed ``TorchCheckpointEngine`` whose ``load`` uses ``weights_only=True`` (DeepSpeed's uses False)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            with torch.serialization.safe_globals(deepspeed_safe_globals()), refuse_unsafe_pickles(path):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyTorchCheckpointEngine(config_params)


def use_weights_only_engine(engine: Any) -> None:
    """Swap a DeepSpeed engine's default checkpoint engine for the ``weights_only=True`` one (others are kept)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is TorchCheckpointEngine:
        engine.checkpoint_engine = weights_only_checkpoint_engine(deepspeed_engine_config(engine))
