"""A checkpoint resumed on another number of ranks continues as if the run had never changed: 2 -> 1 and 1 -> 2.

This file is also the worker: ``python tests/checkpointing/test_world_size.py SPEC.json`` runs one list of phases
in one set of processes (``helpers.dist.run_ranks`` starts as many as the phases' devices).

Scenario (the data and model of checkpointing/test_resume.py): 24 prompt/completion pairs, 2 samples per rank and
micro-batch, the same global batch of 8 samples on both layouts (2 ranks x accumulate 2, or 1 rank x accumulate 4), 3
optimizer steps per epoch, 2 epochs, AdamW with weight decay and a linear schedule; a checkpoint after every optimizer
step. The step-4 checkpoint is taken one step into epoch 1 (mid-epoch). ``full2``/``full1`` train uninterrupted on 2
ranks / 1 rank; ``resume1`` continues ``full2``'s step-4 checkpoint on 1 rank, ``resume2`` ``full1``'s on 2 ranks. All
strategies' runs share three launches (a process-group start costs more than a run). ZeRO checkpoints are converted to
DeepSpeed universal checkpoints for that (``strategies.zero.universal``), FSDP's torch distributed checkpoints reshard
on load.

What is exact and what is not: every optimizer step sees the same samples on both layouts (the data order is dealt
out to the ranks from one permutation, and the position is kept as samples consumed, ``data.loader``); the step's
loss and gradient are the same sums taken in another order (an all-reduce of 2 partial sums, or one process's
sum), so losses and weights agree to fp32 rounding: measured here below 1e-6 on losses and 2e-6 on weights after
two more AdamW steps. Random states (dropout; none in this model) continue only on the same number of ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_resume import assert_same_weights

STRATEGIES = ["gym_fsdp", "zero1", "zero2", "zero3"]
GLOBAL_BATCH_RANKS = {2: 2, 1: 4}  # ranks -> accumulation for the same global batch of 8
LOSS_ATOL, WEIGHT_ATOL = 5e-6, 2e-5


# ------------------------------------------------------------------------------------------------------ worker
class StepLosses(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """The loss of each optimizer step over all ranks: the sum over the step's micro-batches of their outputs'
    mean over ranks (each rank's output is its summed token loss x ranks / the step's tokens: the module undoes the
    strategies' mean over ranks, Lightning divides by the accumulation count it multiplied in)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._step: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._step.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))
        if len(self._step) == trainer.accumulate_grad_batches:
            self.losses.append(sum(self._step))
            self._step = []


def run_phase(spec: dict[str, Any], phase: dict[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl
    from test_resume import build_strategy, save_final_weights, seeded_module_and_data

    from gym_lightning.checkpointing import StepCheckpoint

    out = Path(spec["out"])
    module, data = seeded_module_and_data(spec)
    recorder = StepLosses()
    callbacks = [recorder, StepCheckpoint(dirpath=out / f"{phase['name']}-ckpt", every_n_steps=1, keep_last=-1)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=phase["devices"], strategy=build_strategy(spec["strategy"]),
        precision="32-true", max_epochs=2, accumulate_grad_batches=GLOBAL_BATCH_RANKS[phase["devices"]],
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=phase.get("resume_from"))
    save_final_weights(trainer, module, out / f"{phase['name']}.pt")
    return {"losses": recorder.losses, "global_step": trainer.global_step}


def worker_main(spec_path: str) -> None:
    """Run each of the spec's ``runs`` (a strategy, its folder, its phases) one after the other in these processes."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    for run in spec["runs"]:
        results = {phase["name"]: run_phase(run, phase) for phase in run["phases"]}
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            (Path(run["out"]) / f"results-{spec['launch']}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------------ tests
def launch(out: Path, name: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One set of processes (as many ranks as the runs' phases ask devices) for ``runs``; their results."""
    from helpers.dist import run_ranks

    path = out / f"spec-{name}.json"
    path.write_text(json.dumps({"launch": name, "runs": runs}))
    (devices,) = {phase["devices"] for run in runs for phase in run["phases"]}
    run_ranks([__file__, str(path)], timeout=900, nproc=devices)
    return [json.loads((Path(run["out"]) / f"results-{name}.json").read_text()) for run in runs]


STEP4 = "step-00000004.ckpt"


@pytest.fixture(scope="module")
def layouts(pretrained: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every strategy's four runs in three launches (one process-group start each, all strategies in it): 1 rank
    trains ``full1``; 2 ranks train ``full2`` and resume ``full1``'s step-4 checkpoint (``resume2``); 1 rank resumes
    ``full2``'s (``resume1``)."""
    model_dir, train_file = pretrained
    outs = {name: tmp_path_factory.mktemp(f"layouts-{name}") for name in STRATEGIES}
    base = {name: {"strategy": name, "out": str(out), "model_dir": str(model_dir), "train_file": str(train_file)}
            for name, out in outs.items()}  # fmt: skip
    scratch = tmp_path_factory.mktemp("layouts")

    def runs(*phases: Any) -> list[dict[str, Any]]:
        return [{**base[name], "phases": [phase(outs[name]) for phase in phases]} for name in STRATEGIES]

    one = launch(scratch, "one", runs(lambda out: {"name": "full1", "devices": 1}))
    two = launch(scratch, "two", runs(
        lambda out: {"name": "full2", "devices": 2},
        lambda out: {"name": "resume2", "devices": 2, "resume_from": str(out / "full1-ckpt" / STEP4)},
    ))  # fmt: skip
    back = launch(scratch, "back", runs(
        lambda out: {"name": "resume1", "devices": 1, "resume_from": str(out / "full2-ckpt" / STEP4)},
    ))  # fmt: skip
    return {name: {"out": outs[name], **a, **b, **c} for name, a, b, c in zip(STRATEGIES, one, two, back, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_resumes_on_another_number_of_ranks_as_if_nothing_changed(
    strategy: str, layouts: dict[str, dict[str, Any]]
) -> None:
    results = layouts[strategy]
    out = results["out"]
    full2, full1 = results["full2"], results["full1"]
    assert len(full2["losses"]) == len(full1["losses"]) == 6, "3 optimizer steps per epoch on both layouts"
    torch.testing.assert_close(full1["losses"], full2["losses"], rtol=0, atol=LOSS_ATOL)
    for name in ("resume1", "resume2"):
        result = results[name]
        assert result["global_step"] == 6 and len(result["losses"]) == 2, f"{name}: steps 5 and 6 only"
        torch.testing.assert_close(result["losses"], full2["losses"][4:], rtol=0, atol=LOSS_ATOL, msg=name)
        assert_same_weights(torch.load(out / f"{name}.pt"), torch.load(out / "full2.pt"), WEIGHT_ATOL)
    if strategy.startswith("zero"):  # converted once, into the checkpoint it came from
        assert (out / "full2-ckpt" / STEP4 / "universal").is_dir()
        assert (out / "full1-ckpt" / STEP4 / "universal").is_dir()


if __name__ == "__main__":
    worker_main(sys.argv[1])
