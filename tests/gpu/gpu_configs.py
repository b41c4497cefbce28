"""The user's path on one device (tests/gpu/test_gpu_configs.py): ``gym fit`` of every shipped config that runs on one
GPU, through the command line's own entry point (``gym_lightning.cli.main``) in this process (one import for all).

ddp, fsdp, zero1, zero2, zero3, zero3_offload and qlora (``model.model``: a random-weight Qwen3 folder with the shipped
tokenizer, ``benchmarks.common.models.make_family_folder``; the device machine reaches no hub). Overridden: one device
(``gpu``, ``cpu`` under the CPU smoke), bf16-mixed (the configs' own advice for GPUs), 3 optimizer steps (2 on the
CPU), logs and the export under the scratch folder. ok: the command ended with status 0 after that many steps with
finite losses (``FitProbe``, appended to the config's callbacks, writes them as the training step returns them:
divided by accumulate_grad_batches), and its end-of-fit export loads with ``AutoModelForCausalLM.from_pretrained``
without missing or unexpected keys and gives finite logits. On torch < 2.13 gym_fsdp refuses a 4-bit base in one
line (gym_lightning.strategies.fsdp): ``gym_fit/qlora`` then passes when the command ends with status 2 and that
line, and ``gym_fit/qlora@zero3`` trains the same config with ``--trainer.strategy zero3``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from gpu_runs import PROBE, Context, all_finite
from lightning.pytorch.callbacks import Callback

from benchmarks.common.paths import CONFIGS as CONFIG_DIR

# The shipped configs that run on one GPU (long_sequence needs 2 ranks to share a sequence; quickstart is CPU-only).
CONFIGS = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "qlora")
QLORA_REFUSAL = (
    "gym_fsdp cannot shard the integer parameters"  # gym_lightning.strategies.fsdp.refuse_integer_parameters
)
PROBE_FILE = "gpu_check_fit_probe.json"


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
    """Appended to each config's callbacks (``--trainer.callbacks+=gpu_configs.FitProbe``): writes the steps taken,
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
    argv = ["fit", "--config", str(CONFIG_DIR / f"{run.config}.yaml")]
    argv += ["--trainer.devices", "1", "--trainer.accelerator", "gpu" if ctx.cuda else "cpu"]
    argv += ["--trainer.precision", "bf16-mixed", "--trainer.max_steps", str(config_steps(ctx))]
    argv += ["--trainer.default_root_dir", str(root), "--export.output_dir", str(root / "hf")]
    argv += ["--trainer.callbacks+=gpu_configs.FitProbe"]
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
