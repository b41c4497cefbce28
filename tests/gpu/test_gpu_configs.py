"""``gym fit`` of every shipped config that runs on one GPU, as a user types it (gpu_configs.py's docstring)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from gpu_configs import ConfigRun, check_config, config_runs
from gpu_runs import Check, Context

from benchmarks.common.models import make_family_folder

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qlora_model(ctx: Context) -> Path:
    """The qlora config's model: a random bf16 Qwen3 folder with the shipped tokenizer (the config names a hub
    model, which the device machine cannot reach)."""
    return make_family_folder("qwen3", ctx.work / "qwen3_random")


@pytest.mark.parametrize("run", config_runs(), ids=lambda run: run.name)
def test_gym_fit_of_the_shipped_config(check: Check, ctx: Context, qlora_model: Path, run: ConfigRun) -> None:
    check(f"gym_fit/{run.name}", partial(check_config, ctx, run, qlora_model))
