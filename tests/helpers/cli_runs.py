"""Training runs made the way users make them: a shipped YAML, changed as a user would, run by ``gym fit``.

``cli_runs({(strategy, lora): out})`` copies ``configs/<strategy>.yaml``, shortens it (4 optimizer steps, a checkpoint
every 2 steps) and, for LoRA, adds ``model.lora`` and a second ``HFExport`` callback that writes the PEFT adapter
beside the merged export of the ``export:`` section. Both ranks start together as torchrun starts them, forked from
the worker's preloaded server (``helpers.dist.run_ranks``; torchrun itself and Lightning's own launcher are exercised
where they are the subject), and the run's checkpoints and end-of-fit exports are what ``gym export`` and resume
tests compare against.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from helpers.dist import REPO_ROOT, run_ranks

CONFIGS = {"gym_ddp": "ddp", "gym_fsdp": "fsdp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
STEPS, EVERY = 4, 2


@dataclass(frozen=True)
class CliRun:
    """Where a ``gym fit`` run left its files."""

    root: Path  # trainer.default_root_dir
    config: Path  # the YAML it ran

    @classmethod
    def of(cls, root: Path) -> CliRun:
        """The run :func:`cli_runs` trained into ``root`` (its YAML is ``root/run.yaml``)."""
        return cls(root, root / "run.yaml")

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def export(self, lora: str = "merged") -> Path:
        """The end-of-fit Hugging Face folder (``adapter``: the PEFT adapter of a LoRA run)."""
        return self.root / ("hf-adapter" if lora == "adapter" else "hf")


def run_config(
    strategy: str,
    lora: bool,
    out: Path,
    callbacks: list[dict[str, Any]] = (),
    name: str = "run.yaml",
    checkpoints: bool = True,
    **changes: Any,
) -> Path:
    """``configs/<strategy>.yaml`` as a user would shorten it, written to ``out/<name>``; ``callbacks`` are added to
    the trainer's (``{"class_path": ..., "init_args": ...}``), ``checkpoints=False`` drops the shipped checkpoint
    callback, ``changes`` are dotted ``section.key`` settings applied on top (``{"trainer.max_steps": 6}``)."""
    config = yaml.safe_load((REPO_ROOT / "configs" / f"{CONFIGS[strategy]}.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", max_steps=STEPS, default_root_dir=str(out))
    extra, callbacks = list(callbacks), list(trainer["callbacks"])
    if not checkpoints:
        callbacks = [c for c in callbacks if not c["class_path"].endswith("StepCheckpoint")]
        trainer["enable_checkpointing"] = False
    for callback in callbacks:
        if callback["class_path"].endswith("StepCheckpoint"):
            callback["init_args"] = {"dirpath": str(out / "checkpoints"), "every_n_steps": EVERY, "keep_last": 3}
    config["export"]["output_dir"] = str(out / "hf")
    if lora:
        config["model"]["lora"] = dict(LORA)
        adapter = {"output_dir": str(out / "hf-adapter"), "lora": "adapter"}
        callbacks.append({"class_path": "gym_lightning.callbacks.HFExport", "init_args": adapter})
    trainer["callbacks"] = [*callbacks, *extra]
    config["data"].update(batch_size=4, eval_batch_size=16)
    for dotted, value in changes.items():
        section, _, key = dotted.rpartition(".")
        node = config
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[key] = value
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(f"# python -m gym_lightning fit --config {path.name}\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def shipped_recipe(name: str, out: Path, **sections: dict[str, Any]) -> Path:
    """``configs/<name>.yaml`` as shipped, run on CPU for 2 optimizer steps into ``out`` (no step checkpoints, the
    export under ``out/hf``), with ``sections`` updated (``model={"model": folder}``); written to ``out``."""
    config = yaml.safe_load((REPO_ROOT / "configs" / f"{name}.yaml").read_text())
    config["trainer"].update(accelerator="cpu", max_steps=2, default_root_dir=str(out), enable_checkpointing=False)
    callbacks = config["trainer"]["callbacks"]
    config["trainer"]["callbacks"] = [c for c in callbacks if "StepCheckpoint" not in c["class_path"]]
    config["export"]["output_dir"] = str(out / "hf")
    for section, values in sections.items():
        config[section].update(values)
    out.mkdir(parents=True)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _torchrun(entry: list[str], name: str, timeout: float, nproc: int = 2) -> subprocess.CompletedProcess:
    """``python ENTRY...`` on ``nproc`` local ranks as torchrun starts them (``helpers.dist.run_ranks``)."""
    try:
        return run_ranks(entry, timeout, nproc=nproc)
    except AssertionError as failed:
        raise AssertionError(f"`{name}` failed: {failed}") from None


def torchrun(args: list[str], timeout: float = 600, nproc: int = 2) -> subprocess.CompletedProcess:
    """``gym ARGS`` on ``nproc`` ranks as ``torchrun --nproc_per_node N -m gym_lightning ARGS`` starts them."""
    return _torchrun(["-m", "gym_lightning", *args], f"gym {' '.join(args)}", timeout, nproc)


def fit_in_one_launch(configs: list[Path], timeout: float = 900, nproc: int = 2) -> None:
    """``gym fit --config C`` for each of ``configs`` in turn, on ``nproc`` CPU ranks started once
    (``helpers.fit_worker``); raises with the output's tail if one fails."""
    worker = str(REPO_ROOT / "tests" / "helpers" / "fit_worker.py")
    _torchrun([worker, *map(str, configs)], f"gym fit series of {len(configs)} configs", timeout, nproc)


def gym_in_one_launch(runs: dict[str, list[str]], spec: Path, timeout: float = 900, nproc: int = 2) -> None:
    """``gym ARGV`` for each of ``runs`` (name -> argv) in turn, on ``nproc`` CPU ranks started once
    (``helpers.launch_worker``, its runs listed in the JSON file ``spec``); raises with the output's tail, which
    names each run that failed, if one fails."""
    spec.write_text(json.dumps([{"name": name, "argv": argv} for name, argv in runs.items()], indent=1))
    worker = str(REPO_ROOT / "tests" / "helpers" / "launch_worker.py")
    _torchrun([worker, str(spec)], f"gym series of {len(runs)} runs", timeout, nproc)


def cli_runs(outs: dict[tuple[str, bool], Path]) -> dict[tuple[str, bool], CliRun]:
    """Train each ``(strategy, lora)``'s shipped config (shortened) into its folder with ``gym fit``, all in one
    launch of 2 CPU ranks."""
    configs = {pair: run_config(pair[0], pair[1], out) for pair, out in outs.items()}
    fit_in_one_launch(list(configs.values()))
    return {pair: CliRun(outs[pair], config) for pair, config in configs.items()}


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files (one dict)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors in {folder}"
    return tensors
