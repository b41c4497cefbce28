"""Checkpoint manifests (``gym_lightning.checkpointing.manifest``) in one process: what is recorded, which rank
checks which file, and the one error a damaged file gives on resume, in ``gym export`` and on the command line.
The 2-rank runs (a damaged shard of a sharded checkpoint made by ``gym fit``) are in checkpointing/test_damage.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_step_checkpoint import fit, tiny_module

from gym_lightning.checkpointing import StepCheckpoint
from gym_lightning.checkpointing.manifest import (
    HASH_NAME,
    checkpoint_files,
    file_digest,
    file_problems,
    hash_owned_files,
    owner_of,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from gym_lightning.errors import GymUserError


def flip(path: Path, offset: int, count: int = 4096) -> None:
    """Invert ``count`` bytes of ``path`` from ``offset`` (same size, different content)."""
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    path.write_bytes(bytes(data))


def test_shard_files_belong_to_the_rank_their_name_gives_the_rest_to_rank_0() -> None:
    assert owner_of("__1_0.distcp", 2) == 1 and owner_of(".metadata", 2) == 0 and owner_of("meta.pt", 2) == 0
    assert owner_of("checkpoint/zero_pp_rank_3_mp_rank_00_optim_states.pt", 4) == 3
    assert owner_of("checkpoint/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 2) == 1
    assert owner_of("checkpoint/mp_rank_00_model_states.pt", 2) == 0
    assert owner_of("checkpoint/zero_pp_rank_3_mp_rank_00_optim_states.pt", 2) == 1, "fewer ranks: shared out"


def test_a_folder_manifest_records_every_file_and_finds_each_kind_of_damage(tmp_path: Path) -> None:
    folder = tmp_path / ".step-00000004.ckpt.partial"
    (folder / "checkpoint").mkdir(parents=True)
    for rank in (0, 1):
        (folder / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes([rank]) * 9000)
    (folder / "latest").write_text("checkpoint")
    records = [hash_owned_files(folder, rank, 2) for rank in (0, 1)]
    assert sorted(records[1]) == ["checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    write_manifest(folder, tmp_path / "step-00000004.ckpt", records, {"world_size": 2})
    final = tmp_path / "step-00000004.ckpt"
    folder.rename(final)
    manifest = read_manifest(final)
    assert (
        sorted(manifest["files"])
        == checkpoint_files(final)
        == sorted(["latest", *(f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))])
    )
    assert manifest["files"]["latest"] == {"size": 10, HASH_NAME: file_digest(final / "latest"), "rank": 0}
    assert file_problems(final) == []

    shard = final / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(shard, 100, 8)
    assert file_problems(final, rank=0, world_size=2) == [], "rank 0 does not check rank 1's shard"
    [problem] = file_problems(final, rank=1, world_size=2)
    assert str(shard) in problem and "has the recorded size (9,000 bytes) but xxh3_128" in problem
    shard.write_bytes(shard.read_bytes()[:4500])
    assert "has 4,500 bytes, the manifest records 9,000" in file_problems(final, rank=1, world_size=2)[0]
    shard.unlink()
    assert file_problems(final, rank=1, world_size=2) == [f"{shard} is missing"]


def test_one_rank_finding_damage_makes_every_rank_raise_the_same_error(tmp_path: Path) -> None:
    (tmp_path / "ok.ckpt").write_bytes(b"fine")
    found_elsewhere = ["/ckpt/__1_0.distcp has 5 bytes, the manifest records 9"]
    with pytest.raises(GymUserError, match=r"is damaged and was not loaded: /ckpt/__1_0\.distcp has 5 bytes"):
        verify_checkpoint(tmp_path / "ok.ckpt", rank=0, world_size=2, gather=lambda mine: [mine, found_elsewhere])


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> Path:
    """A single-process run with checkpoints at steps 2 and 4 (files with their manifests beside them)."""
    fit(tiny_module(), tmp_path, [StepCheckpoint(tmp_path / "ck", every_n_steps=2, keep_last=2)], max_steps=4)
    return tmp_path / "ck"


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_resuming_a_damaged_checkpoint_names_the_file_and_the_previous_checkpoint(
    two_checkpoints: Path, tmp_path: Path, damage: str
) -> None:
    from gym_lightning.strategies import GymDDPStrategy

    target = two_checkpoints / "step-00000004.ckpt"
    manifest = json.loads((two_checkpoints / "step-00000004.ckpt.manifest.json").read_text())
    assert manifest["files"]["step-00000004.ckpt"]["size"] == target.stat().st_size
    assert manifest["global_step"] == 4 and manifest["world_size"] == 1
    size = target.stat().st_size
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[: size // 2])
    else:
        flip(target, size // 2)
    expected = "recorded size" if damage == "flipped" else f"has {size // 2:,} bytes, the manifest records {size:,}"
    with pytest.raises(GymUserError, match="is damaged and was not loaded") as info:
        # gym_ddp checks before it reads (on 1 device as on N; each rank checks the files it owns)
        GymDDPStrategy().load_checkpoint(two_checkpoints / "last.ckpt")
    message = str(info.value)
    assert expected in message and str(target) in message
    assert f"--ckpt_path {two_checkpoints / 'step-00000002.ckpt'}" in message


def test_gym_export_and_the_command_line_check_the_manifest(
    two_checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gym_lightning.checkpointing.reading import export_checkpoint
    from gym_lightning.cli import main

    flip(two_checkpoints / "step-00000004.ckpt", 2000)
    with pytest.raises(GymUserError, match=r"step-00000004\.ckpt is damaged"):
        export_checkpoint(two_checkpoints / "last.ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists(), "nothing written from a damaged checkpoint"
    export_checkpoint(two_checkpoints / "step-00000002.ckpt", tmp_path / "hf")  # the previous one is intact
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "configs/quickstart.yaml", "--ckpt_path", str(two_checkpoints / "last.ckpt")])
    assert info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("gym_lightning: error: The checkpoint") and "step-00000002.ckpt" in line
