"""``PartialFileCheckpointIO``: single-file checkpoints written once, next to where they live, never via TMPDIR.

Lightning's ``TorchCheckpointIO`` saves through ``_atomic_save``: the whole checkpoint is serialised into an in-memory
``BytesIO`` (a second copy of every tensor in host memory), then written inside an fsspec transaction, which for a
local path writes a temporary file in the system temp directory and copies it into place on commit. A 7B model's
checkpoint with AdamW state (112 GB) then needs a temp directory as large, is written twice, and the save's peak host
memory holds the serialised bytes on top of the state dict (seen in the traceback of a save into a full
file system). Here ``torch.save`` streams into ``<name>.partial`` in the destination folder, which is fsynced and
renamed over ``<name>`` (``gym_lightning.atomic.atomic_file``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

from gym_lightning.atomic import atomic_file
from gym_lightning.checkpointing.manifest import HashingFile


class PartialFileCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves write ``<name>.partial`` beside ``<name>`` and rename it.

    Remote paths (``s3://``, ...) keep Lightning's fsspec transaction, which is how object stores commit a file.
    Loading is ``TorchCheckpointIO``'s. No arguments.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # raises on storage_options, as Lightning's
            return
        with atomic_file(path) as file:
            hashing = HashingFile(file)  # the manifest's digest, taken as the bytes go out (no second read)
            torch.save(checkpoint, hashing)
        hashing.remember(path)


__all__ = ["PartialFileCheckpointIO"]
