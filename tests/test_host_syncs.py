"""Host syncs per optimizer step of ``gym fit`` at world size 1 (issue 47: the wrapper's per-step tax on GPU).

On CUDA every host read of a device tensor (``item``, ``tolist``, ``bool`` ...) stops the host until the GPU has
finished the work queued before it, so the next step's kernels are not queued ahead and the GPU idles. Counted on
CPU (tests/helpers/host_syncs.py), the same calls are a device-free invariant. The budget: outside the logging
steps (every ``log_every_n_steps``) and checkpoint steps, gym_lightning and Lightning make no host sync at all; the
one left per step is transformers' own padding-mask check in the model's forward (``masking_utils``, "can the
causal mask be skipped"), which a plain PyTorch loop makes too. Before this was measured (commit 4556a79) a step
made 4-7 wrapper syncs: the non-finite guard's ``nonzero`` + ``tolist`` (x2) and Lightning's ``.item()`` of every
``prog_bar`` metric at each batch end, progress-bar refresh and ``trainer.callback_metrics`` read.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers.dist import run_python

MODEL_FORWARD = "transformers/"  # syncs inside the model's forward: the plain loop's too


def quiet_steps(run: dict[str, Any]) -> set[int]:
    """Step indices (global step before the step) that neither log (the Trainer's loggers and progress bar, the
    ThroughputCallback's own interval) nor checkpoint, nor are the first one."""
    steps, log_every, checkpoint_every = run["steps"], run["log_every"], run["checkpoint_every"]
    busy = set(run["throughput_reads"])
    return {i for i in range(1, steps) if (i + 1) % log_every and (i + 1) % checkpoint_every and i not in busy}


def wrapper_syncs(run: dict[str, Any], steps: set[int]) -> Counter[str]:
    """``op @ site`` of the syncs in ``steps`` that are not the model forward's own."""
    return Counter(
        f"{e['op']} @ {' <- '.join(reversed(e['chain'][-3:]))}"
        for e in run["events"]
        if e["step"] in steps and not any(MODEL_FORWARD in frame for frame in e["chain"])
    )


@pytest.mark.parametrize("strategy", ["gym_ddp", "gym_fsdp"])
def test_gym_fit_makes_no_wrapper_host_sync_outside_logging_steps(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / "syncs.json"
    run_python(["tests/helpers/host_sync_worker.py", strategy, str(out), str(tmp_path / "run")], timeout=300)
    run = json.loads(out.read_text())
    quiet = quiet_steps(run)
    assert len(quiet) >= 6
    assert wrapper_syncs(run, quiet) == Counter()  # was 4-7 per step (module docstring)
    model = Counter(e["step"] for e in run["events"] if e["step"] in quiet and MODEL_FORWARD in "".join(e["chain"]))
    assert set(model.values()) <= {1}  # transformers' padding-mask check, one per forward
    logging = {run["log_every"] - 1}  # a logging step that is no checkpoint step: the loggers' and bar's reads
    assert sum(wrapper_syncs(run, logging).values()) <= 4, wrapper_syncs(run, logging)
