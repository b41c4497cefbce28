"""A quiet console on the command line: DeepSpeed's CPU fallback warning and Lightning's tips are gone, real messages
stay; the CLI's default loggers and callbacks (progress bar without v_num, lr monitor, curves)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gym_lightning import CurvesCallback, GymProgressBar, ThroughputCallback
from gym_lightning.cli import GymCLI
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.module import CausalLMModule
from gym_lightning.quiet import quiet_console, silence_deepspeed_cpu_detection

REPO_ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU"


@pytest.mark.skipif(
    "torch" in sys.modules and sys.modules["torch"].cuda.is_available(), reason="the warning is a CPU-only one"
)
def test_the_command_line_keeps_deepspeed_quiet_on_a_cpu() -> None:
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    code = (
        "import os, gym_lightning.cli as cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "import deepspeed; print(os.environ['DS_ACCELERATOR'], deepspeed.get_accelerator()._name)"
    )
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    # The accelerator DeepSpeed picks is the one it picked before.
    assert quiet.stdout.split()[-2:] == ["cpu", "cpu"]
    assert DEEPSPEED_CPU_WARNING not in quiet.stdout + quiet.stderr
    # The source this test is about still exists, and importing gym_lightning alone leaves it alone.
    loud = subprocess.run(
        [sys.executable, "-c", "import gym_lightning, deepspeed"], env=env, capture_output=True, text=True
    )
    assert DEEPSPEED_CPU_WARNING in loud.stdout + loud.stderr


def test_a_users_ds_accelerator_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    silence_deepspeed_cpu_detection()
    assert os.environ["DS_ACCELERATOR"] == "cuda"


def test_lightning_tips_are_dropped_and_other_info_kept() -> None:
    quiet_console()  # what the command line does first
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing litlogger")
        rank_zero_info("Loading `train_dataloader` to estimate number of stepping batches.")
        rank_zero_info("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
        logger.level = level
    assert records == ["GPU available: False, used: False"]


def test_bitsandbytes_gemm_notice_is_dropped_and_its_other_warnings_kept() -> None:
    from gym_lightning.quiet import BNB_CPU_LOGGER

    quiet_console()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(BNB_CPU_LOGGER)
    logger.addHandler(handler)
    try:
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "No module")
        logger.warning("another bitsandbytes warning")
    finally:
        logger.removeHandler(handler)
    assert records == ["another bitsandbytes warning"]


def test_lightnings_leafspec_deprecation_is_silenced_only_from_its_module() -> None:
    import gym_lightning.quiet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        gym_lightning.quiet.quiet_console()  # catch_warnings reset the filters: install them again inside it
        message = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="my_project.trees")
    assert [str(w.message) for w in caught] == [message]  # the user's own code still warns


def test_torchs_collective_deprecations_under_zero_are_silenced() -> None:
    """torch 2.13 warns on each all_gather_into_tensor / reduce_scatter_tensor DeepSpeed's ZeRO-3 makes (thousands
    in a 10-step run); other warnings of that module stay."""
    import gym_lightning.quiet

    module, file = "torch.distributed.c10d_logger", "c10d_logger.py"
    kept = "`torch.distributed.some_other_op` is deprecated. Please use `x` instead."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gym_lightning.quiet.quiet_console()
        for name, new in (
            ("all_gather_into_tensor", "all_gather_single"),
            ("reduce_scatter_tensor", "reduce_scatter_single"),
        ):
            message = f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed.{new}` instead."
            warnings.warn_explicit(message, FutureWarning, file, 83, module=module)
        warnings.warn_explicit(kept, FutureWarning, file, 83, module=module)
    assert [str(w.message) for w in caught] == [kept]


def test_progress_bar_drops_v_num(tmp_path: Path) -> None:
    bar = GymProgressBar()
    trainer = pl.Trainer(logger=CSVLogger(tmp_path), callbacks=[bar], default_root_dir=tmp_path)
    assert "v_num" in TQDMProgressBar.get_metrics(bar, trainer, None)  # what Lightning's bar shows
    assert "v_num" not in bar.get_metrics(trainer, None)


def wired_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> pl.Trainer:
    monkeypatch.setattr(sys, "argv", ["gym"])  # LightningCLI warns when pytest's own arguments are there too
    args = ["--config", str(REPO_ROOT / "configs" / "quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    cli = GymCLI(CausalLMModule, CausalLMDataModule, args=[*args, *flags], run=False)
    return cli.trainer


def test_cli_defaults_add_loggers_and_callbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = wired_trainer(tmp_path, monkeypatch)
    kinds = [type(callback) for callback in trainer.callbacks]
    for kind in (ThroughputCallback, GymProgressBar, LearningRateMonitor, CurvesCallback):  # configured + defaults
        assert kinds.count(kind) == 1, kinds
    assert [type(logger) for logger in trainer.loggers] == [CSVLogger, TensorBoardLogger]
    csv, tensorboard = trainer.loggers
    assert tensorboard.log_dir == csv.log_dir == str(tmp_path / "lightning_logs" / "version_0")


def test_cli_defaults_respect_no_progress_bar_and_no_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = wired_trainer(
        tmp_path, monkeypatch, "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"
    )
    kinds = [type(callback) for callback in trainer.callbacks]
    assert GymProgressBar not in kinds and LearningRateMonitor not in kinds and CurvesCallback in kinds
    assert trainer.loggers == []


def test_without_tensorboard_the_cli_logs_csv_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gym_lightning.cli.tensorboard_available", lambda: False)
    trainer = wired_trainer(tmp_path, monkeypatch)
    assert [type(logger) for logger in trainer.loggers] == [CSVLogger]
