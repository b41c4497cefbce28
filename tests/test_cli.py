"""The LightningCLI front door: every shipped YAML parses, errors are one line, the quickstart trains and exports."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from gym_lightning.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gym_lightning", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c.relative_to(REPO)) for c in CONFIGS])
def test_every_shipped_config_parses(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config), "--print_config"])
    assert info.value.code == 0
    printed = capsys.readouterr().out
    assert "model:" in printed and "trainer:" in printed


def test_every_config_starts_with_its_launch_command() -> None:
    assert CONFIGS
    for config in CONFIGS:
        first = config.read_text().splitlines()[0]
        assert first.startswith("# ") and "gym_lightning" in first and config.name in first, config


def test_dotted_overrides_reach_the_module(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/quickstart.yaml", "--model.lr", "0.0001", "--print_config"])
    assert "lr: 0.0001" in capsys.readouterr().out


def test_user_errors_are_one_line_and_exit_non_zero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": oops}\n')
    proc = run_cli(
        "fit", "--config", "configs/quickstart.yaml", "--data.dataset", "null", "--data.train_files", str(bad),
        "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gym_lightning: error:")]
    assert len(errors) == 1 and "bad.jsonl" in errors[0] and ":2" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_config_problems_are_collected_in_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "configs/quickstart.yaml", "--data.batch_size", "0", "--data.val_split", "2.0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "batch_size" in err and "val_split" in err


def read_metrics(root: Path) -> dict[str, float]:
    """The last value of every metric in the CSV logger's file."""
    (metrics_file,) = root.rglob("metrics.csv")
    last: dict[str, float] = {}
    for row in csv.DictReader(metrics_file.open()):
        last.update({key: float(value) for key, value in row.items() if value not in ("", None)})
    return last


def test_quickstart_smoke_exports_a_loadable_folder(tmp_path: Path) -> None:
    proc = run_cli(
        "fit", "--config", "configs/quickstart.yaml", "--trainer.max_epochs", "1", "--trainer.limit_train_batches",
        "20", "--trainer.limit_val_batches", "1", "--trainer.check_val_every_n_epoch", "1",
        "--trainer.default_root_dir", str(tmp_path), "--export.output_dir", str(tmp_path / "hf"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert "val/exact_match" in read_metrics(tmp_path)


# The quickstart's learning claim (>= 90 % held-out exact match after the recipe's 5 epochs) is checked once, by
# tests/test_notebooks.py running notebooks/01_quickstart.ipynb (configs/quickstart.yaml's recipe, the same
# assertion); the command line's path through configs/quickstart.yaml by the smoke test above. A second full run
# here (74 s on 2 quiet cores) was removed for the test budget (issue 56).


def test_predict_writes_completions(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "12+30="}\n{"prompt": "7+8="}\n')
    proc = run_cli(
        "predict", "--config", "configs/quickstart.yaml", "--data.predict_files", str(prompts),
        "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in rows] == ["12+30=", "7+8="] and all("completion" in row for row in rows)


def test_a_local_model_folder_trains_from_the_cli(tmp_path: Path) -> None:
    """Model and data module then both name the folder as tokenizer (their hparams must agree for the logger)."""
    from gym_lightning.models import build_causal_lm
    from gym_lightning.tokenizer import load_tokenizer

    build_causal_lm("tiny-llama").save_pretrained(tmp_path / "model")
    load_tokenizer(None).save_pretrained(tmp_path / "model")
    proc = run_cli(
        "fit", "--config", "configs/quickstart.yaml", "--model.model", str(tmp_path / "model"),
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(tmp_path),
        "--export.output_dir", "null",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def files_under(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


@pytest.mark.parametrize("root", ["unset", "given"])
def test_a_run_writes_nothing_outside_its_folder(tmp_path: Path, root: str) -> None:
    """With no logger, config.yaml, curves.png and the JSON reports used to land loose in the current directory
    (overwriting a config.yaml of the user's). Without a default_root_dir the run now says which folder it uses."""
    cwd, folder = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    (cwd / "config.yaml").write_text("mine\n")
    given = ["--trainer.default_root_dir", str(folder)] if root == "given" else ["--trainer.default_root_dir", "null"]
    proc = subprocess.run(
        [sys.executable, "-m", "gym_lightning", "fit", "--config", str(REPO / "configs/quickstart.yaml"),
         "--trainer.logger", "false", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
         "--export.output_dir", "null", *given],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = ["config.yaml", "curves.png", "memory.json", "throughput.json"]
    if root == "given":
        assert files_under(cwd) == ["config.yaml"] and files_under(folder) == expected
    else:
        assert files_under(cwd) == ["config.yaml", *(f"outputs/run/{name}" for name in expected)]
        assert f"go to {cwd / 'outputs' / 'run'}" in proc.stdout + proc.stderr
    assert (cwd / "config.yaml").read_text() == "mine\n"
