"""Random number generator states of one process as plain data (loadable with ``weights_only=True``).

A rank draws on the CUDA generator of its own device only, so that is the one it saves (``"cuda_device"``) and the
one it restores, into the device it runs on now (``torch.cuda.current_device()``, which Lightning sets to the rank's
device), whatever that device's index: a resume under another ``CUDA_VISIBLE_DEVICES``, or a one-GPU-per-rank launch
(``srun --gpus-per-task=1``, where every rank's device is ``cuda:0``), gets each rank's own generator back.
Checkpoints written before held every visible device's generator (``"cuda"``, ``get_rng_state_all``) and restored
state i into visible device i, which gave a one-GPU-per-rank resume the wrong generator; they still load
(:func:`own_generator_of_old_list`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from gym_lightning._compat import rank_zero_info

CUDA_DEVICE_KEY = "cuda_device"  # this rank's own device's generator state
OLD_CUDA_LIST_KEY = "cuda"  # older checkpoints: every visible device's generator state, by visible index


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (once CUDA is in use) this rank's CUDA generator states, as tensors, ints and
    tuples only."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[CUDA_DEVICE_KEY] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng_state(state: dict[str, Any], local_rank: int = 0) -> None:
    """Inverse of ``capture_rng_state``; ``local_rank`` (the rank's index on its node) reads an older checkpoint's
    list of every device's generator (:func:`own_generator_of_old_list`)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    own = state.get(CUDA_DEVICE_KEY)
    if own is None and OLD_CUDA_LIST_KEY in state:
        own = own_generator_of_old_list(list(state[OLD_CUDA_LIST_KEY]), local_rank)
    if own is not None:
        torch.cuda.set_rng_state(own, torch.cuda.current_device())


def own_generator_of_old_list(states: list[torch.Tensor], local_rank: int) -> torch.Tensor | None:
    """This rank's generator in an older checkpoint's list of every visible device's generator, or ``None``.

    The list does not say which device the rank ran on. One entry is the rank's own (it saw one device); when this
    process sees as many devices as the list holds, the visibility is unchanged and the rank's device has the same
    index as then (``current_device()``); otherwise (a one-GPU-per-rank resume of a run that saw every GPU) the
    rank's entry is its local rank's, as Lightning gives local rank i the i-th device. A local rank beyond the list
    restores nothing, and rank zero says so.
    """
    current, visible = torch.cuda.current_device(), torch.cuda.device_count()
    if len(states) == 1:
        return states[0]
    if len(states) == visible:
        return states[current]
    if local_rank < len(states):
        return states[local_rank]
    rank_zero_info(
        f"gym_lightning: the checkpoint holds the CUDA generator states of {len(states)} device(s) (an older format "
        f"that does not say which was this rank's) and this process sees {visible}: the CUDA generator starts from "
        "its seed."
    )
    return None


__all__ = ["CUDA_DEVICE_KEY", "capture_rng_state", "own_generator_of_old_list", "restore_rng_state"]
