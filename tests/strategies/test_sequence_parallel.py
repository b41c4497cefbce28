"""Sequence parallelism through the user's path: ``gym fit`` of the shipped YAMLs with
``sequence_parallel_size: 2`` on 2 CPU ranks, against one process on the whole sequences, then ``gym export``.

The runs train a tiny random Llama folder (4 query heads, 2 key/value heads: each rank takes one of each) on
documents of 40-250 tokens, in fp32 (``32-true``, ``torch_dtype: float32``) so that the comparison is tight. The
global batch is the same: one process with 2 rows x accumulate 2, and one group of 2 ranks (data-parallel degree
1) with 2 rows x accumulate 2, each rank holding half of every row. What is exact and what is not: the same
tokens meet the same weights, but attention is computed per rank for half the heads, the loss is summed in two
halves and the gradients are summed by the strategy's reduction, so float rounding moves the results (measured
below ``SAME_RUN``).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli_runs import fit_in_one_launch, shipped_recipe, tensors_of
from helpers.families import family_run_config, make_family_folder

from gym_lightning.cli import main

pytestmark = pytest.mark.slow
SP = "trainer.strategy.init_args.sequence_parallel_size"
FP32 = {
    "trainer.precision": "32-true",
    "model.torch_dtype": "float32",
    "model.lr": 3e-3,
    "trainer.max_steps": 3,
    "trainer.accumulate_grad_batches": 2,
    "data.batch_size": 2,
    "data.max_seq_length": 256,
    "data.format": "text",
    "data.dataset": None,
}
ONE_PROCESS = {"trainer.devices": 1, "trainer.strategy": "auto"}
# Long-sequence memory settings on top of SP: tiled MLP, chunked loss and activation checkpointing, all with tiles
# and chunks much shorter than the 128-token slices so that each runs several times per layer.
TILED = {"model.mlp_tile_tokens": 48, "model.loss_chunking": "on", "model.loss_chunk_tokens": 40}
# LoRA under gym_ddp, validating after every optimizer step: validation attends whole sequences with the model's
# own sdpa on every rank, training switches back to the exchange.
VALIDATING = {"data.val_split": 0.25, "trainer.limit_val_batches": 1.0, "trainer.val_check_interval": 2}
SAME_RUN = 2e-5  # fp32, summed in another order (measured: 5.6e-7 to 2.2e-6 on weights)
TEXT = "the of and to in is was for on that with as by at from his her they this which an be or had"


def _documents(path: Path, count: int = 24, seed: int = 0) -> Path:
    """``count`` text documents of 40-250 words (about as many tokens) in a jsonl file."""
    rng = random.Random(seed)
    lines = [json.dumps({"text": " ".join(rng.choices(TEXT.split(), k=rng.randint(40, 250)))}) for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sequence_parallel")
    folder = make_family_folder("llama", root / "llama")
    data = {**FP32, "data.train_files": str(_documents(root / "docs.jsonl"))}
    plain, packed = {**data, "data.packing": False}, {**data, "data.packing": True}
    names = ("one", "one_packed", "one_lora", "zero3", "gym_fsdp_packed", "zero3_tiled", "gym_ddp_lora", "recipe")
    names += ("ddp_dp2",)
    outs = {name: root / name for name in names}

    def run(strategy: str, name: str, lora: bool = False, **changes: Any) -> Path:
        return family_run_config("llama", strategy, lora, folder, outs[name], step_losses=True, **changes)

    one = [
        run("gym_ddp", "one", **plain, **ONE_PROCESS),
        run("gym_ddp", "one_packed", **packed, **ONE_PROCESS),
        run("gym_ddp", "one_lora", True, **plain, **VALIDATING, **ONE_PROCESS),
    ]
    fit_in_one_launch(one, nproc=1)
    two = [
        run("zero3", "zero3", **plain, **{SP: 2}),
        run("gym_fsdp", "gym_fsdp_packed", **packed, **{SP: 2}),
        run("zero3", "zero3_tiled", **packed, **TILED, **{SP: 2, "model.gradient_checkpointing": True}),
        run("gym_ddp", "gym_ddp_lora", True, **plain, **VALIDATING, **{SP: 2}),
    ]
    # configs/long_sequence.yaml as shipped, on CPU for 2 steps: packed rows of 2,048 tokens, 1,024 per rank.
    fit_in_one_launch([*two, shipped_recipe("long_sequence", outs["recipe"])])
    # 4 ranks: 2 groups of 2, each group a data-parallel rank with its own 2 rows (no accumulation): the same 4 rows
    # per step as one process with 2 rows x accumulate 2.
    dp2 = run("gym_ddp", "ddp_dp2", **{**plain, SP: 2, "trainer.devices": 4, "trainer.accumulate_grad_batches": 1})
    fit_in_one_launch([dp2], nproc=4)
    return {"folder": folder, **outs}


def test_the_shipped_long_sequence_recipe_trains_and_exports(runs: dict[str, Path]) -> None:
    exported = tensors_of(runs["recipe"] / "hf")
    assert exported and all(torch.isfinite(t.float()).all() for t in exported.values())


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("run", "reference"),
    [("zero3", "one"), ("gym_fsdp_packed", "one_packed"), ("zero3_tiled", "one_packed"), ("gym_ddp_lora", "one_lora")],
)
def test_two_ranks_sharing_each_sequence_train_the_weights_of_one_process(
    runs: dict[str, Path], run: str, reference: str
) -> None:
    trained, expected = tensors_of(runs[run] / "hf"), tensors_of(runs[reference] / "hf")
    start = tensors_of(runs["folder"])
    assert _max_difference(expected, {k: v.float() for k, v in start.items()}) > 100 * SAME_RUN  # it trained
    assert _max_difference(trained, expected) < SAME_RUN
    logits = torch.load(runs[run] / "logits.pt", weights_only=True)["end"]  # the trained model, attending whole
    reference_logits = torch.load(runs[reference] / "logits.pt", weights_only=True)["end"]
    assert (logits - reference_logits).abs().max().item() < 10 * SAME_RUN
    losses = torch.load(runs[run] / "losses.pt", weights_only=True)  # each micro-batch's share of its step's loss
    reference_losses = torch.load(runs[reference] / "losses.pt", weights_only=True)
    assert losses.shape == reference_losses.shape == (6,)  # 3 steps x 2 micro-batches
    torch.testing.assert_close(losses, reference_losses, rtol=SAME_RUN, atol=0.0)


def test_two_data_parallel_groups_of_two_ranks_train_the_weights_of_one_process(runs: dict[str, Path]) -> None:
    """Sequence and data parallelism together: 4 ranks (gym_ddp), the sampler deals rows to the 2 groups."""
    assert _max_difference(tensors_of(runs["ddp_dp2"] / "hf"), tensors_of(runs["one"] / "hf")) < SAME_RUN
    losses = torch.load(runs["ddp_dp2"] / "losses.pt", weights_only=True)  # one micro-batch per step
    per_step = torch.load(runs["one"] / "losses.pt", weights_only=True).reshape(3, 2).sum(dim=1)
    torch.testing.assert_close(losses, per_step, rtol=SAME_RUN, atol=0.0)


def _val_losses(run: Path) -> list[float]:
    rows = csv.DictReader((run / "lightning_logs" / "version_0" / "metrics.csv").open())
    return [float(row["val/loss"]) for row in rows if row.get("val/loss")]


def test_validation_between_steps_gives_the_losses_of_one_process(runs: dict[str, Path]) -> None:
    """Validation after every step runs whole sequences on every rank of the group, then training switches back to
    the exchange (the weights test above covers the training that follows)."""
    losses, expected = _val_losses(runs["gym_ddp_lora"]), _val_losses(runs["one_lora"])
    assert len(losses) == len(expected) == 3
    torch.testing.assert_close(losses, expected, rtol=SAME_RUN, atol=0.0)


def test_packing_changes_what_is_trained(runs: dict[str, Path]) -> None:
    """The packed and unpacked references differ, so the packed comparisons test document boundaries."""
    assert _max_difference(tensors_of(runs["one"] / "hf"), tensors_of(runs["one_packed"] / "hf")) > 100 * SAME_RUN


def test_gym_export_of_a_sequence_parallel_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    """The user's next command: ``gym export`` of the zero3 SP run's last checkpoint gives its end-of-fit folder."""
    checkpoint = sorted((runs["zero3"] / "checkpoints").glob("*"))[-1]
    out = tmp_path / "hf"
    main(["export", "--checkpoint", str(checkpoint), "--output_dir", str(out), "--dtype", "float32"])
    assert _max_difference(tensors_of(out), tensors_of(runs["zero3"] / "hf")) == 0.0
