"""``gym fit`` at world size 1 on CPU with the host-sync counter on (tests/test_host_syncs.py).

    python tests/helpers/host_sync_worker.py STRATEGY OUT.json ROOT

Runs configs/<ddp|fsdp>.yaml (its ThroughputCallback, MemoryCallback and StepCheckpoint, plus what ``gym fit`` adds:
NonFiniteGuard, HFExport, GymProgressBar, LearningRateMonitor, CurvesCallback, TensorBoard + CSV loggers) on one
CPU device for ``STEPS`` optimizer steps, and writes every counted sync (op, chain of file:line, step index).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from gym_lightning.cli import run_lightning_cli
from helpers.host_syncs import HostSyncCounter, count_training_batches, counting_host_syncs

CONFIGS = {"gym_ddp": "configs/ddp.yaml", "gym_fsdp": "configs/fsdp.yaml"}
STEPS, LOG_EVERY, CHECKPOINT_EVERY = 12, 5, 10
THROUGHPUT_WARMUP = 2  # the configs' ThroughputCallback warmup_steps: it reads after it, then every LOG_EVERY


def main(strategy: str, out: str, root: str) -> None:
    counter = HostSyncCounter()
    undo = count_training_batches(counter)
    args = [
        "fit", "--config", CONFIGS[strategy], "--trainer.devices=1", "--trainer.accelerator=cpu",
        f"--trainer.max_steps={STEPS}", f"--trainer.log_every_n_steps={LOG_EVERY}",
        f"--trainer.default_root_dir={root}", f"--export.output_dir={root}/hf", "--data.batch_size=4",
    ]  # fmt: skip
    try:
        with counting_host_syncs(counter):
            run_lightning_cli(args)
    finally:
        undo()
    payload = {"steps": STEPS, "log_every": LOG_EVERY, "checkpoint_every": CHECKPOINT_EVERY}
    # Step indices (global step before the step) after which ThroughputCallback reads its counters.
    payload["throughput_reads"] = list(range(THROUGHPUT_WARMUP - 1, STEPS, LOG_EVERY))
    payload["events"] = [asdict(event) for event in counter.events]
    with open(out, "w") as file:
        json.dump(payload, file, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
