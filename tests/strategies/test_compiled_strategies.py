"""The fast path's per-layer compilation under the sharding strategies, on 2 real CPU ranks: gym_fsdp (FSDP2's
unshard and activation-checkpointing hooks around each compiled layer) and ZeRO-3 (decoder layers as DeepSpeed leaf
modules, so no gather hook runs inside a compiled layer) train as their eager runs do, and the layers really are
compiled; gym_ddp (DDP's reducer, dynamo's DDP optimizer) runs each compiled layer as one graph."""

from __future__ import annotations

import json
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


# A decoder layer of 1.75 MiB of fp32 gradients: over the 1 MiB first bucket that dynamo's DDP optimizer cuts each
# graph at (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), so a split shows; the presets' layers (0.85 MiB) never
# split. Two layers, 2 steps, aot_eager (no code generation: the split happens before the backend).
SPLITTABLE = {"hidden_size": 128, "intermediate_size": 1024, "num_hidden_layers": 2}


def test_gym_ddp_runs_each_compiled_layer_as_one_graph(tmp_path: Path) -> None:
    """gym_ddp + ``model.compile`` at world size 2: each decoder layer runs as one graph (``compile.ddp_buckets``
    false, the default), where dynamo's DDP optimizer (torch's default, and ``ddp_buckets: true``) splits it at DDP's
    bucket boundaries (``benchmarks.common.ddp_graphs`` counts the graphs the backend compiles for a layer)."""
    paths = {}
    for buckets in (False, True):
        run = tmp_path / f"buckets-{buckets}"
        probe = {
            "class_path": "benchmarks.common.ddp_graphs.GraphsPerLayerProbe",
            "init_args": {"path": str(run / "graphs")},
        }
        compile_args = {"backend": "counting_aot_eager", "ddp_buckets": buckets}
        settings = {"trainer.precision": "32-true", "trainer.max_steps": 2, "model.compile": compile_args,
                    "model.config_overrides": SPLITTABLE}  # fmt: skip
        paths[buckets] = run_config("gym_ddp", False, run, callbacks=[probe], checkpoints=False, **settings)
    fit_in_one_launch([paths[False], paths[True]])
    for rank in (0, 1):
        one, split = (json.loads((tmp_path / f"buckets-{b}" / f"graphs.{rank}").read_text()) for b in (False, True))
        assert one["graphs"] > 0 and set(one["pieces"]) == {1}, one  # compiled, one graph per layer
        assert split["graphs"] > 0 and max(split["pieces"]) > 1, split  # the probe sees a split where there is one
