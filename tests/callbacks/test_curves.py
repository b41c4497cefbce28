"""CurvesCallback: one loss and one lr per optimizer step, validation losses, a valid curves.png in the log folder;
a preference run's step metrics recorded without a host sync per step, and its margins and accuracies drawn beside the
loss while an SFT run's figure stays as it was."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.tiny import TINY

from benchmarks.common.host_syncs import HostSyncCounter, counting_host_syncs
from gym_lightning import CausalLMDataModule, CausalLMModule, CurvesCallback
from gym_lightning.callbacks.curves import CurveRecorder, Curves, Series, curves_figure, plot_curves
from gym_lightning.errors import GymUserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fit_with_curves(root: Path, max_steps: int, accumulation: int, flush_every: int) -> CurvesCallback:
    pl.seed_everything(3)
    module = CausalLMModule("tiny-llama", config_overrides=TINY, lr=1e-3, scheduler="linear", warmup_steps=2)
    data = CausalLMDataModule(dataset="addition", batch_size=8, eval_batch_size=16)
    curves = CurvesCallback(flush_every_n_steps=flush_every)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulation,
        val_check_interval=2 * accumulation, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[curves],
        logger=pl.loggers.CSVLogger(root), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, data)
    return curves


def test_fit_writes_a_png_with_one_point_per_optimizer_step(tmp_path: Path) -> None:
    callback = fit_with_curves(tmp_path, max_steps=5, accumulation=2, flush_every=2)
    assert callback.path == tmp_path / "lightning_logs" / "version_0" / "curves.png"
    assert callback.path.read_bytes()[:8] == PNG_SIGNATURE
    assert not list(callback.path.parent.glob(".*tmp*"))  # the temporary file was renamed into place
    curves = callback.recorder.curves
    assert curves.steps == [1, 2, 3, 4, 5]  # 10 micro-batches, 5 optimizer steps
    assert len(curves.loss) == 5 and all(math.isfinite(loss) for loss in curves.loss)
    # linear schedule, 2 warm-up steps of 5: the lr each step ran at rises, then falls
    assert curves.lr[0] < curves.lr[1] and curves.lr[1] > curves.lr[-1] > 0
    assert curves.val_steps == [2, 4]  # the sanity check is not recorded
    assert curves.metrics == {} and curves.val_metrics == {}  # an SFT run logs no preference metric


def test_step_loss_is_the_mean_of_its_micro_batches() -> None:
    recorder = CurveRecorder(flush_every=100)
    for loss in (1.0, 3.0):
        recorder.add_micro_batch(torch.tensor(loss))
    recorder.end_step(1, lr=0.5)
    recorder.add_micro_batch(torch.tensor(4.0))
    recorder.end_step(2, lr=0.25)
    assert recorder.curves.loss == []  # still on the device: nothing copied before a flush
    recorder.flush()
    assert recorder.curves == Curves(steps=[1, 2], loss=[2.0, 4.0], lr=[0.5, 0.25])


def test_plot_without_validation_and_bad_flush_interval(tmp_path: Path) -> None:
    path = plot_curves(Curves(steps=[1, 2, 3], loss=[3.0, 2.0, 1.5], lr=[1e-3, 1e-3, 5e-4]), tmp_path / "c.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(GymUserError, match="flush_every_n_steps=0"):
        CurvesCallback(flush_every_n_steps=0)


def test_step_metrics_stay_on_the_device_until_the_flush_that_copies_everything_once() -> None:
    recorder = CurveRecorder(flush_every=100)
    counter = HostSyncCounter(counting=True)
    device = torch.device("cpu")  # the census takes a torch.device argument for the compute device (a GPU's)
    with counting_host_syncs(counter):
        for step in (1, 2, 3):
            recorder.add_micro_batch(torch.tensor(float(step), device=device))
            recorder.end_step(step, lr=0.1)
            if step != 2:  # a logging step: the loggers' values of this step
                metrics = {
                    "rewards/margins": torch.tensor(0.5 * step, device=device),
                    "rewards/accuracies": torch.tensor(1.0, device=device),
                }
                recorder.add_metrics(step, metrics)
        assert [event for event in counter.events if event.kind != "host->device"] == []
        recorder.flush()
    reads = [event.op for event in counter.events if event.kind != "host->device"]
    assert reads == ["Tensor.tolist"]  # one copy for the losses and the metrics
    assert recorder.curves.loss == [1.0, 2.0, 3.0]
    assert recorder.curves.metrics == {
        "rewards/margins": Series(steps=[1, 3], values=[0.5, 1.5]),
        "rewards/accuracies": Series(steps=[1, 3], values=[1.0, 1.0]),
    }
    recorder.add_validation(3, 0.6, {"rewards/margins": 0.25})
    assert recorder.curves.val_metrics == {"rewards/margins": Series(steps=[3], values=[0.25])}


SFT_CURVES = {
    "steps": [1, 2, 3],
    "loss": [3.0, 2.0, 1.5],
    "lr": [1e-3, 1e-3, 5e-4],
    "val_steps": [2],
    "val_loss": [2.1],
}


def visible_axes(curves: Curves) -> list[tuple[str, list[str]]]:
    """``(y label, legend texts)`` of each visible panel, top to bottom, left column first."""
    figure = curves_figure(curves)
    panels = sorted(
        (a for a in figure.axes if a.get_visible()), key=lambda a: (a.get_position().x0, -a.get_position().y0)
    )
    legends = [[t.get_text() for t in a.get_legend().get_texts()] if a.get_legend() else [] for a in panels]
    return [(a.get_ylabel(), legend) for a, legend in zip(panels, legends, strict=True)]


def test_an_sft_run_s_figure_is_the_loss_over_the_learning_rate_as_before(tmp_path: Path) -> None:
    figure = curves_figure(Curves(**SFT_CURVES))
    assert tuple(figure.get_size_inches()) == (7, 6)
    assert visible_axes(Curves(**SFT_CURVES)) == [("loss", ["train loss", "validation loss"]), ("learning rate", [])]
    png = plot_curves(Curves(**SFT_CURVES), tmp_path / "sft.png").read_bytes()
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (700, 600)  # IHDR: w, h


def test_a_preference_run_s_margins_and_accuracies_are_drawn_beside_the_loss() -> None:
    margins, accuracies = Series([1, 3], [0.1, 0.9]), Series([1, 3], [0.5, 1.0])
    metrics = {"rewards/margins": margins, "rewards/accuracies": accuracies, "logps/chosen": Series([1], [-9.0])}
    curves = Curves(**SFT_CURVES, metrics=metrics, val_metrics={"rewards/margins": Series([2], [0.4])})
    assert visible_axes(curves) == [
        ("loss", ["train loss", "validation loss"]),
        ("learning rate", []),
        ("reward margin", ["train rewards/margins", "validation rewards/margins"]),
        ("reward accuracy", ["train rewards/accuracies"]),
    ]
    figure = curves_figure(curves)
    margin_axes = next(a for a in figure.axes if a.get_ylabel() == "reward margin")
    assert [list(line.get_ydata()) for line in margin_axes.lines[:2]] == [[0.1, 0.9], [0.4]]
    # KTO logs a margin but no accuracy: one panel beside the loss, the empty one hidden
    kto = Curves(**SFT_CURVES, metrics={"rewards/margins": margins, "kl": Series([1], [0.0])})
    assert [label for label, _ in visible_axes(kto)] == ["loss", "learning rate", "reward margin"]
