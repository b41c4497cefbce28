"""DPO step time of gym_lightning against TRL 1.16's DPOTrainer: same model, data, settings and strategy class, side
by side (issue 57, item 7).

    python -m benchmarks.dpo_speed                              # 2 CPU processes each, ~12 min on a 2-core machine
    python -m benchmarks.dpo_speed --repeats 5 --steps 12 --out /tmp/dpo_speed.md
    python -m benchmarks.dpo_speed --device cuda --nproc 1 --precision bf16 --hidden 2048 --layers 16  # a GPU row

Each run is a fresh launch of ``--nproc`` processes training DPO (sigmoid, beta 0.1, a frozen reference copy of the
policy: the full-finetune case, where a second model runs) on ``--pairs`` preference pairs of equal token length:

* gym_lightning: ``python -m gym_lightning fit`` with ``--trainer.strategy gym_ddp`` (torch DDP over gloo on CPU
  ranks), ``model.objective: {name: dpo, ref_model: FOLDER}``, ``data.format: preference``;
* TRL: ``torchrun`` of this file's ``--role trl``: ``DPOTrainer(model=FOLDER, ref_model=<the folder loaded again>)``
  with ``use_cpu`` on CPU ranks, which accelerate runs as its multi-CPU DDP (``DistributedType.MULTI_CPU``, gloo;
  at ``--nproc 1`` too, where accelerate, launched by torchrun, still wraps the policy in a 1-rank DDP while
  gym_ddp leaves the module unwrapped at world size 1);
* gym_lightning SFT: the same fit with the default (SFT) objective on the same 2B rows per micro-batch (each pair's
  prompt + chosen and prompt + rejected as two ``prompt_completion`` records, ``--data.batch_size 2B``): the policy's
  forward and backward over the concatenated batch alone. DPO over SFT is then what the reference's forward adds
  (about 1.33 expected for a forward beside a forward and a backward of twice its cost; a second policy pass would
  show about 1.67).

All three: fp32 on CPU (``--precision``), ``--batch`` pairs per process and micro-batch (chosen and rejected rows in one
forward), no accumulation, AdamW (torch's fused kernel), constant learning rate, no gradient clipping, dropout off,
no checkpoints, no evaluation, logging rare. A callback in each times every optimizer step on rank 0 from the end of
the previous one, after a barrier (the step ends when the slower rank's does), and records the width of the batch
the model saw. The runs rotate (gym, TRL, SFT, then TRL, SFT, gym, ...) ``--repeats`` times; each run's figure is
the median of its steps after ``--warmup``; the ratios (gym / TRL, gym DPO / gym SFT) are per repeat and their
median overall. The machine's other load slows the runs of a repeat alike; report the median ratios, not absolute
times.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from benchmarks.common.launch import child_env, free_port
from benchmarks.common.paths import REPO_ROOT
from benchmarks.common.records import measured_or_saved

# A Llama decoder on the shipped tokenizer (21M fp32 parameters at the defaults, a 512 vocabulary): big enough
# that the model's compute, not the loop, dominates a CPU step, small enough for ~1 s steps on one core.
DEFAULT_SHAPE = {"hidden": 512, "layers": 6, "heads": 8}


# ---------------------------------------------------------------------------------------------------------------
# timing callbacks (one per framework)


class GymStepTimer(pl.Callback):
    """Every optimizer step's seconds on rank 0 (after a barrier, from the end of the previous step) and the width of
    the first batch, written to ``out`` at the end of training.

    Args:
        out: JSON file rank 0 writes ``{"steps": [...], "cpu": [...], "shape": [rows, width]}`` to (``cpu``: rank
            0's process CPU seconds per step, which other processes' load on the machine changes less).
    """

    def __init__(self, out: str) -> None:
        self.out, self.steps, self.cpu, self.shape, self._last = Path(out), [], [], None, None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        if self.shape is None:
            self.shape = list(batch["input_ids"].shape)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.strategy.barrier()
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.steps.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"steps": self.steps, "cpu": self.cpu, "shape": self.shape}))


def trl_timer() -> Any:
    """The same timer as a transformers ``TrainerCallback`` (``on_step_end``: after the optimizer step)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    class TRLStepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.cpu: list[float] = []
            self._last: tuple[float, float] | None = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            now = (time.perf_counter(), time.process_time())
            if self._last is not None:
                self.steps.append(now[0] - self._last[0])
                self.cpu.append(now[1] - self._last[1])
            self._last = now

    return TRLStepTimer()


# ---------------------------------------------------------------------------------------------------------------
# inputs


def build_folder(folder: Path, shape: dict[str, int]) -> Path:
    """A random-init Llama of ``shape`` with the shipped tokenizer, saved in fp32 (built once; not
    ``benchmarks.common.models``' bf16 folders: both frameworks then load the same fp32 weights with no cast)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gym_lightning.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    h = shape["hidden"]
    config = AutoConfig.for_model(
        "llama", hidden_size=h, intermediate_size=3 * h, num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"], vocab_size=len(tokenizer),
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def write_pairs(path: Path, folder: Path, count: int, prompt_words: int, answer_words: int) -> tuple[Path, Path]:
    """``count`` pairs whose prompts, chosen and rejected answers are each a fixed number of words that the folder's
    tokenizer keeps as one token each, so that every row, and every batch, has the same width in both frameworks;
    and beside them (``<path>.sft.jsonl``) the same rows as SFT records, a pair's two rows in a row."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [f" {w}" for w in letters if len(tokenizer(f" {w}", add_special_tokens=False)["input_ids"]) == 1]
    draw, rows = random.Random(0), []
    for _ in range(count):
        prompt, chosen = draw.choices(words, k=prompt_words), draw.choices(words, k=answer_words)
        rejected = (
            chosen[1:] + chosen[:1] if len(set(chosen)) > 1 else [w for w in words if w != chosen[0]][:1] * answer_words
        )
        rows.append({"prompt": "".join(prompt), "chosen": "".join(chosen), "rejected": "".join(rejected)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sft = [{"prompt": r["prompt"], "completion": r[key]} for r in rows for key in ("chosen", "rejected")]
    sft_path = path.with_suffix(".sft.jsonl")
    sft_path.write_text("".join(json.dumps(row) + "\n" for row in sft))
    return path, sft_path


# ---------------------------------------------------------------------------------------------------------------
# the two launches


def gym_command(
    args: argparse.Namespace, folder: Path, pairs: Path, run: Path, out: Path, sft: Path | None = None
) -> list[str]:
    """gym_lightning's DPO fit under gym_ddp (``--nproc`` processes); with ``sft`` (the SFT records), the SFT fit
    over the same rows, ``2 x --batch`` per micro-batch."""
    callback = {"class_path": "benchmarks.dpo_speed.GymStepTimer", "init_args": {"out": str(out)}}
    objective = {"name": "dpo", "beta": 0.1, "ref_model": str(folder)}
    data = ["--data.format", "preference", "--data.batch_size", str(args.batch)]
    if sft is not None:
        objective, data = (
            {"name": "sft"},
            ["--data.format", "prompt_completion", "--data.batch_size", str(2 * args.batch)],
        )
    precision = "bf16-mixed" if args.precision == "bf16" else "32-true"
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    return [
        sys.executable, "-m", "gym_lightning", "fit", "--trainer.accelerator", accelerator,
        "--trainer.devices", str(args.nproc), "--trainer.strategy", "gym_ddp", "--trainer.precision", precision,
        "--trainer.max_steps", str(args.warmup + args.steps + 1), "--trainer.max_epochs", "-1",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.log_every_n_steps", "1000", "--trainer.default_root_dir", str(run),
        f"--trainer.callbacks+={json.dumps(callback)}", "--seed_everything", "0",
        "--model.model", str(folder), "--model.objective", json.dumps(objective), "--model.lr", "1e-6",
        "--model.scheduler", "constant", "--model.weight_decay", "0.0", "--model.val_exact_match", "false",
        "--data.train_files", str(sft or pairs), *data, "--data.max_seq_length", "1024", "--data.seed", "0",
    ]  # fmt: skip


def trl_command(args: argparse.Namespace, folder: Path, pairs: Path, run: Path, out: Path) -> list[str]:
    """TRL's DPOTrainer under ``torchrun`` (accelerate reads the launcher's environment: multi-CPU DDP on CPU); its
    settings travel in one JSON file (torchrun's parser would take options it abbreviates, such as ``--run``)."""
    spec = {"folder": str(folder), "pairs": str(pairs), "run": str(run), "out": str(out), "batch": args.batch,
            "max_steps": args.warmup + args.steps + 1, "device": args.device, "precision": args.precision}  # fmt: skip
    path = run.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
        str(free_port()), "-m", "benchmarks.dpo_speed", "--trl-spec", str(path),
    ]  # fmt: skip


def trl_role(spec_file: Path) -> None:
    """One TRL process (under torchrun): DPOTrainer on the folder with a reference loaded from it."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    spec = json.loads(spec_file.read_text())
    torch.manual_seed(0)
    cpu, bf16 = spec["device"] == "cpu", spec["precision"] == "bf16"
    data = datasets.load_dataset("json", data_files=spec["pairs"], split="train")
    config = DPOConfig(
        output_dir=spec["run"], per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
        max_steps=spec["max_steps"], learning_rate=1e-6, lr_scheduler_type="constant", weight_decay=0.0,
        optim="adamw_torch_fused", max_grad_norm=0.0, beta=0.1, loss_type=["sigmoid"], max_length=1024, use_cpu=cpu,
        bf16=bf16, ddp_backend="gloo" if cpu else None, report_to="none", save_strategy="no", logging_steps=1000,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, data_seed=0,
    )  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.bfloat16 if bf16 else torch.float32)
    timer = trl_timer()
    trainer = DPOTrainer(
        model=spec["folder"],
        ref_model=reference,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(spec["folder"]),
        callbacks=[timer],
    )
    shapes: list[list[int]] = []
    compute_loss = trainer.compute_loss

    def recording(model: Any, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
        if not shapes:
            shapes.append(list(inputs["input_ids"].shape))
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = recording  # type: ignore[method-assign]
    trainer.train()
    if trainer.is_world_process_zero():
        kind = str(trainer.accelerator.distributed_type)
        Path(spec["out"]).write_text(
            json.dumps({"steps": timer.steps, "cpu": timer.cpu, "shape": shapes[0], "distributed": kind})
        )


def run_once(kind: str, command: list[str], out: Path, log: Path, warmup: int) -> dict[str, Any]:
    """One launch; its timed steps' median (after ``warmup``), the batch shape, its wall time."""
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(command, env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not out.exists():
        print(f"{kind} failed (rc {done.returncode}): {done.stderr[-3000:]}", file=sys.stderr)
        return {"failed": done.returncode, "wall": wall}
    found = json.loads(out.read_text())
    timed, cpu = found["steps"][warmup:], found.get("cpu", [])[warmup:]
    return {
        **found,
        "median": statistics.median(timed),
        "cpu_median": statistics.median(cpu) if cpu else None,
        "wall": wall,
    }


# ---------------------------------------------------------------------------------------------------------------
# driver


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the inputs, then alternate the two launches ``--repeats`` times."""
    args.workdir.mkdir(parents=True, exist_ok=True)
    shape = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads}
    folder = build_folder(args.workdir / f"llama-{args.hidden}x{args.layers}", shape)
    pairs, sft = write_pairs(args.workdir / "pairs.jsonl", folder, args.pairs, args.prompt_words, args.answer_words)
    kinds = ("gym", "trl", "sft")
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        for kind in kinds[repeat % 3 :] + kinds[: repeat % 3]:
            run, out = args.workdir / "runs" / kind, args.workdir / f"{kind}_steps.json"
            shutil.rmtree(run, ignore_errors=True)
            if kind == "trl":
                command = trl_command(args, folder, pairs, run, out)
            else:
                command = gym_command(args, folder, pairs, run, out, sft if kind == "sft" else None)
            result = run_once(kind, command, out, args.workdir / f"{kind}.log", args.warmup)
            runs[kind].append(result)
            print(f"repeat {repeat} {kind}: {result.get('median')} s/step {result.get('shape')}", file=sys.stderr)
    return {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs}


def _shape(run: dict[str, Any]) -> str:
    return " x ".join(map(str, run["shape"])) if "shape" in run else "-"


def render(figures: dict[str, Any]) -> str:
    """The markdown lines: per repeat the three medians and the two ratios, then the median ratios."""
    runs, settings = figures["runs"], figures["settings"]
    lines = [
        "| repeat | gym DPO s/step | TRL DPO s/step | gym SFT s/step (2B rows) | gym / TRL | gym DPO / gym SFT "
        "| batch rows x width (gym / TRL / SFT) |",
        "|---|---|---|---|---|---|---|",
    ]
    versus_trl, versus_sft = [], []
    for i, (gym, trl, sft) in enumerate(zip(runs["gym"], runs["trl"], runs["sft"], strict=True)):
        shown = [f"{r['median']:.3f}" if "median" in r else "failed" for r in (gym, trl, sft)]
        ratios = ["", ""]
        if "median" in gym and "median" in trl:
            versus_trl.append(gym["median"] / trl["median"])
            ratios[0] = f"{versus_trl[-1]:.3f}"
        if "median" in gym and "median" in sft:
            versus_sft.append(gym["median"] / sft["median"])
            ratios[1] = f"{versus_sft[-1]:.3f}"
        shapes = " / ".join(_shape(r) for r in (gym, trl, sft))
        lines.append(f"| {i} | {' | '.join(shown)} | {' | '.join(ratios)} | {shapes} |")
    medians = {
        k: statistics.median(done) for k, v in runs.items() if (done := [r["median"] for r in v if "median" in r])
    }
    lines.append(
        f"| **median** | {medians.get('gym', 0):.3f} | {medians.get('trl', 0):.3f} | {medians.get('sft', 0):.3f} | "
        f"**{statistics.median(versus_trl) if versus_trl else float('nan'):.3f}** | "
        f"**{statistics.median(versus_sft) if versus_sft else float('nan'):.3f}** | |"
    )
    lines.append(
        f"\n{settings['nproc']} process(es) per launch on {settings['device']}, {settings['precision']}, "
        f"{settings['batch']} pairs per process and step, a {settings['hidden']} x {settings['layers']} Llama; "
        f"TRL's accelerate state: {next((r.get('distributed') for r in runs['trl'] if 'distributed' in r), '?')}; "
        f"medians of {settings['steps']} steps after {settings['warmup']} per launch."
    )
    lines += _cpu_lines(runs)
    return "\n".join(lines) + "\n"


def _cpu_lines(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Rank 0's CPU seconds per step: per repeat the three medians and the two ratios, then their medians."""
    rows = list(zip(runs["gym"], runs["trl"], runs["sft"], strict=True))
    if not any(all(r.get("cpu_median") for r in row) for row in rows):
        return []
    lines = [
        "\nRank 0's CPU seconds per step (process time; other processes' load changes it less than wall time):\n",
        "| repeat | gym DPO CPU s | TRL DPO CPU s | gym SFT CPU s | gym / TRL | gym DPO / gym SFT |",
        "|---|---|---|---|---|---|",
    ]
    versus_trl, versus_sft = [], []
    for i, (gym, trl, sft) in enumerate(rows):
        if not all(r.get("cpu_median") for r in (gym, trl, sft)):
            continue
        versus_trl.append(gym["cpu_median"] / trl["cpu_median"])
        versus_sft.append(gym["cpu_median"] / sft["cpu_median"])
        shown = " | ".join(f"{r['cpu_median']:.3f}" for r in (gym, trl, sft))
        lines.append(f"| {i} | {shown} | {versus_trl[-1]:.3f} | {versus_sft[-1]:.3f} |")
    lines.append(
        f"| **median** | | | | **{statistics.median(versus_trl):.3f}** | **{statistics.median(versus_sft):.3f}** |"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-spec", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=2, help="processes per launch (one per CPU core or GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch", type=int, default=4, help="pairs per process and step")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two launches")
    parser.add_argument("--pairs", type=int, default=256, help="preference pairs in the data")
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--answer-words", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=DEFAULT_SHAPE["hidden"])
    parser.add_argument("--layers", type=int, default=DEFAULT_SHAPE["layers"])
    parser.add_argument("--heads", type=int, default=DEFAULT_SHAPE["heads"])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-dpo-speed")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (and .json beside it)")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from --out's JSON")
    args = parser.parse_args()
    if args.trl_spec is not None:
        return trl_role(args.trl_spec)
    json_out = (args.out or args.workdir / "report.md").with_suffix(".json")
    figures = measured_or_saved(json_out, lambda: measure(args), args.render_only)
    report = render(figures)
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
