"""CUDA generator states: a rank saves and restores its own device's generator, whatever the device visibility.

There is no GPU here, so ``torch.cuda`` is replaced by :class:`FakeCuda`: a machine of 4 GPUs, each with its own
generator state, seen by a process through its visible devices (``CUDA_VISIBLE_DEVICES``) and a current device
(what Lightning's ``torch.cuda.set_device`` picks for the rank). It keeps what a CPU run of the same code cannot
show: that a visible index names a different physical GPU in another launch, and which GPU's generator a
``set_rng_state(state, index)`` writes. The tests check the generator of the GPU the rank runs on after a resume.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gym_lightning.checkpointing import load_weights_only
from gym_lightning.checkpointing.callback import RNG_KEY, StepCheckpoint
from gym_lightning.checkpointing.rng import capture_rng_state, restore_rng_state


class FakeCuda:
    """``torch.cuda``'s generator functions on a machine of ``gpus`` GPUs, seen through ``visible`` (physical
    indices, in visible order) with ``current`` (a visible index) set as the process's device."""

    def __init__(self, visible: list[int], current: int, gpus: int = 4) -> None:
        self.generators = {gpu: torch.full((16,), gpu, dtype=torch.uint8) for gpu in range(gpus)}
        self.visible, self.current = visible, current
        self.written: list[int] = []  # physical GPUs whose generator was set

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.visible))
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.generators[self._gpu(device)].clone())
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [self.generators[g].clone() for g in self.visible])
        monkeypatch.setattr(cuda, "set_rng_state", self._set)
        return self

    def _gpu(self, device: int | str | torch.device) -> int:
        """The physical GPU of a device argument (an index, ``"cuda"``, ``"cuda:i"``, a ``torch.device``)."""
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        return self.visible[self.current if device.index is None else device.index]

    def _set(self, state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        gpu = self._gpu(device)
        self.generators[gpu] = state.clone()
        self.written.append(gpu)

    def own(self) -> torch.Tensor:
        """The generator state of the GPU this process runs on."""
        return self.generators[self.visible[self.current]]


def draw_on(fake: FakeCuda) -> torch.Tensor:
    """A rank's draws move its own device's generator on: a state no other GPU holds."""
    fake.generators[fake.visible[fake.current]] = torch.arange(16, dtype=torch.uint8) + 100
    return fake.own().clone()


def test_a_one_gpu_per_rank_resume_restores_the_ranks_own_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    saved_fake = FakeCuda(visible=[0, 1, 2, 3], current=2).install(monkeypatch)  # local rank 2, every GPU visible
    mine = draw_on(saved_fake)
    state = capture_rng_state()
    resumed = FakeCuda(visible=[2], current=0).install(monkeypatch)  # srun --gpus-per-task=1: its GPU is cuda:0
    restore_rng_state(state)  # the new format needs no local rank
    assert torch.equal(resumed.own(), mine)
    assert resumed.written == [2]  # no other device's generator was written


def test_a_resume_that_sees_every_gpu_restores_the_generator_saved_on_the_only_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved_fake = FakeCuda(visible=[3], current=0).install(monkeypatch)  # saved one GPU per rank
    mine = draw_on(saved_fake)
    state = capture_rng_state()
    resumed = FakeCuda(visible=[0, 1, 2, 3], current=1).install(monkeypatch)  # local rank 1, every GPU visible
    restore_rng_state(state)
    assert torch.equal(resumed.own(), mine) and resumed.written == [1]


def test_the_saved_state_is_plain_data_and_survives_a_weights_only_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mine = draw_on(FakeCuda(visible=[0, 1], current=1).install(monkeypatch))
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    resumed = FakeCuda(visible=[0, 1], current=1).install(monkeypatch)
    restore_rng_state(load_weights_only(tmp_path / "rng.pt"))
    assert torch.equal(resumed.own(), mine) and resumed.written == [1]


@pytest.mark.parametrize(
    ("visible", "current", "local_rank", "expected"),
    [
        ([0, 1, 2, 3], 2, 2, 2),  # same visibility: the current device's index in the list
        ([1], 0, 1, 1),  # one GPU per rank now: the local rank's entry
        ([0, 1, 2, 3, 4, 5], 5, 5, None),  # saved seeing 4, local rank 5 now: not in the list, nothing restored
    ],
)
def test_an_older_checkpoint_with_every_devices_generator_still_loads(
    monkeypatch: pytest.MonkeyPatch, visible: list[int], current: int, local_rank: int, expected: int | None
) -> None:
    old = {**capture_rng_state(), "cuda": [torch.full((16,), 50 + i, dtype=torch.uint8) for i in range(4)]}
    resumed = FakeCuda(visible=visible, current=current, gpus=max(4, len(visible))).install(monkeypatch)
    before = resumed.own().clone()
    restore_rng_state(old, local_rank=local_rank)
    if expected is None:
        assert resumed.written == [] and torch.equal(resumed.own(), before)
    else:
        assert torch.equal(resumed.own(), old["cuda"][expected]) and resumed.written == [visible[current]]


def test_the_checkpoint_callback_restores_by_global_rank_into_the_local_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    states = []
    for gpu in (0, 1):  # two ranks of a job that saw both GPUs
        states.append({**capture_rng_state(), "cuda_device": torch.full((16,), 70 + gpu, dtype=torch.uint8)})
    resumed = FakeCuda(visible=[1], current=0).install(monkeypatch)  # rank 1, alone on its GPU
    trainer = SimpleNamespace(world_size=2, global_rank=1, local_rank=1)
    StepCheckpoint(dirpath="unused").on_load_checkpoint(trainer, None, {RNG_KEY: states})  # type: ignore[arg-type]
    assert torch.equal(resumed.own(), states[1]["cuda_device"]) and resumed.written == [1]
