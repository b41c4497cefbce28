"""Host syncs per quiet training step of ``gym fit``, every strategy x precision on one device (issue 55; gpu.sh
prints the table).

On CUDA each sync is one torch itself flags under ``torch.cuda.set_sync_debug_mode("warn")``
(``benchmarks.common.host_syncs.counting_cuda_syncs``: the warnings recorded with their owner instead of printed);
on the CPU smoke the census that stands in for it (``counting_host_syncs``, what tests/test_host_syncs.py counts).
Each cell is the shipped config of its strategy as a user runs it on one device (``gym fit --config
configs/zero3.yaml --trainer.precision bf16-mixed ...``: its callbacks, NonFiniteGuard and the progress bar), 12
optimizer steps, no export. A quiet step neither logs (every 5 steps), reads the throughput (its warm-up's end and
every log after it), checkpoints (every 10) nor comes first: steps 2, 3, 5, 7, 8 and 10. The syncs of a training
batch (its hooks, forward, backward, optimizer step; ``count_training_batches``) are averaged over them.

Budget (docs/benchmarks.md, "Host syncs per quiet step"): gym_lightning's own syncs per quiet step 0, at most 1
where NonFiniteGuard must read its flags at once (DeepSpeed's engine and a GradScaler cannot skip a step
themselves; an offloaded optimizer steps on host copies of them). Every other owner's are figures (transformers'
padding-mask check, Lightning's, DeepSpeed's, torch's own), recorded per owner and per site.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import pytest
from gpu_configs import gym_fit
from gpu_runs import Check, Context

from benchmarks.common.host_syncs import (
    CUDA_SYNC,
    KINDS,
    HostSyncCounter,
    count_training_batches,
    counting_cuda_syncs,
    counting_host_syncs,
    quiet_steps,
)
from benchmarks.common.paths import CONFIGS

pytestmark = pytest.mark.gpu
# The shipped configs' log interval, ThroughputCallback warm-up and StepCheckpoint interval (configs/ddp.yaml ...).
STEPS, LOG_EVERY, THROUGHPUT_WARMUP, CHECKPOINT_EVERY = 12, 5, 2, 10
QUIET = quiet_steps(STEPS, LOG_EVERY, CHECKPOINT_EVERY, set(range(THROUGHPUT_WARMUP - 1, STEPS, LOG_EVERY)))
# strategy -> (config, flags beyond it)
STRATEGIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gym_ddp": ("ddp", ()),
    "gym_fsdp": ("fsdp", ()),
    "gym_fsdp_offload": ("fsdp", ("--trainer.strategy.cpu_offload=true",)),
    "zero1": ("zero1", ()),
    "zero2": ("zero2", ()),
    "zero3": ("zero3", ()),
    "zero3_offload": ("zero3_offload", ()),
}
PRECISIONS = ("bf16-mixed", "32-true", "16-mixed")  # in this order: the time budget gives up the last first
CELLS = [(strategy, precision) for precision in PRECISIONS for strategy in STRATEGIES]
# On the CPU smoke two cells check the path (CLI, census, record); the CPU census of every cell is
# tests/test_host_syncs.py's and `python -m benchmarks.host_syncs`'s.
SMOKE_CELLS = (("gym_ddp", "bf16-mixed"), ("zero3", "bf16-mixed"))


def gym_allowance(strategy: str, precision: str) -> int:
    """gym_lightning's syncs per quiet step the budget allows: NonFiniteGuard's immediate flag read where the
    optimizer cannot skip a step itself (ZeRO, a GradScaler) or steps on the host (an offloaded optimizer)."""
    return int(strategy.startswith("zero") or strategy.endswith("_offload") or precision == "16-mixed")


def census_fit(ctx: Context, strategy: str, precision: str) -> tuple[HostSyncCounter, int, list[str]]:
    """The cell's ``gym fit`` with the device's counter on for every training batch: the counter, the exit status
    and the command line's one-line errors."""
    config, flags = STRATEGIES[strategy]
    root = ctx.work / f"syncs-{strategy}-{precision}"
    argv = ["fit", "--config", str(CONFIGS / f"{config}.yaml"), *flags, "--trainer.devices=1"]
    argv += [f"--trainer.accelerator={'gpu' if ctx.cuda else 'cpu'}", f"--trainer.precision={precision}"]
    argv += [f"--trainer.max_steps={STEPS}", f"--trainer.default_root_dir={root}", "--export.output_dir=null"]
    counter = HostSyncCounter()
    undo = count_training_batches(counter)
    try:
        with counting_cuda_syncs(counter) if ctx.cuda else counting_host_syncs(counter):
            code, errors = gym_fit(argv)
    finally:
        undo()
    return counter, code, errors


def per_quiet_step(counter: HostSyncCounter, cuda: bool) -> dict[str, Any]:
    """Syncs per quiet step in all, by owner and by ``owner: op @ innermost site``; each step's count."""
    kinds = (CUDA_SYNC,) if cuda else KINDS
    events = [e for e in counter.events if e.kind in kinds]
    quiet = [e for e in events if e.step in QUIET]
    owners = Counter(e.owner for e in quiet)
    sites = Counter(f"{e.owner}: {e.op} @ {e.chain[-1] if e.chain else '?'}" for e in quiet)
    return {
        "per_quiet_step": len(quiet) / len(QUIET),
        "by_owner": {owner: n / len(QUIET) for owner, n in owners.most_common()},
        "sites": {site: n / len(QUIET) for site, n in sites.most_common(12)},
        "per_step": dict(sorted(Counter(e.step for e in events).items())),
        "quiet_steps": sorted(QUIET),
        "counted_by": "torch.cuda.set_sync_debug_mode('warn')" if cuda else "the CPU census (benchmarks.common)",
    }


def host_sync_verdict(ctx: Context, strategy: str, precision: str) -> dict[str, Any]:
    """The cell's syncs per quiet step against gym_lightning's budget (``gym_allowance``)."""
    counter, code, errors = census_fit(ctx, strategy, precision)
    if code != 0:
        return {"ok": False, "detail": errors[-1] if errors else f"gym fit exited with {code}"}
    figures = {"strategy": strategy, "precision": precision, **per_quiet_step(counter, ctx.cuda)}
    gym, allowed = figures["by_owner"].get("gym_lightning", 0.0), gym_allowance(strategy, precision)
    figures["gym_lightning_allowed"] = allowed
    verdict: dict[str, Any] = {"ok": gym <= allowed, "figures": figures}
    if gym > allowed:
        sites = [site for site in figures["sites"] if site.startswith("gym_lightning")]
        verdict["detail"] = f"gym_lightning syncs {gym:g} per quiet step (allowed {allowed}): {'; '.join(sites)}"
    return verdict


@pytest.mark.parametrize(("strategy", "precision"), CELLS, ids=[f"{s}-{p}" for s, p in CELLS])
def test_host_syncs_per_quiet_step(check: Check, ctx: Context, strategy: str, precision: str) -> None:
    name = f"host_syncs/{strategy}/{precision}"
    if not ctx.cuda and (strategy, precision) not in SMOKE_CELLS:
        check.skip(
            name,
            "CUDA only: on the CPU smoke only the cells of SMOKE_CELLS run (the census of every cell on CPU "
            "ranks: tests/test_host_syncs.py, python -m benchmarks.host_syncs)",
        )
    check(name, partial(host_sync_verdict, ctx, strategy, precision))
