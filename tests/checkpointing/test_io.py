"""Single-file checkpoints are written once, beside their final name: nothing is opened in the temp directory."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from gym_lightning.checkpointing import PartialFileCheckpointIO
from gym_lightning.strategies import GymDDPStrategy

# Paths opened while a save runs (sys.addaudithook sees every open(), os.open and mkstemp); None: not recording.
_OPENED: list[str] | None = None


def _record_opens(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_record_opens)  # audit hooks cannot be removed; it records only inside _opened_during


@pytest.fixture
def empty_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """TMPDIR pointed at an empty folder (tempfile caches its choice: reset it so the variable is read again)."""
    folder = tmp_path / "system-tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield folder


def _save_recording_opens(io: TorchCheckpointIO, target: Path) -> list[str]:
    global _OPENED
    _OPENED = []
    try:
        io.save_checkpoint({"state_dict": {"w": torch.arange(1000.0)}, "epoch": 3}, target)
        return _OPENED
    finally:
        _OPENED = None


def test_lightning_default_stages_the_checkpoint_in_tmpdir(empty_tmpdir: Path, tmp_path: Path) -> None:
    """The control: Lightning's TorchCheckpointIO opens a file in TMPDIR (then moves it), so the check can fail."""
    opened = _save_recording_opens(TorchCheckpointIO(), tmp_path / "ckpt" / "step.ckpt")
    assert any(path.startswith(str(empty_tmpdir)) for path in opened), opened


def test_partial_file_io_writes_only_beside_the_target(empty_tmpdir: Path, tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "step.ckpt"
    opened = _save_recording_opens(PartialFileCheckpointIO(), target)
    assert not any(path.startswith(str(empty_tmpdir)) for path in opened), opened
    assert list(empty_tmpdir.iterdir()) == []
    written = [Path(path) for path in opened if Path(path).parent == target.parent]
    assert written == [target.parent / "step.ckpt.partial"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["step.ckpt"]
    loaded = PartialFileCheckpointIO().load_checkpoint(target, weights_only=True)
    assert loaded["epoch"] == 3 and torch.equal(loaded["state_dict"]["w"], torch.arange(1000.0))


def test_failed_save_leaves_the_old_checkpoint_and_no_partial(tmp_path: Path) -> None:
    target = tmp_path / "step.ckpt"
    PartialFileCheckpointIO().save_checkpoint({"epoch": 1}, target)
    with pytest.raises(Exception, match="pickle"):  # a lambda cannot be pickled: torch.save fails halfway
        PartialFileCheckpointIO().save_checkpoint({"epoch": 2, "bad": lambda: None}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.ckpt"]
    assert torch.load(target, weights_only=True) == {"epoch": 1}


def test_gym_ddp_saves_through_it_by_default() -> None:
    assert isinstance(GymDDPStrategy().checkpoint_io, PartialFileCheckpointIO)
    assert isinstance(GymDDPStrategy(checkpoint_io=TorchCheckpointIO()).checkpoint_io, TorchCheckpointIO)
