"""Random number generator states of one process as plain data (loadable with ``weights_only=True``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from gym_lightning._compat import rank_zero_info


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states, as tensors, ints and tuples only."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        restore_cuda_rng_states(list(state["cuda"]), torch.cuda.device_count())


def restore_cuda_rng_states(states: list[torch.Tensor], device_count: int) -> None:
    """The CUDA generators of the first ``min(len(states), device_count)`` devices from ``states``.

    Each rank saves the generators of every GPU it sees; a resume that sees another number of GPUs (a job moved to
    another machine, or ``CUDA_VISIBLE_DEVICES`` narrowed) made ``torch.cuda.set_rng_state_all`` fail on a device
    index that does not exist. The devices both runs have get their state back; one line says what was not
    restored (rank zero)."""
    for index, generator_state in enumerate(states[:device_count]):
        torch.cuda.set_rng_state(generator_state, index)
    if len(states) != device_count:
        rank_zero_info(
            f"gym_lightning: the checkpoint holds the CUDA generator states of {len(states)} device(s) and this "
            f"process sees {device_count}: restored those of the first {min(len(states), device_count)}; random "
            "draws on the others start from their seed."
        )
