"""How many graphs each compiled decoder layer runs as: dynamo's graphs and the pieces its backend compiled.

Importing this module registers the dynamo backends ``counting_aot_eager`` and ``counting_inductor``: each delegates
to the backend of its suffix and records every graph it is handed. Without splitting the backend is handed each of
dynamo's graphs once; dynamo's DDP optimizer (``torch._dynamo.config.optimize_ddp = "ddp_optimizer"``, torch's
default, active while a ``DistributedDataParallel`` forward runs) splits a graph at DDP's bucket boundaries and hands
the backend each piece. gym compiles the decoder layers' forward (one code object for every layer), so pieces per
dynamo graph = graphs per decoder layer. ``GraphsPerLayerProbe`` writes both counts per rank at the end of a fit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch._dynamo import lookup_backend, register_backend
from torch._dynamo.backends.distributed import DDPOptimizer
from torch._dynamo.utils import counters

# Per compilation of one of dynamo's graphs: the graphs it runs as (the DDP optimizer's pieces, else 1).
PIECES: dict[int, int] = {}


def _ddp_optimizer() -> DDPOptimizer | None:
    """The DDP optimizer splitting the graph the backend is handed a piece of, if any (it keeps its ``buckets``
    "for testing/debugging purposes", torch/_dynamo/backends/distributed.py: one piece each)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "compile_fn" and isinstance(owner, DDPOptimizer):
            return owner
        frame = frame.f_back
    return None


def _counting(inner: str) -> Any:
    def compile_fn(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        splitter = _ddp_optimizer()
        if splitter is None:
            PIECES[-len(PIECES) - 1] = 1
        else:
            PIECES[id(splitter)] = len(splitter.buckets)
        return lookup_backend(inner)(gm, example_inputs, **kwargs)

    return compile_fn


for _inner in ("aot_eager", "inductor"):
    register_backend(compiler_fn=_counting(_inner), name=f"counting_{_inner}")


def graph_counts() -> dict[str, Any]:
    """``{"graphs": dynamo's graphs, "pieces": [graphs compiled for each of dynamo's compilations]}`` here."""
    return {"graphs": int(counters["stats"]["unique_graphs"]), "pieces": list(PIECES.values())}


class GraphsPerLayerProbe(pl.Callback):
    """Writes :func:`graph_counts` to ``path.<rank>`` (JSON) at the end of the fit; counts from nothing at its start
    (dynamo's caches cleared: a fit after another in the same process compiles its own graphs)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch._dynamo.reset()
        counters.clear()
        PIECES.clear()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with open(f"{self.path}.{trainer.global_rank}", "w") as file:
            json.dump(graph_counts(), file)
