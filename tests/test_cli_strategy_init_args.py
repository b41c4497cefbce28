"""A registered strategy name given init args (``--trainer.strategy zero_infinity --trainer.strategy.nvme_path X``):
one line showing the class-path form that works, instead of jsonargparse's dump of its union types."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from helpers.dist import REPO_ROOT

from gym_lightning import cli

ZERO3 = str(REPO_ROOT / "configs" / "zero3.yaml")


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", ZERO3, *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    return err


def test_a_registered_name_with_init_args_gets_the_class_path_form_that_works(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _error(capsys, "--trainer.strategy", "zero_infinity", "--trainer.strategy.nvme_path", "/scratch/swap")
    assert "Does not validate against any of the Union subtypes" not in err and "NestedArg" not in err
    assert "--trainer.strategy zero_infinity is a registered name, which takes no init args" in err
    form = err.split("give its class with them: ", 1)[1].split(" (in YAML", 1)[0]
    # The name's own init args, then the given one: the form runs what the user meant.
    assert form == (
        "--trainer.strategy gym_lightning.strategies.ZeROStrategy --trainer.strategy.stage 3 "
        "--trainer.strategy.offload_optimizer nvme --trainer.strategy.offload_parameters nvme "
        "--trainer.strategy.nvme_path /scratch/swap"
    )
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", ZERO3, *shlex.split(form), "--print_config"])
    assert info.value.code in (0, None)
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "gym_lightning.strategies.ZeROStrategy"
    assert {key: strategy["init_args"][key] for key in ("stage", "offload_optimizer", "nvme_path")} == {
        "stage": 3,
        "offload_optimizer": "nvme",
        "nvme_path": "/scratch/swap",
    }


def test_the_name_may_come_from_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"strategy": "zero3"}}))
    line = cli.named_strategy_with_init_args(
        ["fit", "--config", str(config), "--trainer.strategy.offload_optimizer=cpu"]
    )
    assert line is not None and line.startswith("--trainer.strategy zero3 is a registered name")
    assert "--trainer.strategy.stage 3 --trainer.strategy.offload_optimizer cpu" in line
    # Not this case: a class path with init args, or a name without any.
    assert cli.named_strategy_with_init_args(["fit", "--trainer.strategy", "zero3"]) is None
    assert cli.named_strategy_with_init_args(["fit", "--trainer.strategy", "a.B", "--trainer.strategy.x", "1"]) is None


def test_other_parse_errors_keep_their_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, "--trainer.strategy.no_such_argument", "1")
    assert "registered name" not in err and "no_such_argument" in err
