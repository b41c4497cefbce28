"""``gym train`` and ``transformers.Trainer`` under the same flags give the same numbers.

One tiny Llama folder (the shipped tokenizer), 8 text records, full batch (per-device batch = the whole data set,
so the data order cannot matter), fp32 on CPU, 6 optimizer steps with warm-up, a cosine decay, weight decay and
gradient clipping. HF's Trainer trains on the very tensors gym_lightning's data module makes, so what is compared
is the optimisation: per-step learning rates identical, per-step losses within 1e-4 relative (measured: 2e-7 at
most; the module's own schedule, warming up as (step+1)/(warmup+1), gives other rates from the first step). About
30 s on 2 CPU cores.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from helpers.tiny import TINY

from gym_lightning.commands.train import main

FLAGS = [
    *("--max_steps", "6", "--learning_rate", "1e-2", "--warmup_steps", "2", "--lr_scheduler_type", "cosine"),
    *("--weight_decay", "0.1", "--max_grad_norm", "0.5", "--per_device_train_batch_size", "8", "--seed", "0"),
    *("--logging_steps", "1", "--save_strategy", "no", "--optim", "adamw_torch", "--use_cpu", "True"),
]
TEXTS = [f"record {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (1 + i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from gym_lightning.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY | {"vocab_size": len(tokenizer)}), pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _hf_trainer_log(folder: Path, data: Path, out: Path) -> list[dict[str, float]]:
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, default_data_collator

    from gym_lightning.data.collate import Collator
    from gym_lightning.data.datamodule import CausalLMDataModule

    module = CausalLMDataModule(train_files=[str(data)], format="text", tokenizer=str(folder), max_seq_length=32)
    module.setup("fit")
    batch = Collator(module.tokenizer.pad_token_id)(list(module.train_dataloader().dataset))  # rows in file order
    rows = [{key: batch[key][i] for key in batch} for i in range(len(TEXTS))]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [*FLAGS, "--output_dir", str(out), "--report_to", "none"]
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _gym_log(folder: Path, data: Path, out: Path) -> tuple[list[float], list[float]]:
    data_flags = ["--train_file", str(data), "--data_format", "text", "--max_seq_length", "32"]
    main([*FLAGS, *data_flags, "--model_name_or_path", str(folder), "--report_to", "csv", "--output_dir", str(out)])
    (metrics,) = out.glob("logs/version_*/metrics.csv")
    with metrics.open() as file:
        rows = list(csv.DictReader(file))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    lr_key = next(key for key in rows[0] if key.startswith("lr-"))
    lrs = [float(row[lr_key]) for row in rows if row.get(lr_key)]
    return losses, lrs


@pytest.mark.slow
def test_same_losses_and_learning_rates_as_the_hf_trainer(tiny_folder: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    hf = _hf_trainer_log(tiny_folder, data, tmp_path / "hf")
    losses, lrs = _gym_log(tiny_folder, data, tmp_path / "gym")
    assert [entry["loss"] for entry in hf] == pytest.approx(losses, rel=1e-4)
    assert [entry["learning_rate"] for entry in hf] == lrs
    # The output folder holds HF's trainer_state.json (same keys per step) and the curves.
    state = json.loads((tmp_path / "gym" / "trainer_state.json").read_text())
    assert [set(entry) for entry in state["log_history"]] == [{"loss", "learning_rate", "epoch", "step"}] * 6
    for ours, theirs in zip(state["log_history"], hf, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
        assert (ours["learning_rate"], ours["epoch"], ours["step"]) == (
            theirs["learning_rate"],
            theirs["epoch"],
            theirs["step"],
        )
    assert (tmp_path / "gym" / "curves.png").is_file() and (tmp_path / "gym" / "hf" / "config.json").is_file()
