"""The device checks' runs (tests/gpu): one ``Trainer.fit`` of a tiny Llama per strategy on one device, and the
checks that compare them. Each ``check_*`` returns a verdict ``{"ok", "figures" | "detail"}``, which a test records
(``check`` fixture, tests/gpu/conftest.py) and asserts.

A tiny Llama (2 layers, hidden 32, HF's own initialisation saved as a pretrained folder) and the variable-length,
partly masked token rows of tests/helpers/strategy_worker.py (24 for training, 8 for validation). No DeepSpeed op is
built: torch optimizers only. Tolerances compare ``|a - b| <= atol + rtol * |b|``, as ``torch.testing.assert_close``
does. What each check decides:

- ``train/<run>``: ``fp32_reference`` (one device, 32-true), then gym_ddp, gym_fsdp, zero1, zero2, zero3 in
  bf16-mixed: 4 optimizer steps (2 epochs of 3 micro-batches, accumulation 2), every micro-batch loss finite and
  within rtol = atol = 5e-2 of the reference's (bf16 keeps ~3 significant digits).
- ``offload/gym_fsdp``: ``GymFSDPStrategy(cpu_offload=True)`` trains so too and, on CUDA, the local tensor of every
  sharded parameter is on the host after setup (on CPU ranks cpu_offload is a documented no-op).
- ``val_metrics``: val/loss and val/ppl as CausalLMModule logs them: before training (the sanity pass over the whole
  validation set) every run's val/loss within rtol 1e-2 of the fp32 reference's, after training within 5e-2;
  val/ppl == exp(val/loss) to 1e-4 in every pass.
- ``export/<run>``: HFExport's folder (float32) reloaded with ``AutoModelForCausalLM.from_pretrained`` gives the
  trained module's logits on a fixed batch: to 1e-4 of their scale where the module computes in fp32; in bf16,
  within 5 % of their scale and under a quarter of how far the four steps moved them (an untrained export fails).
- ``init_weights``: ``pretrained=False``, same seed, 32-true: the full state dict at on_fit_start of gym_fsdp,
  zero1, zero2, zero3 equals gym_ddp's exactly, and gym_ddp's equals one plain process's CPU draw.
- ``chunked_loss``: loss_chunking on vs off, the same summed loss and gradients (fp32 on the device: 1e-5 / 1e-4),
  and a gym_fsdp bf16-mixed run with the chunked loss within 2e-2 of the unchunked one.
- ``qlora/<strategy>``: a 4-bit NF4 base (blocks of 32) with LoRA on q/v in bf16-mixed within 5e-2 of the same run
  in fp32, its merged export reloaded as above; gym_fsdp, or zero3 before torch 2.13 (FSDP2 cannot hold the base).
- ``ddp_hook/<fp16|bf16|powersgd>``: ``GymDDPStrategy(gradient_compression=...)`` registers its DDP hook and trains,
  finite and within 5e-2 of gym_ddp.
"""

from __future__ import annotations

import gc
import json
import math
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.strategy_worker import TokenDataset, collate_tokens, same_order_sampler
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Subset

from benchmarks.common.records import one_line

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


class Observer(Callback):
    """Fills a :class:`Run`: losses, validation metrics, placement, hooks, initial state, probe logits."""

    def __init__(self, run: Run, gather_state: bool) -> None:
        self.run, self.gather_state = run, gather_state

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

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.run.losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("val/loss", "val/ppl")}
        self.run.val.append({"sanity": trainer.sanity_checking, **metrics})

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.run.logits = probe_logits(module.model, module.device)


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
    """``train_rows`` training rows in StepTokenDataLoader batches of 8 (same order on every strategy), 8 validation
    rows."""

    def __init__(self, train_rows: int = TRAIN_ROWS) -> None:
        super().__init__()
        self.train_rows = train_rows

    def train_dataloader(self) -> DataLoader:
        from gym_lightning.data.loader import StepTokenDataLoader

        rows = Subset(TokenDataset(self.train_rows + VAL_ROWS), range(self.train_rows))
        return StepTokenDataLoader(
            rows,
            batch_size=8,
            sampler=same_order_sampler(self.trainer, rows),
            collate_fn=collate_tokens,
            accumulate_grad_batches=self.trainer.accumulate_grad_batches,
        )

    def val_dataloader(self) -> DataLoader:
        rows = Subset(TokenDataset(self.train_rows + VAL_ROWS), range(self.train_rows, self.train_rows + VAL_ROWS))
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
    callbacks: list[Callback] = [Observer(run, gather_state)]
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
    ok = run.global_step == 4 and all_finite(run.losses)
    if reference is not None:
        figures["vs_reference"] = closeness(run.losses, reference.losses, tol, tol)
        ok = ok and figures["vs_reference"]["close"]
    return {"ok": ok, "figures": figures}


class Check:
    """What a test hands its check to (the ``check`` fixture): ``check(name, body)`` records the check's name, runs
    ``body`` (a verdict, or a function returning one: its error is then recorded under the name too) and records the
    verdict's figures and detail (pytest's user properties: tests/gpu/conftest.py writes them to
    ``GYM_GPU_RECORDS``), then asserts that it is ok; ``check.skip(name, why)`` records the name and skips."""

    def __init__(self, record_property: Callable[[str, Any], None]) -> None:
        self.record = record_property

    def __call__(self, name: str, body: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        self.record("check", name)
        verdict = body() if callable(body) else body
        for key in ("figures", "detail"):
            if key in verdict:
                self.record(key, verdict[key])
        assert verdict["ok"], json.dumps({k: v for k, v in verdict.items() if k != "ok"}, default=str)[:4000]

    def skip(self, name: str, why: str) -> None:
        self.record("check", name)
        pytest.skip(why)


# --------------------------------------------------------------------------------------------- the runs, once each


class Runs:
    """The training runs the checks compare, each fitted once, when a check first asks for it (so any subset of the
    tests can run); a run that failed raises its error again for every check that asks for it."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.done: dict[str, Run] = {}
        self.failed: dict[str, str] = {}

    def __call__(self, name: str) -> Run:
        if name in self.failed:
            raise RuntimeError(f"the {name} run failed earlier: {self.failed[name]}")
        if name not in self.done:
            try:
                self.done[name] = self._fit(name)
            except Exception as err:
                traceback.print_exc()
                self.failed[name] = one_line(err)[:500]
                raise
        return self.done[name]

    def get(self, name: str) -> Run | None:
        """``name``'s run, or ``None`` when it fails (the caller reports it)."""
        try:
            return self(name)
        except Exception:
            return None

    def _fit(self, name: str) -> Run:
        if name == "gym_fsdp_offload":
            from gym_lightning import GymFSDPStrategy

            return fit(self.ctx, name, GymFSDPStrategy(cpu_offload=True))
        strategy, precision = next((s, p) for n, s, p in TRAIN_RUNS if n == name)
        return fit(self.ctx, name, strategy, precision, export=True)


# --------------------------------------------------------------------------------------------- checks


def check_train(runs: Runs, name: str) -> dict[str, Any]:
    run = runs(name)
    if name == "fp32_reference":
        return training_verdict(run, None, TRAIN_TOL)
    reference = runs.get("fp32_reference")
    if reference is None:
        return {"ok": False, "detail": "the fp32 reference run failed (see train/fp32_reference)"}
    return training_verdict(run, reference, TRAIN_TOL)


def check_offload(ctx: Context, runs: Runs) -> dict[str, Any]:
    run, reference = runs("gym_fsdp_offload"), runs.get("fp32_reference")
    verdict = training_verdict(run, reference, TRAIN_TOL)
    verdict["ok"] = verdict["ok"] and reference is not None
    figures = verdict["figures"]
    figures["placement_after_setup"], figures["process_group_backend"] = run.placement, run.backend
    if (fsdp := runs.get("gym_fsdp")) is not None:
        figures["vs_gym_fsdp"] = closeness(run.losses, fsdp.losses, TRAIN_TOL, TRAIN_TOL)
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


def check_qlora(ctx: Context) -> dict[str, Any]:
    """QLoRA under gym_fsdp (zero3 before torch 2.13) in bf16-mixed (the base dequantised to bf16 on the device,
    bitsandbytes' kernel where it is installed, plain torch otherwise) against the same run in fp32, then its merged
    export reloaded."""
    strategy = qlora_strategy()
    settings = {"lora": QLORA_LORA, "quantization": {"block_size": 32, "compute_dtype": "float32"}}
    reference = fit(ctx, "qlora_fp32", strategy, "32-true", settings)
    settings = {**settings, "quantization": {"block_size": 32, "compute_dtype": "bfloat16"}}
    run = fit(ctx, "qlora", strategy, "bf16-mixed", settings, export=True)
    verdict = training_verdict(run, reference, TRAIN_TOL)
    exported = check_export(ctx, run)
    verdict["figures"]["export"] = exported["figures"]
    return {**verdict, "ok": verdict["ok"] and exported["ok"]}


def val_passes(run: Run) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The sanity pass (before training) and the last validation after training of ``run``."""
    sanity = next((v for v in run.val if v["sanity"] and "val/loss" in v), None)
    final = next((v for v in reversed(run.val) if not v["sanity"] and "val/loss" in v), None)
    return sanity, final


def check_val(runs: Runs) -> dict[str, Any]:
    names = [name for name, _, _ in TRAIN_RUNS] + ["gym_fsdp_offload"]
    reference = runs.get("fp32_reference")
    if reference is None or None in val_passes(reference):
        return {"ok": False, "detail": "no validation metrics from the fp32 reference run"}
    ref_sanity, ref_final = val_passes(reference)
    figures, ok = {}, True
    for name in names:
        run = runs.get(name)
        if run is None:
            figures[name], ok = "training run failed", False
            continue
        sanity, final = val_passes(run)
        if sanity is None or final is None:
            figures[name], ok = f"val/loss not logged: {run.val}", False
            continue
        row = {"before": sanity, "after": final}
        row["before_vs_reference"] = closeness(sanity["val/loss"], ref_sanity["val/loss"], VAL_TOL, 0.0)
        row["after_vs_reference"] = closeness(final["val/loss"], ref_final["val/loss"], VAL_FINAL_TOL, 0.0)
        row["ppl_is_exp_loss"] = all(
            math.isclose(p["val/ppl"], math.exp(p["val/loss"]), rel_tol=1e-4) for p in (sanity, final)
        )
        close = row["before_vs_reference"]["close"] and row["after_vs_reference"]["close"]
        ok = ok and close and row["ppl_is_exp_loss"]
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


def check_chunked(ctx: Context, runs: Runs) -> dict[str, Any]:
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


def check_hook(ctx: Context, runs: Runs, hook: str) -> dict[str, Any]:
    from gym_lightning import GymDDPStrategy

    options = {"powersgd_start_iter": 2} if hook == "powersgd" else {}  # the earliest torch allows: steps 3-4 compress
    run = fit(ctx, f"ddp_{hook}", GymDDPStrategy(gradient_compression=hook, **options))
    reference = runs.get("gym_ddp")
    verdict = training_verdict(run, reference, TRAIN_TOL)
    verdict["figures"]["registered_hooks"] = run.hooks
    verdict["ok"] = verdict["ok"] and reference is not None and bool(run.hooks)
    return verdict
