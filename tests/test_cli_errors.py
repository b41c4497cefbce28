"""One way to fail: every bad input a user can give ends in one line naming it and the fix (exit status 2), through
the real CLI (``gym_lightning.cli.main``, in process: it is the code ``gym`` runs); a bug keeps its traceback."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from gym_lightning.cli import main
from gym_lightning.module import CausalLMModule

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest's own arguments in sys.argv would make LightningCLI warn that it got both args and a command line.
    monkeypatch.setattr("sys.argv", ["gym"])


def fit_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path / "run"),
        "--export.output_dir", "null", "--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0",
        "--trainer.limit_val_batches", "0", *extra,
    ]  # fmt: skip


def one_error_line(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Run the CLI, expect exit status 2 and exactly one error line (no traceback); return that line."""
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("gym_lightning: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err
    return lines[0]


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo should-not-run",))


def bad_checkpoints(tmp_path: Path) -> dict[str, Path]:
    files = {
        "random": os.urandom(2000),
        "text": b"not a checkpoint\n",
        "empty": b"",
        "legacy_pickle": pickle.dumps({"state_dict": _Evil()}),
    }
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name}.ckpt"
        paths[name].write_bytes(content)
    torch.save({"state_dict": {"w": torch.ones(3)}, "x": _Evil()}, tmp_path / "code.ckpt")
    torch.save({"w": torch.ones(3)}, tmp_path / "bare.ckpt")
    good = {"state_dict": {"w": torch.ones(3)}}
    torch.save(good, tmp_path / "good.ckpt")
    (tmp_path / "truncated.ckpt").write_bytes((tmp_path / "good.ckpt").read_bytes()[:200])
    return paths | {name: tmp_path / f"{name}.ckpt" for name in ("code", "bare", "truncated")}


@pytest.mark.parametrize("name", ["random", "text", "empty", "legacy_pickle", "code", "bare", "truncated"])
def test_fit_ckpt_path_that_is_not_a_safe_checkpoint(name: str, tmp_path: Path, capsys) -> None:
    path = bad_checkpoints(tmp_path)[name]
    line = one_error_line(capsys, fit_args(tmp_path, "--ckpt_path", str(path)))
    assert path.name in line
    assert ("Refused to load" in line) if name == "code" else ("checkpoint" in line), line
    assert "should-not-run" not in capsys.readouterr().out


def test_fit_ckpt_path_that_does_not_exist(tmp_path: Path, capsys) -> None:
    line = one_error_line(capsys, fit_args(tmp_path, "--ckpt_path", str(tmp_path / "nope.ckpt")))
    assert "nope.ckpt" in line and "does not exist" in line


@pytest.mark.parametrize("name", ["text", "code", "bare"])
def test_export_of_a_file_that_is_not_a_checkpoint(name: str, tmp_path: Path, capsys) -> None:
    path = bad_checkpoints(tmp_path)[name]
    line = one_error_line(capsys, ["export", "--checkpoint", str(path), "--output_dir", str(tmp_path / "hf")])
    assert path.name in line
    assert not (tmp_path / "hf").exists()


def test_non_utf8_data_file_names_file_line_and_byte(tmp_path: Path, capsys) -> None:
    data = tmp_path / "latin.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "completion": "2"}\n{"prompt": "caf\xe9=", "completion": "x"}\n')
    line = one_error_line(capsys, fit_args(tmp_path, "--data.dataset", "null", "--data.train_files", str(data)))
    assert "latin.jsonl:2" in line and "0xe9" in line and "UTF-8" in line


def test_unknown_strategy_lists_gym_lightning_names(tmp_path: Path, capsys) -> None:
    line = one_error_line(capsys, fit_args(tmp_path, "--trainer.strategy", "zerro3"))
    assert "'zerro3'" in line and "did you mean 'zero3'" in line and "gym_fsdp" in line and "ddp_spawn" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.lr", "abc"], "lr"),
        (["--trainer.max_stepz", "5"], "max_stepz"),
        (["--model.lr", "-1"], "lr must be > 0"),
    ],
)
def test_bad_settings_are_one_line(args: list[str], expected: str, tmp_path: Path, capsys) -> None:
    assert expected in one_error_line(capsys, fit_args(tmp_path, *args))


def test_unknown_command_suggests_the_closest(capsys) -> None:
    assert "did you mean 'fit'" in one_error_line(capsys, ["fitt"])


def test_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "train", "plan", "export"):
        assert f"\n  {command} " in out


@pytest.mark.parametrize("command", ["fit", "validate", "test", "predict", "train", "plan", "export"])
def test_every_command_has_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_a_bug_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError from inside training is a bug, not a user error: it must not be turned into one line."""

    def broken_step(self: CausalLMModule, batch: dict, batch_idx: int) -> torch.Tensor:
        raise ValueError("a bug inside training_step")

    monkeypatch.setattr(CausalLMModule, "training_step", broken_step)
    with pytest.raises(ValueError, match="a bug inside training_step"):
        main(fit_args(tmp_path))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def test_checkpoint_save_into_a_full_filesystem(tmp_path: Path, capsys) -> None:
    """A real full file system (a 1 MiB tmpfs; the tiny model's checkpoint is ~6 MB): one line, no partial file."""
    full = tmp_path / "full"
    if not _mount_tmpfs(full, "1m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        args = fit_args(
            tmp_path, "--trainer.enable_checkpointing", "true",
            "--trainer.callbacks+=gym_lightning.checkpointing.StepCheckpoint",
            "--trainer.callbacks.dirpath", str(full), "--trainer.callbacks.every_n_steps", "1",
        )  # fmt: skip
        line = one_error_line(capsys, args)
        assert "step-00000001.ckpt" in line and "No space left" in line, line
        assert os.listdir(full) == []  # the hidden .partial file is gone
    finally:
        subprocess.run(["umount", str(full)], check=False)
