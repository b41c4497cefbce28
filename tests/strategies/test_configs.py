"""The shipped strategy configs run as documented: ``python -m gym_lightning fit --config configs/<name>.yaml``.

ddp, fsdp and zero1-3 train once per session for this test, the export matrix and the damaged-checkpoint tests
(``helpers.cli_runs``: shortened as a user would, both ranks started by torchrun); Lightning's own launcher starts
the ranks of zero3_offload here, of ddp.yaml in the hung-rank test, of fsdp.yaml and zero3.yaml in the damaged-shard
resumes, and of zero3.yaml in .ci/run's plain install."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.dist import REPO_ROOT, rank_env, run_python

CONFIGS = ["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_starts_with_its_launch_command_and_targets_two_devices(name: str) -> None:
    path = REPO_ROOT / "configs" / f"{name}.yaml"
    first_line = path.read_text().splitlines()[0]
    assert first_line == f"# python -m gym_lightning fit --config configs/{name}.yaml"
    trainer = yaml.safe_load(path.read_text())["trainer"]
    assert (trainer["accelerator"], trainer["devices"]) == ("auto", 2)
    assert trainer["strategy"]["class_path"].startswith("gym_lightning.strategies.")


# The shipped configs that the export, damage and hung-rank tests also train (helpers.cli_runs, shared per session).
SHARED_RUNS = {"ddp": "gym_ddp", "fsdp": "gym_fsdp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_on_two_cpu_processes_and_exports(name: str, cli_run, tmp_path: Path) -> None:
    if name in SHARED_RUNS:
        export_dir = cli_run(SHARED_RUNS[name]).export()
    else:
        export_dir = tmp_path / "hf"
        run_python(
            [
                "-m", "gym_lightning", "fit", "--config", f"configs/{name}.yaml", "--trainer.max_steps=2",
                f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                f"--export.output_dir={export_dir}",
            ],
            timeout=600,
            env=rank_env(),
        )  # fmt: skip
    assert (export_dir / "model.safetensors").is_file()
    assert (export_dir / "config.json").is_file()
