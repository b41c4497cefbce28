"""``python roll_call_worker.py RANK MODE OUT``: 2 gloo ranks, a RankWatch, one all_reduce that rank 1 never joins.

MODE ``exit``: rank 1 exits (a crash); ``stop``: rank 1 stops itself (SIGSTOP). Rank 0 diagnoses the failed
all_reduce and writes the line to OUT. MASTER_ADDR/MASTER_PORT come from the environment.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gym_lightning.strategies.rank_failure import RankWatch

rank, mode, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
watch = RankWatch(timedelta(seconds=5))
dist.barrier()
if rank == 1:
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(3)
try:
    dist.all_reduce(torch.ones(2))
except RuntimeError as err:
    out.write_text(watch.diagnose(err) or "no diagnosis")
os._exit(0)
