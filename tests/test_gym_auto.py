"""``trainer.strategy: gym_auto`` end to end: the CLI detects the hardware, asks the planner, prints its one line and
runs with the choice; ``gym train --strategy gym_auto`` gets there; what cannot be planned is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from jsonargparse import Namespace

from gym_lightning import cli
from gym_lightning.cli import DetectedHardware, GymCLI, detect_hardware, main, resolve_auto_strategy
from gym_lightning.commands.train import parse_train_args, to_cli_args
from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.errors import GymUserError
from gym_lightning.metrics.hardware import gpu_for_device_name
from gym_lightning.module import CausalLMModule
from gym_lightning.planner.auto import choose_strategy
from gym_lightning.strategies import GymFSDPStrategy, strategy_name_problem

REPO = Path(__file__).resolve().parents[1]
AUTO_YAML = REPO / "configs" / "auto.yaml"
GiB = 1024**3
H100 = DetectedHardware("gpu", "h100-sxm", 80 * GiB, 8, 2048 * GiB)  # an 8 x H100 80GB node with 2 TiB of RAM
# configs/auto.yaml on one CPU process, short, writing only under the test's folder.
CPU_FLAGS = ("--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.callbacks", "null")
# Runs gym fit in a fresh process (a CPU gym_ddp run starts a gloo process group that lives until the process exits)
# and reports the class of the strategy the Trainer was built with.
RECORD_STRATEGY = """
import sys
from gym_lightning import cli
built = []
instantiate = cli.GymCLI.instantiate_trainer
def record(self, **kwargs):
    built.append(instantiate(self, **kwargs))
    return built[-1]
cli.GymCLI.instantiate_trainer = record
cli.main(sys.argv[1:])
print("STRATEGY", type(built[0].strategy).__name__, "STEPS", built[0].global_step)
"""


def test_a_cpu_fit_runs_with_the_planners_choice_and_says_why(tmp_path: Path) -> None:
    args = ["fit", "--config", str(AUTO_YAML), *CPU_FLAGS, "--trainer.max_steps", "2"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--export.output_dir", "null"]
    proc = subprocess.run(
        [sys.executable, "-c", RECORD_STRATEGY, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.startswith("gym_auto:")]
    assert len(lines) == 1 and "strategy: gym_ddp" in lines[0] and "CPU" in lines[0], output[-3000:]
    assert "STRATEGY GymDDPStrategy STEPS 2" in proc.stdout
    (saved,) = tmp_path.rglob("config.yaml")  # the run's own record names the choice: a resume gets the same
    assert "strategy: gym_ddp" in saved.read_text()


def test_a_class_choice_is_built_with_its_init_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    choice = {"class_path": "gym_lightning.strategies.GymFSDPStrategy", "init_args": {"sharding": "grad_op"}}
    line = "gym_auto: FSDP grad_op, for the test."
    monkeypatch.setattr(cli, "choose_strategy", lambda *a, **k: SimpleNamespace(strategy=choice, line=line))
    said: list[str] = []
    monkeypatch.setattr(cli, "rank_zero_info", said.append)
    monkeypatch.setattr(sys, "argv", ["gym"])  # LightningCLI warns when pytest's own arguments are there too
    args = ["--config", str(AUTO_YAML), *CPU_FLAGS, "--trainer.default_root_dir", str(tmp_path)]
    built = GymCLI(CausalLMModule, CausalLMDataModule, args=args, run=False)
    strategy = built.trainer.strategy
    assert isinstance(strategy, GymFSDPStrategy) and strategy.sharding == "grad_op"
    assert line in said
    assert "GymFSDPStrategy" in built.parser.dump(built.config)  # config.yaml records the class and its arguments


def _qwen3_8b() -> Namespace:
    """A parsed ``gym fit`` config (as LightningCLI holds it) of Qwen3-8B with ``trainer.strategy: gym_auto``."""
    trainer = Namespace(strategy="gym_auto", accelerator="auto", devices="auto", num_nodes=1, precision="bf16-mixed")
    data = Namespace(batch_size=1, max_seq_length=2048, dataset="addition")
    return Namespace(trainer=trainer, model=Namespace(model="qwen3-8b", lora=None), data=data)


def test_on_a_fake_h100_node_the_choice_is_the_planners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "detect_hardware", lambda trainer: H100)
    said: list[str] = []
    monkeypatch.setattr(cli, "rank_zero_info", said.append)
    chosen = resolve_auto_strategy(_qwen3_8b())
    plain = {
        "trainer": {"accelerator": "auto", "devices": "auto", "num_nodes": 1, "precision": "bf16-mixed"},
        "model": {"model": "qwen3-8b"},
        "data": {"batch_size": 1, "max_seq_length": 2048, "dataset": "addition"},
    }
    expected = choose_strategy(plain, gpu="h100-sxm", gpu_memory=80 * GiB, host_memory=2048 * GiB, gpus_per_node=8)
    as_value = chosen if isinstance(chosen, str) else chosen.as_dict()
    assert as_value == expected.strategy
    assert said == [expected.line] and "h100" in said[0] and "8 x" in said[0]


def test_a_gpu_the_catalog_lacks_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    unlisted = DetectedHardware("gpu", None, 80 * GiB, 8, 2048 * GiB, "NVIDIA Mystery X1")
    monkeypatch.setattr(cli, "detect_hardware", lambda trainer: unlisted)
    said: list[str] = []
    monkeypatch.setattr(cli, "rank_zero_info", said.append)
    resolve_auto_strategy(_qwen3_8b())
    assert len(said) == 2 and "'NVIDIA Mystery X1' is not in gym_lightning's GPU catalog" in said[1]


def test_cuda_detection_reads_device_zero_and_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: SimpleNamespace(total_memory=85 * 10**9))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    found = detect_hardware({"accelerator": "auto"})
    catalog = gpu_for_device_name(name)
    assert catalog is not None
    assert (found.accelerator, found.gpu, found.gpu_memory, found.devices) == ("gpu", catalog.key, 85 * 10**9, 8)
    assert found.device_name == name
    assert found.host_memory and found.host_memory > GiB
    on_cpu = detect_hardware({"accelerator": "cpu"})  # asked for CPU: no GPU figures even where one is visible
    assert (on_cpu.accelerator, on_cpu.gpu, on_cpu.gpu_memory, on_cpu.devices) == ("cpu", None, None, 1)


def _cpu_host(memory: int) -> Any:
    return lambda trainer: DetectedHardware("cpu", None, None, 1, memory)


def _fit_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """The one error line of ``gym fit --config configs/auto.yaml`` on one CPU process with ``flags``."""
    monkeypatch.setattr(sys, "argv", ["gym"])
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(AUTO_YAML), *CPU_FLAGS, *flags])
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gym_lightning: error:")]
    assert len(errors) == 1
    return errors[0]


def test_nothing_fits_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "detect_hardware", _cpu_host(64 * 1024**2))  # 64 MiB of host RAM: not even tiny-llama
    error = _fit_error(monkeypatch, capsys)
    assert "gym_auto" in error and "no strategy fits" in error and "CPU" in error, error


def test_a_config_the_planner_cannot_read_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error = _fit_error(monkeypatch, capsys, "--trainer.precision", "64-true")
    assert "gym_auto" in error and "trainer.precision 64-true" in error, error


def test_gym_auto_is_a_strategy_name_and_close_to_its_typos() -> None:
    assert strategy_name_problem("gym_auto") is None
    problem = strategy_name_problem("gym_atuo")
    assert problem is not None and "'gym_auto'" in problem


def _train_cli_args(*flags: str) -> dict[str, str]:
    args = to_cli_args(parse_train_args(["--model_name_or_path", "tiny-llama", "--dataset", "addition", *flags]), {})
    return dict(arg[2:].split("=", 1) for arg in args[1:])


def test_gym_train_passes_gym_auto_to_the_fit_config() -> None:
    assert _train_cli_args("--strategy", "gym_auto")["trainer.strategy"] == "gym_auto"


@pytest.mark.parametrize("flag", [("--ddp_timeout", "60"), ("--sequence_parallel_size", "2")])
def test_gym_train_refuses_strategy_arguments_with_gym_auto(flag: tuple[str, str]) -> None:
    with pytest.raises(GymUserError, match=f"{flag[0]} sets an argument of the strategy.*--strategy gym_auto"):
        _train_cli_args("--strategy", "gym_auto", *flag)
    assert "timeout" in _train_cli_args("--strategy", "gym_ddp", "--ddp_timeout", "60")["trainer.strategy"]
