"""Checkpoints that survive crashes: atomic periodic saves, exact resume, safe loading, export to Hugging Face.

- :class:`StepCheckpoint`: a ``ModelCheckpoint`` that saves every N optimizer steps, keeps the newest k, links
  ``last.ckpt`` and never leaves a half-written checkpoint under a real name.
- :class:`ResumeLoaderPositions`: the training DataLoaders resume at the checkpoint's mid-epoch position (the
  command line adds it to every run; ``StepCheckpoint`` does it too).
- :class:`PartialFileCheckpointIO`: single-file checkpoints written once, as ``<name>.partial`` beside ``<name>``
  then renamed (Lightning's default stages them in the system temp directory); ``gym_ddp``'s default.
- :func:`load_weights_only`: ``torch.load(weights_only=True)`` with a clear :class:`UnsafeCheckpointError`.
- ``python -m gym_lightning export`` (:mod:`gym_lightning.checkpointing.reading`): any strategy's checkpoint to a
  Hugging Face folder, streamed shard by shard.
"""

from gym_lightning.checkpointing.callback import StepCheckpoint
from gym_lightning.checkpointing.io import PartialFileCheckpointIO
from gym_lightning.checkpointing.loader_state import ResumeLoaderPositions
from gym_lightning.checkpointing.safe_load import UnsafeCheckpointError, load_weights_only

__all__ = [
    "PartialFileCheckpointIO",
    "ResumeLoaderPositions",
    "StepCheckpoint",
    "UnsafeCheckpointError",
    "load_weights_only",
]
