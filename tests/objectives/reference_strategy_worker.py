"""DPO fits with a frozen reference under every strategy, several in one pair of ranks (``test_reference_strategies``).

``python reference_strategy_worker.py SPEC.json``, started once per rank with torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``: Lightning starts no process), runs the spec's ``crashes``, each in forked children of
the two ranks with a process group of their own (rank 1's child SIGKILLs itself at the start of ``kill_step``,
``helpers.faults.KillRank``; forking costs no launch, as nothing is imported again), then its ``runs`` one after the
other in the ranks themselves. A run trains a ``CausalLMModule`` with ``DPO`` on ``PAIRS`` (AdamW, checkpoints
every step; ``resume``: from the crashed run's last checkpoint) and writes, on global rank 0, ``NAME.json`` (each
step's loss and TRL metrics as every rank's mean, how each rank holds the reference and the policy, how many
reference models were built) and ``NAME.pt`` (the policy's final weights).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected"]  # fmt: skip
PAIRS = [(f"{i}+{i}=", f" {2 * i}" + " yes" * (i % 3), f" {i}{i}" + " no" * (i % 4)) for i in range(16)]


def write_pairs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    return path


def build_strategy(name: str, devices: int) -> Any:
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

    if devices == 1 and name == "single":
        return "auto"
    timeout = timedelta(seconds=60)  # a killed peer must not keep the survivor waiting for 30 minutes
    if name == "gym_ddp":
        return GymDDPStrategy(timeout=timeout)
    if name.startswith("gym_fsdp"):
        return GymFSDPStrategy(cpu_offload=name.endswith("offload"), timeout=timeout)
    offload = "cpu" if name.endswith("offload") else "none"  # zero3_offload: optimizer and parameters on the host
    stage = int(name.removeprefix("zero")[0])
    return ZeROStrategy(stage=stage, offload_optimizer=offload, offload_parameters=offload, timeout=timeout)


def held(model: torch.nn.Module | None) -> dict[str, int]:
    """What this rank stores of ``model``'s parameters (DTensor shards, ZeRO-3 partitions and what is gathered
    now, or whole tensors) and the parameters' full element count."""
    if model is None:
        return {"bytes": 0, "numel": 0, "full_numel": 0, "dtypes": [], "buffer_dtypes": []}
    stored = full = 0
    size = 0
    for param in model.parameters():
        parts = (
            [param.ds_tensor, param.data] if hasattr(param, "ds_tensor") else [getattr(param, "_local_tensor", param)]
        )
        stored += sum(p.numel() for p in parts)
        size += sum(p.numel() * p.element_size() for p in parts)
        full += int(getattr(param, "ds_numel", param.numel()))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    buffers = sorted({str(b.dtype) for b in model.buffers() if b.is_floating_point()})
    return {"bytes": size, "numel": stored, "full_numel": full, "dtypes": dtypes, "buffer_dtypes": buffers}


class Record(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """Each step's loss (mean over ranks) and logged TRL metrics; after the last step, how each rank holds the
    reference and the policy."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.metrics: list[dict[str, float]] = []
        self.holdings: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))
        self.metrics.append({name: float(trainer.callback_metrics[name]) for name in NAMES})
        self.holdings = holdings(module)  # kept: the last step's (ZeRO-3 keeps small vectors gathered once traced)


def holdings(module: Any) -> list[dict[str, Any]]:
    """Every rank's provider of the reference, what it holds of the reference and of the policy, and whether the
    reference is a registered submodule of the LightningModule (a collective)."""
    reference = module.objective.reference(module)
    model = getattr(reference, "model", None)
    mine = {"provider": type(reference).__name__, "reference": held(model), "policy": held(module.model)}
    mine["registered"] = model is not None and any(m is model for m in module.modules())
    if not torch.distributed.is_initialized():
        return [mine]
    ranks: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


def count_builds() -> list[int]:
    """Counts the reference models built (``objectives.preference.build_reference`` calls) in this process."""
    from gym_lightning.objectives import preference

    calls = [0]
    original = preference.build_reference

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    preference.build_reference = counted
    return calls


def run(spec: dict[str, Any], builds: list[int]) -> None:
    import lightning.pytorch as pl
    from helpers.faults import KillRank
    from helpers.full_state import full_model_state_dict

    from gym_lightning import CausalLMDataModule, CausalLMModule, LoRAArgs
    from gym_lightning.checkpointing import StepCheckpoint
    from gym_lightning.objectives import DPO

    pl.seed_everything(7, workers=True)
    before = builds[0]
    lora = LoRAArgs(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if spec.get("lora") else None
    objective = DPO(beta=0.5, ref_model=spec.get("ref_model"), reference_dtype=spec.get("reference_dtype"))
    module = CausalLMModule(
        model=spec["model"], pretrained=spec.get("pretrained", True), lr=spec.get("lr", 3e-3),
        scheduler="constant", lora=lora, objective=objective, **spec.get("module_args", {}),
    )  # fmt: skip
    data = CausalLMDataModule(train_files=spec["data"], tokenizer=spec["model"], format="preference",
                              batch_size=spec["batch_size"], max_seq_length=32,
                              cache_dir=spec.get("cache"))  # fmt: skip
    record, out = Record(), Path(spec["out"])
    callbacks = [record, StepCheckpoint(dirpath=out / spec.get("ckpt", spec["name"]), every_n_steps=1, keep_last=2)]
    if spec.get("kill_step") is not None:
        callbacks.append(KillRank(rank=1, step=spec["kill_step"], batch=spec["kill_step"]))
    trainer = pl.Trainer(
        accelerator="cpu", devices=spec["devices"], strategy=build_strategy(spec["strategy"], spec["devices"]),
        precision=spec.get("precision", "32-true"), max_steps=spec["steps"], log_every_n_steps=1, logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last" if spec.get("resume") else None)
    state = full_model_state_dict(trainer.strategy, module.model)
    if trainer.is_global_zero:
        torch.save(state, out / f"{spec['name']}.pt")
        result = {"losses": record.losses, "metrics": record.metrics, "holdings": record.holdings}
        result |= {"builds": builds[0] - before, "global_step": trainer.global_step}
        (out / f"{spec['name']}.json").write_text(json.dumps(result))
    trainer.strategy.barrier()


def crash(spec: dict[str, Any], builds: list[int]) -> int:
    """Run the ``crash`` spec in a forked child of this rank, whose process group is its own (``spec["port"]``), and
    wait for it: its raw wait status (rank 1's child dies of SIGKILL, rank 0's of its peer's loss). The ranks are
    forked with everything imported and no process group started, so that a run that kills a rank costs no launch.
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ["MASTER_PORT"] = str(spec["port"])
            run(spec, builds)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def main(spec_path: str) -> None:
    """The spec's ``crashes`` (each in forked children), then its ``runs`` (in these processes)."""
    torch.set_num_threads(1)
    builds = count_builds()
    spec = json.loads(Path(spec_path).read_text())
    statuses = {}
    for crashed in spec.get("crashes", []):
        start = time.perf_counter()
        statuses[crashed["name"]] = crash(crashed, builds)
        print(f"reference_strategy_worker: {crashed['name']} ended in {time.perf_counter() - start:.1f} s", flush=True)
    Path(spec["out"], f"crashes-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(statuses))
    for each in spec["runs"]:
        start = time.perf_counter()
        run(each, builds)
        print(f"reference_strategy_worker: {each['name']} done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
