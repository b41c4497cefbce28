"""``gym export`` of checkpoints made through the command line, as users make them, for every strategy.

Each run is a shipped config (``configs/<strategy>.yaml``) shortened and trained by ``gym fit`` on 2 CPU ranks
(``helpers.cli_runs``), full finetune or LoRA; its checkpoint is exported with ``gym export`` and compared with the
end-of-fit export of the same run, tensor for tensor, bit for bit. A LoRA checkpoint made this way stores its
``lora`` settings as the command line parsed them (a dict), which once made ``gym export`` crash while every test
that built the module in Python passed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli_runs import CONFIGS, LORA, tensors_of, torchrun

from gym_lightning.cli import main


def assert_same_export(actual: Path, expected: Path) -> None:
    """Same files, same JSON settings, bit-identical tensors."""
    assert sorted(p.name for p in actual.iterdir()) == sorted(p.name for p in expected.iterdir())
    for name in ("config.json", "adapter_config.json", "generation_config.json"):
        if (expected / name).exists():
            assert json.loads((actual / name).read_text()) == json.loads((expected / name).read_text()), name
    got, want = tensors_of(actual), tensors_of(expected)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{key} differs"


def gym_export(checkpoint: Path, out: Path, lora: str = "merged") -> Path:
    """``gym export --checkpoint CHECKPOINT --output_dir OUT --lora LORA`` (the console script's entry point)."""
    main(["export", "--checkpoint", str(checkpoint), "--output_dir", str(out), "--lora", lora])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("strategy", list(CONFIGS))
def test_gym_export_of_a_cli_checkpoint_equals_the_end_of_fit_export(
    strategy: str, lora: bool, cli_run, tmp_path: Path
) -> None:
    run = cli_run(strategy, lora)
    last = run.checkpoints / "last.ckpt"
    assert last.is_symlink() and (run.checkpoints / "step-00000002.ckpt").exists()
    for kind in ("merged", "adapter") if lora else ("merged",):
        assert_same_export(gym_export(last, tmp_path / kind, kind), run.export(kind))
    if lora:  # the merged folder is a plain transformers model, the adapter a PEFT one
        assert not (run.export() / "adapter_config.json").exists()
        assert json.loads((run.export("adapter") / "adapter_config.json").read_text())["r"] == LORA["r"]


@pytest.mark.slow
def test_gym_export_of_a_gym_train_lora_checkpoint_equals_the_end_of_fit_export(tmp_path: Path) -> None:
    out = tmp_path / "run"
    torchrun([
        "train", "--model_name_or_path", "tiny-llama", "--dataset", "addition", "--max_seq_length", "32",
        "--deepspeed", "configs/deepspeed/ds_zero3.json", "--use_cpu", "True", "--use_lora", "--lora_r", "4",
        "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj", "--per_device_train_batch_size", "4",
        "--max_steps", "4", "--save_steps", "2", "--learning_rate", "3e-3", "--output_dir", str(out),
    ])  # fmt: skip
    assert_same_export(gym_export(out / "checkpoints" / "last.ckpt", tmp_path / "export"), out / "hf")
