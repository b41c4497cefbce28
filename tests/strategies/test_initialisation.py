"""One initialisation on every device: no weight draw during set-up writes into a tensor a sharding engine manages.

On an H200, ZeRO-3's LoRA adapters were drawn by peft's reset into gathered ZeRO-3 parameters, which live on the GPU
there: the CUDA generator drew them, so they differed from gym_ddp's and gym_fsdp's (drawn on the CPU), and a resume
restored only the CPU generator. ``helpers.init_worker`` records every ``torch.nn.init`` call of a LoRA run's set-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.dist import HELPERS, run_python
from helpers.init_worker import STRATEGIES

pytestmark = pytest.mark.slow


def test_no_draw_writes_into_an_engine_managed_tensor(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    out = tmp_path / "writes.json"
    run_python([str(HELPERS / "init_worker.py"), str(out)], timeout=600)
    writes = json.loads(out.read_text())
    assert sorted(writes) == sorted(STRATEGIES)
    for strategy, calls in writes.items():
        # Every adapter gets its kaiming draw (2 layers x q_proj, v_proj).
        drawn = [
            c for c in calls if c["init"] == "kaiming_uniform_" and c["device"] == "cpu" and c["shape"] == [4, 128]
        ]
        assert len(drawn) >= 4, (strategy, calls)
        # Empty tensors draw nothing: peft's own reset as it creates adapters under zero.Init meets the empty
        # partition placeholders (0 elements), before gym_lightning draws the adapters again.
        managed = [c for c in calls if c["engine"] and c["shape"] != [0]]
        assert not managed, f"{strategy}: drew into engine-managed tensors {managed}"
        assert all(c["device"] in ("cpu", "meta") for c in calls), strategy
