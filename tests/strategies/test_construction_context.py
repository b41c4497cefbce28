"""No user hook but ``configure_model`` runs inside a construction context (issue: the GPU path on first contact).

On an H200, ZeRO-1/2 ran the user's ``train_dataloader`` under the CUDA default device (Lightning's
``tensor_init_context``) while completing the DeepSpeed config, and a CPU generator failed there. On a CPU the device
context is invisible, but it is still on torch's function-mode stack, and ``bf16-true`` makes it visible as the
default dtype: both are asserted here, for every strategy and precision (``helpers.context_worker``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.context_worker import PRECISIONS, STRATEGIES
from helpers.dist import HELPERS, run_python

pytestmark = pytest.mark.slow


def test_user_data_hooks_run_outside_every_construction_context(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    run_python([str(HELPERS / "context_worker.py"), str(out)], timeout=600)
    seen = json.loads(out.read_text())
    assert sorted(seen) == sorted(f"{name}/{precision}" for name in STRATEGIES for precision in PRECISIONS)
    for run, found in seen.items():
        calls = found["loaders"]
        assert calls, f"{run}: train_dataloader was never called"
        # The metric keeps fp32 under bf16-true (convert_module cast it to bf16); the buffer follows the precision.
        assert found["placed"]["train_loss.mean_value[0]"] == ["cpu", "torch.float32"], run
        assert found["placed"]["train_loss.weight[0]"] == ["cpu", "torch.float32"], run
        assert found["placed"][".scale"][0] == "cpu", run
        for call in calls:
            assert call["modes"] == [], f"{run}: train_dataloader ran under {call['modes']}"
            assert call["default_dtype"] == "torch.float32" and call["tensor"] == "torch.float32", (run, call)
            assert call["drawn"] == "cpu", (run, call)
