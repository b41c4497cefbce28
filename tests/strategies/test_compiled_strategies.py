"""The fast path's per-layer compilation under the sharding strategies, on 2 real CPU ranks: gym_fsdp (FSDP2's
unshard and activation-checkpointing hooks around each compiled layer) and ZeRO-3 (decoder layers as DeepSpeed leaf
modules, so no gather hook runs inside a compiled layer) train as their eager runs do, and the layers really are
compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli_runs import fit_in_one_launch, run_config

pytestmark = pytest.mark.slow


def configs(strategy: str, out: Path) -> dict[bool, Path]:
    paths = {}
    for compiled in (False, True):
        run = out / ("compiled" if compiled else "eager")
        probes = [
            {"class_path": "helpers.families.StepLossProbe", "init_args": {"path": str(run / "losses.pt")}},
            {"class_path": "helpers.compiled_probe.GraphCountProbe", "init_args": {"path": str(run / "graphs")}},
        ]
        settings = {"trainer.precision": "32-true", "trainer.max_steps": 3, "model.compile": compiled}
        if strategy == "gym_fsdp":  # FSDP2's composable checkpointing: its hooks around each compiled layer too
            settings["trainer.strategy.init_args.activation_checkpointing"] = True
        paths[compiled] = run_config(strategy, False, run, callbacks=probes, checkpoints=False, **settings)
    return paths


@pytest.mark.parametrize("strategy", ["gym_fsdp", "zero3"])
def test_compiled_layers_train_as_eager_under_sharding(strategy: str, tmp_path: Path) -> None:
    paths = configs(strategy, tmp_path)
    fit_in_one_launch([paths[False], paths[True]])  # eager first: its ranks compile nothing
    eager, compiled = (torch.load(tmp_path / name / "losses.pt") for name in ("eager", "compiled"))
    # fp32: inductor's kernels reorder sums (~1e-7 relative), the ranks' reductions are the same.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    for rank in (0, 1):
        assert torch.load(tmp_path / "eager" / f"graphs.{rank}") == [0, 0, 0]
        graphs = torch.load(tmp_path / "compiled" / f"graphs.{rank}")
        assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs  # compiled on the first step, never again
