"""What a preference run's user looks at: TRL's metric names in ``trainer_state.json``'s log history (``rewards/...``
at the logging steps, ``eval_rewards/...`` per validation, as TRL's trainers write them), in the CSV and TensorBoard
logs and on the progress bar, which reads them with the loss only at the logging steps, in one host copy."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from benchmarks.common.host_syncs import HostSyncCounter, count_training_batches, counting_host_syncs
from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.callbacks import GymProgressBar
from gym_lightning.callbacks.curves import PREFERENCE_METRICS, Curves, Series
from gym_lightning.callbacks.progress import host_values
from gym_lightning.callbacks.trainer_state import log_history

# What gym_lightning.objectives.DPO logs, and TRL 1.16's DPOTrainer writes among its log_history keys.
DPO_NAMES = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected"]  # fmt: skip
PAIRS = [  # prompt, chosen, rejected
    ("How do I reset my password?", " Open Settings, then Account, then Reset.", " Figure it out."),
    ("Where is my order?", " It ships tomorrow; here is the tracking link.", " No idea."),
    ("Can I change my address?", " Yes: Profile, then Address, then Save.", " Not my problem."),
    ("How do I cancel my plan?", " Go to Billing and choose Cancel plan.", " Read the manual."),
] * 2


def test_log_history_carries_the_step_metrics_under_trl_s_names() -> None:
    curves = Curves(
        steps=[1, 2],
        loss=[0.7, 0.6],
        lr=[1e-3, 5e-4],
        val_steps=[2],
        val_loss=[0.65],
        metrics={"rewards/margins": Series([2], [0.3]), "rewards/accuracies": Series([2], [0.75])},
        val_metrics={"rewards/margins": Series([2], [0.2]), "rewards/accuracies": Series([2], [0.5])},
    )
    assert log_history(curves, steps_per_epoch=4) == [
        {"loss": 0.7, "learning_rate": 1e-3, "epoch": 0.25, "step": 1},  # not a logging step: no metrics
        {
            "loss": 0.6,
            "learning_rate": 5e-4,
            "rewards/margins": 0.3,
            "rewards/accuracies": 0.75,
            "epoch": 0.5,
            "step": 2,
        },
        {"eval_loss": 0.65, "eval_rewards/margins": 0.2, "eval_rewards/accuracies": 0.5, "epoch": 0.5, "step": 2},
    ]


def test_host_values_reads_every_key_with_one_copy() -> None:
    metrics = {"train/loss": torch.tensor(0.7), "rewards/margins": torch.tensor(0.25), "other": torch.tensor(1.0)}
    counter = HostSyncCounter(counting=True)
    with counting_host_syncs(counter):
        values = host_values(metrics, ["train/loss", "rewards/margins", "rewards/accuracies"])
    assert values == pytest.approx({"train/loss": 0.7, "rewards/margins": 0.25})  # a key not logged is left out
    assert [event.op for event in counter.events] == ["Tensor.tolist"]  # one sync on CUDA, not one .item() per key


STEPS, LOG_EVERY, VAL_EVERY = 6, 3, 3


def dpo_config(root: Path) -> Path:
    """A ``gym fit`` YAML of a DPO run on ``PAIRS`` (tiny-llama, 4 pairs per step), logging every ``LOG_EVERY``
    steps, validating once, with the ``trainer_state.json`` callback that ``gym train`` adds."""
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": STEPS, "log_every_n_steps": LOG_EVERY,
            "val_check_interval": VAL_EVERY, "limit_val_batches": 1, "num_sanity_val_steps": 0,
            "enable_checkpointing": False, "default_root_dir": str(root / "run"),
            "callbacks": [{"class_path": "gym_lightning.callbacks.TrainerStateCallback",
                           "init_args": {"output_dir": str(root / "out")}}],
        },
        "model": {"model": "tiny-llama", "lr": 3e-3, "scheduler": "constant",
                  "objective": {"class_path": "gym_lightning.objectives.DPO", "init_args": {"beta": 0.1}}},
        "data": {"train_files": str(data), "val_files": str(data), "format": "auto", "batch_size": 2,
                 "eval_batch_size": 8},
    }  # fmt: skip
    path = root / "dpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_fit(config: Path, counter: HostSyncCounter) -> pl.Trainer:
    """``gym fit --config config`` in this process, its training batches' host syncs counted; the Trainer."""
    from gym_lightning.cli import GymCLI
    from gym_lightning.patches import apply_patches

    apply_patches()
    undo = count_training_batches(counter)
    try:
        with counting_host_syncs(counter):
            cli = GymCLI(CausalLMModule, CausalLMDataModule, args=["fit", "--config", str(config)])
    finally:
        undo()
    return cli.trainer


def csv_rows(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv") as file:
        return list(csv.DictReader(file))


def callback_syncs(counter: HostSyncCounter, steps: set[int]) -> list[str]:
    """The syncs in ``steps`` (global step before the step) made from gym_lightning's callbacks."""
    return [
        f"{e.op} @ {' <- '.join(reversed(e.chain[-4:]))}"
        for e in counter.events
        if e.step in steps and any("gym_lightning/callbacks/" in frame for frame in e.chain)
    ]


def test_a_dpo_fit_reports_trl_s_names_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["gym"])  # LightningCLI warns when pytest's own arguments are there too
    counter = HostSyncCounter()
    trainer = run_fit(dpo_config(tmp_path), counter)
    log_dir = Path(trainer.log_dir)

    # trainer_state.json: the logging steps' entries carry TRL's names, the validation entry eval_<name>
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    logging_steps = [entry["step"] for entry in history if "rewards/margins" in entry]
    assert logging_steps == [LOG_EVERY, 2 * LOG_EVERY]
    for entry in history:
        if entry["step"] in logging_steps and "loss" in entry:
            assert list(entry) == ["loss", "learning_rate", *DPO_NAMES, "epoch", "step"]
    evaluation = [entry for entry in history if "eval_loss" in entry]
    assert [list(entry) for entry in evaluation] == [["eval_loss", *[f"eval_{n}" for n in DPO_NAMES], "epoch", "step"]]

    # the loggers: the same values under the same names (Lightning's CSV step is the step index, HF's step - 1)
    rows = {int(row["step"]): row for row in csv_rows(log_dir) if row.get("rewards/margins")}
    assert sorted(rows) == [step - 1 for step in logging_steps]
    for entry in history:
        if entry["step"] in logging_steps and "loss" in entry:
            logged = {name: float(rows[entry["step"] - 1][name]) for name in DPO_NAMES}
            assert logged == pytest.approx({name: entry[name] for name in DPO_NAMES}, abs=1e-6)
    val_row = next(row for row in csv_rows(log_dir) if row.get("val/rewards/margins"))
    assert float(val_row["val/rewards/margins"]) == pytest.approx(evaluation[0]["eval_rewards/margins"], abs=1e-6)
    assert {*DPO_NAMES, *[f"val/{n}" for n in DPO_NAMES]} <= tensorboard_tags(log_dir)

    # the progress bar: the loss, the margin and the accuracy of the last logging step
    bar = next(callback for callback in trainer.callbacks if isinstance(callback, GymProgressBar))
    shown = bar.get_metrics(trainer, trainer.lightning_module)
    last = rows[2 * LOG_EVERY - 1]
    assert {key: shown[key] for key in ("rewards/margins", "rewards/accuracies")} == pytest.approx(
        {key: float(last[key]) for key in ("rewards/margins", "rewards/accuracies")}, abs=1e-6
    )
    assert {"train/loss", *PREFERENCE_METRICS} & set(shown) == {"train/loss", "rewards/margins", "rewards/accuracies"}

    # host syncs: none from the callbacks on a quiet step, one read of all the bar's values per logging step
    reads = {0, *(step - 1 for step in logging_steps)}  # the bar's first read, then the logging steps
    quiet = set(range(STEPS)) - reads
    assert callback_syncs(counter, quiet) == []
    assert len(callback_syncs(counter, reads)) == len(reads), callback_syncs(counter, reads)


def tensorboard_tags(log_dir: Path) -> set[str]:
    """The scalar tags of the TensorBoard event files in ``log_dir``."""
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = accumulator_module.EventAccumulator(str(log_dir))
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


def test_log_history_keys_are_the_ones_trl_s_dpo_trainer_writes(tmp_path: Path) -> None:
    """TRL 1.16's DPOTrainer, one logged step and one evaluation on a tiny model: its log history's reward and
    log-probability keys are the ones ``log_history`` writes for what gym's DPO logs (train and eval)."""
    pytest.importorskip("trl")
    trl_history = trl_dpo_log_history(tmp_path)
    trl_train = {key for key in trl_history[0] if key.startswith(("rewards/", "logps/"))}
    trl_eval = {key for entry in trl_history if "eval_loss" in entry for key in entry}
    series = Series([1], [0.0])
    curves = Curves(steps=[1], loss=[0.7], lr=[1e-3], val_steps=[1], val_loss=[0.7],
                    metrics=dict.fromkeys(DPO_NAMES, series), val_metrics=dict.fromkeys(DPO_NAMES, series))  # fmt: skip
    ours = log_history(curves, steps_per_epoch=1)
    assert {key for key in ours[0] if "/" in key} == trl_train == set(DPO_NAMES)
    assert set(ours[1]) - {"epoch", "step"} <= trl_eval
    assert {key for key in trl_eval if key.startswith(("eval_rewards/", "eval_logps/"))} == {
        key for key in ours[1] if "/" in key
    }
    assert {"loss", "learning_rate", "epoch", "step"} <= set(trl_history[0]) and {"epoch", "step"} <= trl_eval


def trl_dpo_log_history(root: Path) -> list[dict[str, Any]]:
    """``state.log_history`` of TRL's DPOTrainer after one step (logged) and one evaluation, on tiny-llama."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from gym_lightning.models.loading import build_causal_lm
    from gym_lightning.tokenizer import load_tokenizer

    folder = root / "policy"
    torch.manual_seed(0)
    build_causal_lm("tiny-llama").save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS[:4]])
    args = DPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                     max_steps=1, logging_steps=1, eval_strategy="steps", eval_steps=1, report_to="none",
                     use_cpu=True, bf16=False, save_strategy="no")  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(folder)
    trainer = DPOTrainer(model=str(folder), ref_model=reference, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "train_runtime" not in entry]
