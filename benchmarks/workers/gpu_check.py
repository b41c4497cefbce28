"""The correctness part of benchmarks/gpu.sh: every check in one process, one JSON line per check, as it ends.

    python benchmarks/workers/gpu_check.py --out DIR/checks.jsonl               # on one CUDA device
    python benchmarks/workers/gpu_check.py --out /tmp/checks.jsonl --cpu-smoke  # the same checks on CPU
    python benchmarks/workers/gpu_check.py --out /tmp/checks.jsonl --cpu-smoke --stages configs  # gym fit only

One process (importing torch, DeepSpeed and transformers costs 10-20 s a process) holding one process group of
world size 1 for every run ("cpu:gloo,cuda:nccl" on CUDA, so that runs keeping tensors on either side share it),
a tiny Llama (2 layers, hidden 32, HF's own initialisation saved as a pretrained folder) and the variable-length,
partly masked token rows of tests/helpers/strategy_worker.py (24 for training, 8 for validation). No DeepSpeed op
is built (gpu_common.refuse_jit_builds): torch optimizers only (configs/zero3_offload.yaml steps its torch AdamW
on the host partitions; DeepSpeed's CPU Adam would be built). Tolerances compare
``|a - b| <= atol + rtol * |b|``, as ``torch.testing.assert_close`` does.

Checks, in this order; each appends {"check", "ok", "figures" | "detail", "seconds"} and flushes:

1. ``train/<run>``: ``fp32_reference`` (one device, 32-true), then gym_ddp, gym_fsdp, zero1, zero2, zero3 in
   bf16-mixed: 4 optimizer steps (2 epochs of 3 micro-batches, accumulation 2), every micro-batch loss finite and
   within rtol = atol = 5e-2 of the reference's (bf16 keeps ~3 significant digits; tests/gpu's tolerance).
2. ``offload/gym_fsdp``: ``GymFSDPStrategy(cpu_offload=True)`` trains so too and, on CUDA, the local tensor of
   every sharded parameter is on the host after setup. On CPU ranks cpu_offload is a documented no-op: the
   placement is recorded as not applicable.
3. ``val_metrics``: val/loss and val/ppl as CausalLMModule logs them. Before training (Lightning's sanity pass
   over the whole validation set: same weights, same data) every run's val/loss within rtol 1e-2 of the fp32
   reference's; after training within 5e-2; val/ppl == exp(val/loss) to 1e-4 in every pass.
4. ``export/<run>``: HFExport's folder (float32) reloaded with ``AutoModelForCausalLM.from_pretrained`` gives the
   trained module's logits on a fixed batch (computed at on_train_end): to 1e-4 of their scale where the module
   computes in fp32; where it computes in bf16, within 5 % of their scale and under a quarter of how far the four
   training steps moved them (so that an export of the untrained weights fails).
5. ``init_weights``: ``pretrained=False``, same seed, 32-true: the full state dict gathered at on_fit_start
   (after setup, before any forward or step) of gym_fsdp, zero1, zero2, zero3 equals gym_ddp's exactly.
6. ``chunked_loss``: loss_chunking on vs off, the same summed loss and gradients (fp32 on the device: 1e-5 / 1e-4),
   and a gym_fsdp bf16-mixed run with the chunked loss within 2e-2 of check 1's unchunked one.
7. ``qlora/gym_fsdp`` (``qlora/zero3`` before torch 2.13, whose FSDP2 cannot shard a 4-bit base): a 4-bit NF4
   base (``model.quantization``, blocks of 32) with LoRA adapters on q/v in bf16-mixed, its losses within 5e-2 of
   the same QLoRA run in fp32, and its merged export reloaded as in check 4 (dequantised on the device:
   bitsandbytes' kernel where installed, plain torch otherwise).
8. ``ddp_hook/<fp16|bf16|powersgd>``: ``GymDDPStrategy(gradient_compression=...)`` registers its DDP hook and
   trains at world size 1, finite and within 5e-2 of check 1's gym_ddp.
9. ``gym_fit/<config>``: the user's path, ``gym_lightning.cli.main(["fit", "--config", "configs/<config>.yaml",
   ...])`` in this same process (one import for all), of every shipped config that runs on one GPU: ddp, fsdp,
   zero1, zero2, zero3, zero3_offload and qlora (``model.model``: a random-weight Qwen3 folder saved here with the
   shipped tokenizer, as tests/helpers/families.py makes them; the machine reaches no hub). Overridden: one device
   (``gpu``, ``cpu`` under --cpu-smoke), bf16-mixed (the configs' own advice for GPUs), 3 optimizer steps (2 under
   --cpu-smoke), logs and the export under --work. ok: the command ended with status 0 after that many steps with
   finite losses (a probe callback appended to the config's callbacks writes them, as the training step returns
   them: divided by accumulate_grad_batches), and its end-of-fit export loads with
   ``AutoModelForCausalLM.from_pretrained`` without missing or unexpected keys and gives finite logits. On
   torch < 2.13 gym_fsdp refuses a 4-bit base in one line (gym_lightning.strategies.fsdp): ``gym_fit/qlora`` then
   passes when the command ends with status 2 and that line, and ``gym_fit/qlora@zero3`` trains the same config
   with ``--trainer.strategy zero3``. With ``--deadline``, a config whose fit would likely end past it (the slowest
   so far) is recorded as skipped instead of being cut off by gpu.sh's kill.

Last, ``op_builds`` lists the DeepSpeed ops loaded: none may be built (on CPU only DeepSpeed's shared-memory
collective loads); a refused build fails the check whose run asked for it, with the op's name. Every failure is
one line (``detail``). The benchmark part of benchmarks/gpu.sh is gpu_bench.py's.

On CUDA each training run also counts the synchronisations torch flags (``torch.cuda.set_sync_debug_mode``)
between on_train_batch_start and on_train_batch_end (figures only).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import CPU_ONLY_OPS, REPO_ROOT, append_record, one_line, refuse_jit_builds

sys.path.insert(0, str(REPO_ROOT / "tests"))  # helpers.strategy_worker: the multi-rank tests' data and model

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Subset

SEED = 7
TRAIN_ROWS, VAL_ROWS = 24, 8
TRAIN_TOL = 5e-2  # bf16-mixed against fp32, per micro-batch loss (tests/gpu's tolerance)
VAL_TOL, VAL_FINAL_TOL = 1e-2, 5e-2
TRAIN_RUNS: tuple[tuple[str, str, str], ...] = (
    ("fp32_reference", "auto", "32-true"),
    ("gym_ddp", "gym_ddp", "bf16-mixed"),
    ("gym_fsdp", "gym_fsdp", "bf16-mixed"),
    ("zero1", "zero1", "bf16-mixed"),
    ("zero2", "zero2", "bf16-mixed"),
    ("zero3", "zero3", "bf16-mixed"),
)
INIT_STRATEGIES = ("gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3")
HOOKS = ("fp16", "bf16", "powersgd")
PROBE = [[5, 9, 12, 40, 7, 3, 22, 8, 17, 2], [11, 4, 150, 33, 60, 2, 2, 9, 81, 100]]


# --------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    """What one ``Trainer.fit`` left behind for the checks."""

    name: str
    losses: list[float] = field(default_factory=list)
    global_step: int = 0
    val: list[dict[str, Any]] = field(default_factory=list)
    logits: torch.Tensor | None = None
    placement: dict[str, dict[str, int]] = field(default_factory=dict)
    backend: str | None = None
    hooks: list[str] = field(default_factory=list)
    initial_state: dict[str, torch.Tensor] | None = None
    syncs: list[int] = field(default_factory=list)
    export_dir: Path | None = None
    seconds: float = 0.0


@dataclass
class Context:
    """The device, the scratch folder and the tiny pretrained folder every run starts from."""

    device: torch.device
    work: Path
    model_dir: Path
    initial_logits: torch.Tensor | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class SyncCounter:
    """The CUDA synchronisations torch flags (``set_sync_debug_mode("warn")``) between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self._catcher: Any = None
        self._seen: list[warnings.WarningMessage] = []

    def start(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._seen = self._catcher.__enter__()
        warnings.simplefilter("always")  # gpu.sh sets PYTHONWARNINGS=ignore
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> int | None:
        if self._catcher is None:
            return None
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(None, None, None)
        self._catcher = None
        return sum("synchroniz" in str(w.message) for w in self._seen)


class Observer(Callback):
    """Fills a :class:`Run`: losses, validation metrics, placement, hooks, initial state, probe logits."""

    def __init__(self, run: Run, gather_state: bool, count_syncs: bool) -> None:
        self.run, self.gather_state = run, gather_state
        self.counter = SyncCounter() if count_syncs else None

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # After the strategy's setup, before the sanity pass's forward (FSDP2 keeps the root unit gathered after
        # a forward, so the root's parameters would no longer show as shards) and before any optimizer step.
        self.run.backend = getattr(trainer.strategy, "process_group_backend", None)
        self.run.placement = parameter_placement(module)
        self.run.hooks = [
            getattr(hook, "__name__", repr(hook)) for hook, _ in getattr(trainer.model, "_comm_hooks", [])
        ]
        if self.gather_state:
            self.run.initial_state = full_state(trainer.strategy, module.model)

    def on_train_batch_start(self, *args: Any) -> None:
        if self.counter is not None:
            self.counter.start()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        if self.counter is not None and (count := self.counter.stop()) is not None:
            self.run.syncs.append(count)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.run.losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("val/loss", "val/ppl")}
        self.run.val.append({"sanity": trainer.sanity_checking, **metrics})

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.run.logits = probe_logits(module.model, module.device)

    def on_exception(self, *args: Any) -> None:
        if self.counter is not None:
            self.counter.stop()


def parameter_placement(module: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Device types of the parameters: the local shard of a DTensor (FSDP2), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    sharded: Counter[str] = Counter()
    plain: Counter[str] = Counter()
    for param in module.parameters():
        if isinstance(param, DTensor):
            sharded[param.to_local().device.type] += 1
        else:
            plain[param.device.type] += 1
    return {"sharded_local": dict(sharded), "plain": dict(plain)}


def full_state(strategy: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on the host, one tensor at a time (the strategy's own gather where it shards; a
    collective there: every rank calls this)."""
    from gym_lightning.lazy import full_tensors_of

    return {key: tensor.load().detach().cpu().clone() for key, tensor in full_tensors_of(strategy, model).items()}


def probe_logits(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """``model``'s logits on the fixed probe batch, in the dtype it computes them (every strategy: a collective
    where parameters are sharded)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE, device=device)).logits.detach().cpu()
    model.train(was_training)
    return logits


class CheckData(pl.LightningDataModule):
    """24 training rows in StepTokenDataLoader batches of 8 (same order on every strategy), 8 validation rows."""

    def train_dataloader(self) -> DataLoader:
        from helpers.strategy_worker import TokenDataset, collate_tokens, same_order_sampler

        from gym_lightning.data.loader import StepTokenDataLoader

        rows = Subset(TokenDataset(TRAIN_ROWS + VAL_ROWS), range(TRAIN_ROWS))
        return StepTokenDataLoader(
            rows,
            batch_size=8,
            sampler=same_order_sampler(self.trainer, rows),
            collate_fn=collate_tokens,
            accumulate_grad_batches=self.trainer.accumulate_grad_batches,
        )

    def val_dataloader(self) -> DataLoader:
        from helpers.strategy_worker import TokenDataset, collate_tokens

        rows = Subset(TokenDataset(TRAIN_ROWS + VAL_ROWS), range(TRAIN_ROWS, TRAIN_ROWS + VAL_ROWS))
        return DataLoader(rows, batch_size=4, collate_fn=collate_tokens)  # 2 batches: the weighted mean matters


def fit(
    ctx: Context,
    name: str,
    strategy: Any,
    precision: str = "bf16-mixed",
    module_kwargs: dict[str, Any] | None = None,
    export: bool = False,
    gather_state: bool = False,
) -> Run:
    """One ``Trainer.fit`` of the tiny model; validation and probing unless ``gather_state`` (1 step, no val)."""
    from gym_lightning import CausalLMModule, HFExport

    pl.seed_everything(SEED, workers=True, verbose=False)
    run = Run(name)
    module = CausalLMModule(
        **{"model": str(ctx.model_dir), "lr": 3e-3, "scheduler": "constant", **(module_kwargs or {})}
    )
    callbacks: list[Callback] = [Observer(run, gather_state, count_syncs=ctx.cuda and not gather_state)]
    if export:
        run.export_dir = ctx.work / f"{name}.hf"
        callbacks.append(HFExport(output_dir=str(run.export_dir), dtype="float32"))
    trainer = pl.Trainer(
        accelerator=ctx.device.type,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_epochs=2,
        max_steps=1 if gather_state else -1,
        accumulate_grad_batches=2,
        limit_val_batches=0 if gather_state else None,
        num_sanity_val_steps=0 if gather_state else -1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(ctx.work / name),
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=CheckData())
    run.global_step, run.seconds = trainer.global_step, time.perf_counter() - start
    del trainer, module
    gc.collect()
    return run


# --------------------------------------------------------------------------------------------- comparisons


def closeness(values: Any, reference: Any, rtol: float, atol: float) -> dict[str, Any]:
    """Whether ``values`` are within ``atol + rtol * |reference|`` elementwise, and by how much they differ."""
    a, b = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    if a.shape != b.shape:
        return {"close": False, "why": f"shape {list(a.shape)} vs the reference's {list(b.shape)}"}
    diff = (a - b).abs()
    close = bool(torch.all(diff <= atol + rtol * b.abs()))
    return {"close": close, "max_abs_diff": _num(diff.max()), "max_rel_diff": _num((diff / b.abs()).max())}


def _num(value: Any) -> float:
    return round(float(value), 8)


def all_finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def training_verdict(run: Run, reference: Run | None, tol: float) -> dict[str, Any]:
    """ok: 4 optimizer steps, finite losses, within ``tol`` of ``reference`` (when given)."""
    figures: dict[str, Any] = {"global_step": run.global_step, "losses": [round(v, 5) for v in run.losses]}
    figures["fit_seconds"] = round(run.seconds, 2)
    if run.syncs:
        figures["cuda_syncs_per_micro_batch"] = round(sum(run.syncs) / len(run.syncs), 2)
    ok = run.global_step == 4 and all_finite(run.losses)
    if reference is not None:
        figures["vs_reference"] = closeness(run.losses, reference.losses, tol, tol)
        ok = ok and figures["vs_reference"]["close"]
    return {"ok": ok, "figures": figures}


# --------------------------------------------------------------------------------------------- checks


def check_train(ctx: Context, runs: dict[str, Run], name: str, strategy: str, precision: str) -> dict[str, Any]:
    runs[name] = fit(ctx, name, strategy, precision, export=True)
    reference = None if name == "fp32_reference" else runs.get("fp32_reference")
    if name != "fp32_reference" and reference is None:
        return {"ok": False, "detail": "the fp32 reference run failed (see train/fp32_reference)"}
    return training_verdict(runs[name], reference, TRAIN_TOL)


def check_offload(ctx: Context, runs: dict[str, Run]) -> dict[str, Any]:
    from gym_lightning import GymFSDPStrategy

    run = runs["gym_fsdp_offload"] = fit(ctx, "gym_fsdp_offload", GymFSDPStrategy(cpu_offload=True))
    verdict = training_verdict(run, runs.get("fp32_reference"), TRAIN_TOL)
    verdict["ok"] = verdict["ok"] and "fp32_reference" in runs
    figures = verdict["figures"]
    figures["placement_after_setup"], figures["process_group_backend"] = run.placement, run.backend
    if "gym_fsdp" in runs:
        figures["vs_gym_fsdp"] = closeness(run.losses, runs["gym_fsdp"].losses, TRAIN_TOL, TRAIN_TOL)
    if not ctx.cuda:
        figures["host_placement"] = "not applicable: cpu_offload is a documented no-op on CPU ranks"
        return verdict
    sharded = run.placement.get("sharded_local", {})
    on_host = bool(sharded) and set(sharded) == {"cpu"}
    figures["host_placement"] = "every shard on the host" if on_host else f"shards on {sharded or 'none'}"
    verdict["ok"] = verdict["ok"] and on_host
    return verdict


# QLoRA: a 4-bit base (blocks of 32: the tiny model is 32 wide) under LoRA adapters on q/v.
QLORA_LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def qlora_strategy() -> str:
    """gym_fsdp where this torch's FSDP2 holds a 4-bit base; before torch 2.13 gym_fsdp refuses it in one line
    (``gym_fit/qlora`` records that), and the check runs under zero3, which holds it."""
    from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters

    return "gym_fsdp" if fsdp2_holds_integer_parameters() else "zero3"


def check_qlora(ctx: Context, runs: dict[str, Run]) -> dict[str, Any]:
    """QLoRA under gym_fsdp (zero3 before torch 2.13) in bf16-mixed (the base dequantised to bf16 on the device,
    bitsandbytes' kernel where it is installed, plain torch otherwise) against the same run in fp32, then its merged
    export reloaded."""
    strategy = qlora_strategy()
    settings = {"lora": QLORA_LORA, "quantization": {"block_size": 32, "compute_dtype": "float32"}}
    reference = fit(ctx, "qlora_fp32", strategy, "32-true", settings)
    settings = {**settings, "quantization": {"block_size": 32, "compute_dtype": "bfloat16"}}
    runs["qlora"] = fit(ctx, "qlora", strategy, "bf16-mixed", settings, export=True)
    verdict = training_verdict(runs["qlora"], reference, TRAIN_TOL)
    exported = check_export(ctx, runs["qlora"])
    verdict["figures"]["export"] = exported["figures"]
    return {**verdict, "ok": verdict["ok"] and exported["ok"]}


def val_passes(run: Run) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The sanity pass (before training) and the last validation after training of ``run``."""
    sanity = next((v for v in run.val if v["sanity"] and "val/loss" in v), None)
    final = next((v for v in reversed(run.val) if not v["sanity"] and "val/loss" in v), None)
    return sanity, final


def check_val(runs: dict[str, Run]) -> dict[str, Any]:
    names = [name for name, _, _ in TRAIN_RUNS] + ["gym_fsdp_offload"]
    reference = runs.get("fp32_reference")
    if reference is None or None in val_passes(reference):
        return {"ok": False, "detail": "no validation metrics from the fp32 reference run"}
    ref_sanity, ref_final = val_passes(reference)
    figures, ok = {}, True
    for name in names:
        if name not in runs:
            figures[name], ok = "training run failed", False
            continue
        sanity, final = val_passes(runs[name])
        if sanity is None or final is None:
            figures[name], ok = f"val/loss not logged: {runs[name].val}", False
            continue
        row = {"before": sanity, "after": final}
        row["before_vs_reference"] = closeness(sanity["val/loss"], ref_sanity["val/loss"], VAL_TOL, 0.0)
        row["after_vs_reference"] = closeness(final["val/loss"], ref_final["val/loss"], VAL_FINAL_TOL, 0.0)
        row["ppl_is_exp_loss"] = all(
            math.isclose(p["val/ppl"], math.exp(p["val/loss"]), rel_tol=1e-4) for p in (sanity, final)
        )
        ok = (
            ok and row["before_vs_reference"]["close"] and row["after_vs_reference"]["close"] and row["ppl_is_exp_loss"]
        )
        figures[name] = row
    return {"ok": ok, "figures": figures}


def reload_logits(folder: Path, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """Logits (fp32) of the folder loaded by plain transformers, and what from_pretrained reported missing."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    logits = probe_logits(model.to(device), device).float()
    problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    return logits, problems


def check_export(ctx: Context, run: Run | None) -> dict[str, Any]:
    if run is None or run.logits is None or run.export_dir is None:
        return {"ok": False, "detail": "the training run failed (see its train/ record)"}
    if ctx.initial_logits is None:  # the untrained model's logits: how far training moved them
        ctx.initial_logits = reload_logits(ctx.model_dir, ctx.device)[0]
    exported, problems = reload_logits(run.export_dir, ctx.device)
    trained = run.logits.float()
    diff = float((trained - exported).abs().max())
    scale = float(exported.abs().max())
    moved = float((exported - ctx.initial_logits).abs().max())
    fp32 = run.logits.dtype == torch.float32
    # fp32: the same weights give the same numbers up to kernel rounding; bf16: the module computes with weights
    # and activations rounded to 8 bits of mantissa, the reloaded model in fp32.
    close = diff <= 1e-4 * scale + 1e-6 if fp32 else diff <= 0.05 * scale and diff < 0.25 * moved
    figures = {"module_logits_dtype": str(run.logits.dtype).removeprefix("torch."), "max_abs_diff": _num(diff)}
    figures |= {"logit_scale": _num(scale), "moved_by_training": _num(moved), "load_problems": problems}
    return {"ok": close and not problems, "figures": figures}


def compare_states(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Exact comparison of two state dicts: keys on one side only, tensors that differ, the largest difference."""
    common = sorted(reference.keys() & other.keys())
    differing = [k for k in common if reference[k].shape != other[k].shape or not torch.equal(reference[k], other[k])]
    largest = max(
        (
            float((reference[k].float() - other[k].float()).abs().max())
            for k in differing
            if reference[k].shape == other[k].shape
        ),
        default=0.0,
    )
    only = {"missing": sorted(reference.keys() - other.keys()), "extra": sorted(other.keys() - reference.keys())}
    equal = not differing and not only["missing"] and not only["extra"]
    return {"equal": equal, "differing": differing[:8], "n_differing": len(differing), "max_abs_diff": largest, **only}


def plain_cpu_draw(ctx: Context) -> dict[str, torch.Tensor]:
    """The tiny model's random initialisation as one plain process draws it on the CPU (same seed)."""
    from gym_lightning.models.loading import build_causal_lm

    pl.seed_everything(SEED, workers=True, verbose=False)
    return {
        k: v.detach().clone() for k, v in build_causal_lm(str(ctx.model_dir), pretrained=False).state_dict().items()
    }


def check_init(ctx: Context) -> dict[str, Any]:
    states: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, str] = {}
    for name in INIT_STRATEGIES:
        try:
            run = fit(ctx, f"init_{name}", name, "32-true", module_kwargs={"pretrained": False}, gather_state=True)
            states[name] = run.initial_state or {}
        except Exception as err:  # one strategy's failure must not hide the others' comparison
            traceback.print_exc()
            errors[name] = f"{type(err).__name__}: {err}"[:500]
    if "gym_ddp" not in states:
        return {"ok": False, "figures": {"errors": errors}, "detail": "gym_ddp's run failed: nothing to compare with"}
    base = states["gym_ddp"]
    figures: dict[str, Any] = {name: compare_states(base, state) for name, state in states.items() if name != "gym_ddp"}
    figures["gym_ddp_vs_plain_cpu_draw"] = compare_states(plain_cpu_draw(ctx), base)
    figures["errors"] = errors
    ok = not errors and all(figures[name]["equal"] for name in states if name != "gym_ddp")
    return {"ok": ok, "figures": figures}


def module_loss_and_grads(ctx: Context, chunking: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """tests/test_loss.py's comparison on the device: tiny Qwen3, 8192-entry vocabulary, chunks of 13."""
    from gym_lightning import CausalLMModule

    shape = {"vocab_size": 8192, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    torch.manual_seed(3)
    module = CausalLMModule(
        "tiny-qwen3", config_overrides=shape, attn_implementation="eager", loss_chunking=chunking, loss_chunk_tokens=13
    )
    module.configure_model()
    module.to(ctx.device)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 8192, (2, 24), generator=generator)
    labels = ids.clone()
    labels[0, :5], labels[1, -7:] = -100, -100  # a masked prompt, right padding
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    batch = {k: v.to(ctx.device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}
    loss = module.engine.token_loss(module.model, batch).loss
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach().cpu(), grads


def check_chunked(ctx: Context, runs: dict[str, Run]) -> dict[str, Any]:
    full_loss, full_grads = module_loss_and_grads(ctx, "off")
    chunked_loss, chunked_grads = module_loss_and_grads(ctx, "on")
    figures: dict[str, Any] = {"loss": closeness(chunked_loss, full_loss, 1e-5, 1e-5)}
    worst = {"close": chunked_grads.keys() == full_grads.keys() and bool(full_grads), "max_abs_diff": 0.0}
    for name, grad in full_grads.items():
        one = closeness(chunked_grads.get(name, torch.full_like(grad, math.nan)), grad, 1e-4, 1e-6)
        worst["close"] = worst["close"] and one["close"]
        worst["max_abs_diff"] = max(worst["max_abs_diff"], one.get("max_abs_diff", math.inf))
    figures["grads"] = worst
    ok = figures["loss"]["close"] and worst["close"]
    chunks = {"loss_chunking": "on", "loss_chunk_tokens": 5}
    run = fit(ctx, "gym_fsdp_chunked", "gym_fsdp", module_kwargs=chunks)
    reference = runs.get("gym_fsdp")
    figures["gym_fsdp_run"] = training_verdict(run, reference, 2e-2)["figures"]
    run_ok = reference is not None and training_verdict(run, reference, 2e-2)["ok"]
    return {"ok": ok and run_ok, "figures": figures}


def check_hook(ctx: Context, runs: dict[str, Run], hook: str) -> dict[str, Any]:
    from gym_lightning import GymDDPStrategy

    options = {"powersgd_start_iter": 2} if hook == "powersgd" else {}  # the earliest torch allows: steps 3-4 compress
    run = fit(ctx, f"ddp_{hook}", GymDDPStrategy(gradient_compression=hook, **options))
    reference = runs.get("gym_ddp")
    verdict = training_verdict(run, reference, TRAIN_TOL)
    verdict["figures"]["registered_hooks"] = run.hooks
    verdict["ok"] = verdict["ok"] and reference is not None and bool(run.hooks)
    return verdict


# --------------------------------------------------------------------------------------------- gym fit of the configs

# The shipped configs that run on one GPU (long_sequence needs 2 ranks to share a sequence; quickstart is CPU-only).
CONFIGS = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "qlora")
QLORA_REFUSAL = (
    "gym_fsdp cannot shard the integer parameters"  # gym_lightning.strategies.fsdp.refuse_integer_parameters
)
PROBE_FILE = "gpu_check_fit_probe.json"
MIN_CONFIG_SECONDS = 10.0  # a fit's least cost on the device (data, set-up, export) before any was measured


@dataclass(frozen=True)
class ConfigRun:
    """One ``gym fit`` of configs/<config>.yaml; ``refusal``: the one line it must end with instead of training."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    refusal: str | None = None


def config_runs(torch_version: str | None = None) -> list[ConfigRun]:
    """The config fits of this torch: qlora under gym_fsdp, or (before torch 2.13) its refusal, then under zero3."""
    from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters

    runs = [ConfigRun(name, name) for name in CONFIGS if name != "qlora"]
    if fsdp2_holds_integer_parameters(torch_version):
        return [*runs, ConfigRun("qlora", "qlora")]
    refused = ConfigRun("qlora", "qlora", refusal=QLORA_REFUSAL)
    return [*runs, refused, ConfigRun("qlora@zero3", "qlora", ("--trainer.strategy", "zero3"))]


class FitProbe(Callback):
    """Appended to each config's callbacks (``--trainer.callbacks+=gpu_check.FitProbe``): writes the steps taken,
    the losses and what ran to ``<default_root_dir>/gpu_check_fit_probe.json`` at the end of fit (the CLI returns
    nothing the check could read)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(float(loss.detach().float()))

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        facts = {"global_step": trainer.global_step, "losses": [round(v, 5) for v in self.losses]}
        facts |= {"strategy": type(trainer.strategy).__name__, "precision": str(trainer.precision)}
        facts["device"] = str(module.device)
        if trainer.is_global_zero:
            (Path(trainer.default_root_dir) / PROBE_FILE).write_text(json.dumps(facts))


class ErrorLines(io.TextIOBase):
    """stderr for the length of one ``gym fit``: passes everything on, keeps the CLI's one-line errors."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.lines = stream, []

    def write(self, text: str) -> int:
        self.lines += [line for line in text.splitlines() if line.startswith("gym_lightning: error:")]
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def fit_argv(ctx: Context, run: ConfigRun, root: Path, qlora_model: Path) -> list[str]:
    """``gym fit`` of the shipped config as a user on one GPU runs it, briefly, writing under ``root``."""
    argv = ["fit", "--config", str(REPO_ROOT / "configs" / f"{run.config}.yaml")]
    argv += ["--trainer.devices", "1", "--trainer.accelerator", "gpu" if ctx.cuda else "cpu"]
    argv += ["--trainer.precision", "bf16-mixed", "--trainer.max_steps", str(config_steps(ctx))]
    argv += ["--trainer.default_root_dir", str(root), "--export.output_dir", str(root / "hf")]
    argv += ["--trainer.callbacks+=gpu_check.FitProbe"]
    if run.config == "qlora":  # its model.model is a hub name, which the device machine cannot reach
        argv += ["--model.model", str(qlora_model)]
    return argv + list(run.overrides)


def config_steps(ctx: Context) -> int:
    return 3 if ctx.cuda else 2


def gym_fit(argv: list[str]) -> tuple[int, list[str]]:
    """``gym fit`` through the command line's own entry point: its exit status and the one-line errors it printed."""
    from gym_lightning.cli import main as gym

    errors = ErrorLines(sys.stderr)
    with contextlib.redirect_stderr(errors):
        try:
            gym(argv)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return code, errors.lines


def check_config(ctx: Context, run: ConfigRun, qlora_model: Path) -> dict[str, Any]:
    root = ctx.work / "configs" / run.name.replace("@", "_")
    argv = fit_argv(ctx, run, root, qlora_model)
    start = time.perf_counter()
    code, errors = gym_fit(argv)
    figures: dict[str, Any] = {"command": "gym " + " ".join(argv), "exit_status": code}
    figures["fit_seconds"] = round(time.perf_counter() - start, 2)
    if run.refusal is not None:  # this torch cannot hold the config's strategy: the refusal is the outcome
        refused = code == 2 and any(run.refusal in line for line in errors)
        figures["expected_refusal"] = errors[-1] if errors else None
        detail = f"expected gym_fsdp's one-line refusal, got exit status {code}: {errors[-1] if errors else 'no error'}"
        return {"ok": refused, "figures": figures} | ({} if refused else {"detail": detail})
    if code != 0:
        return {"ok": False, "figures": figures, "detail": errors[-1] if errors else f"gym fit exited with {code}"}
    probe = json.loads((root / PROBE_FILE).read_text())
    exported = check_config_export(ctx, root / "hf")
    figures |= probe | {"export": exported}
    trained = probe["global_step"] == config_steps(ctx) and all_finite(probe["losses"])
    return {"ok": trained and exported["loads"] and exported["finite_logits"], "figures": figures}


def check_config_export(ctx: Context, folder: Path) -> dict[str, Any]:
    """The end-of-fit export loaded by plain transformers (in the dtype it was saved in): its logits on the probe."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", output_loading_info=True)
    ids = torch.tensor(PROBE) % model.config.vocab_size
    model.to(ctx.device).eval()
    with torch.no_grad():
        logits = model(input_ids=ids.to(ctx.device)).logits.float()
    problems = {k: sorted(v)[:8] for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    finite = bool(torch.isfinite(logits).all())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    del model
    return {"loads": not problems, "load_problems": problems, "dtype": dtype, "finite_logits": finite}


def run_configs(ctx: Context, recorder: Recorder, deadline: float | None) -> None:
    """Every config fit, one after the other in this process; none started that would likely end past ``deadline``
    (seconds since the epoch)."""
    from helpers.families import make_family_folder

    qlora_model = make_family_folder("qwen3", ctx.work / "qwen3_random")  # random bf16 weights + the tokenizer
    slowest = MIN_CONFIG_SECONDS
    for run in config_runs():
        left = math.inf if deadline is None else deadline - time.time()
        if left < slowest:
            recorder.skip(
                f"gym_fit/{run.name}", f"time budget: {left:.0f} s left, the slowest fit took {slowest:.0f} s"
            )
            continue
        start = time.perf_counter()
        recorder.check(f"gym_fit/{run.name}", partial(check_config, ctx, run, qlora_model))
        slowest = max(slowest, time.perf_counter() - start)
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- driver


class Recorder:
    """Runs a check, catching what it raises, and appends its record at once."""

    def __init__(self, out: Path) -> None:
        self.out, self.failed = out, 0

    def check(self, name: str, body: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            verdict = body()
        except Exception as err:  # recorded; the next check still runs
            traceback.print_exc()
            verdict = {"ok": False, "detail": one_line(err)[:2000]}
        record = {"check": name, "ok": bool(verdict["ok"]), "seconds": round(time.perf_counter() - start, 2)}
        record |= {key: verdict[key] for key in ("figures", "detail") if key in verdict}
        if "detail" in record:
            record["detail"] = one_line(str(record["detail"]))
        append_record(self.out, record)
        self.failed += not record["ok"]
        print(f"check {name}: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']:.1f}s", flush=True)

    def skip(self, name: str, why: str) -> None:
        append_record(self.out, {"check": name, "ok": None, "skipped": why, "seconds": 0.0})
        print(f"check {name}: skipped ({why})", flush=True)


def init_process_group(cuda: bool) -> str:
    """One process group of world size 1 for every run of this process (Lightning reuses an initialised one)."""
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if cuda:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=300)
    )
    return backend


STAGES = ("checks", "configs")


def check_names(stages: tuple[str, ...] = STAGES) -> list[str]:
    """Every record this worker writes, in order (tests/gpu and tests/test_benchmarks.py expect each one)."""
    names = []
    if "checks" in stages:
        names += [f"train/{name}" for name, _, _ in TRAIN_RUNS] + ["offload/gym_fsdp", "val_metrics"]
        names += [f"export/{name}" for name, _, _ in TRAIN_RUNS] + ["init_weights", "chunked_loss"]
        names += [f"qlora/{qlora_strategy()}", *(f"ddp_hook/{hook}" for hook in HOOKS)]
    if "configs" in stages:
        names += [f"gym_fit/{run.name}" for run in config_runs()]
    return [*names, "op_builds"]


def run_checks(ctx: Context, recorder: Recorder) -> None:
    runs: dict[str, Run] = {}
    for name, strategy, precision in TRAIN_RUNS:
        recorder.check(f"train/{name}", partial(check_train, ctx, runs, name, strategy, precision))
    recorder.check("offload/gym_fsdp", partial(check_offload, ctx, runs))
    recorder.check("val_metrics", partial(check_val, runs))
    for name, _, _ in TRAIN_RUNS:
        recorder.check(f"export/{name}", partial(check_export, ctx, runs.get(name)))
    recorder.check("init_weights", partial(check_init, ctx))
    recorder.check("chunked_loss", partial(check_chunked, ctx, runs))
    recorder.check(f"qlora/{qlora_strategy()}", partial(check_qlora, ctx, runs))
    for hook in HOOKS:
        recorder.check(f"ddp_hook/{hook}", partial(check_hook, ctx, runs, hook))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines file to append the records to")
    parser.add_argument("--work", type=Path, help="scratch folder (model, exports; default: a temporary one)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every check on the CPU instead of CUDA")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="which checks to run")
    parser.add_argument(
        "--deadline", type=float, help="seconds since the epoch: no config fit starts that would end later"
    )
    args = parser.parse_args()
    import transformers
    from helpers.strategy_worker import save_tiny_pretrained

    from gym_lightning.quiet import quiet_console

    quiet_console()  # as `gym` does: before DeepSpeed is first imported (nothing above imports it)

    for name in ("lightning.pytorch", "lightning.fabric"):  # one "GPU available" banner per Trainer otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # a "Loading weights" bar per export reload otherwise
    op_loads = refuse_jit_builds(CPU_ONLY_OPS if args.cpu_smoke else ())
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    work = args.work or Path(tempfile.mkdtemp(prefix="gym_gpu_check_"))
    recorder = Recorder(args.out)
    print(f"gpu_check: process group {init_process_group(device.type == 'cuda')}, scratch {work}", flush=True)
    ctx = Context(device=device, work=work, model_dir=save_tiny_pretrained(work / "pretrained"))
    if "checks" in args.stages:
        run_checks(ctx, recorder)
    if "configs" in args.stages:
        run_configs(ctx, recorder, args.deadline)
    recorder.check("op_builds", lambda: {"ok": True, "figures": {"loaded": op_loads}})
    torch.distributed.destroy_process_group()
    return 1 if recorder.failed else 0


if __name__ == "__main__":
    sys.exit(main())
