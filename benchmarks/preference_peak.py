"""Peak memory per rank of DPO training at 250M on 2 CPU ranks, beside ``gym plan --stage dpo`` (issue 57, item 6).

    python -m benchmarks.preference_peak                        # LoRA and precompute rows, gym_fsdp and zero3
    python -m benchmarks.preference_peak --modes full           # the frozen-copy rows (see below)
    python -m benchmarks.preference_peak --render-only --out /tmp/preference_peak.md

Each run is the real CLI on 2 CPU ranks (``python -m gym_lightning fit --config configs/quickstart.yaml`` with
``--model.objective`` DPO, ``bf16-mixed``, ``--data.format preference``, micro-batch 1 pair: chosen and rejected
rows in one ``[2, T]`` forward, 2 optimizer steps) on ``benchmarks/scale.py``'s random-init 250M Llama folder (built
once under ``--workdir``), with ``benchmarks.qlora_peak.CodeLoadedPeaks``: each rank's peak resident memory per
phase (load, step, save, export) over a baseline taken once the code the load imports is loaded. The planner's
figure is ``planner.phases.phase_peaks`` for the same run (``stage="dpo"``, the mode's reference settings, the
measured baseline as ``host_process_overhead``, ``accelerator="cpu"``: every byte is host memory).

Modes (``--modes``): ``lora`` (LoRA r=16 on every linear layer: the reference is the base with its adapters off,
no second copy); ``precompute`` (full finetune, ``precompute_ref_log_probs``: the reference pass runs at the fit's
start on the policy itself, training holds no reference); ``precompute-lora``; ``full`` (full finetune, a frozen
reference copy held as the strategy holds the policy: sharded by gym_fsdp, partitioned by ZeRO-3). Under gym_fsdp
and zero3 ``full`` needs the strategies' ``protocols.HoldsFrozenModels``; until they implement it the objective
refuses the run and its row says so; ``--strategies gym_ddp --modes full`` runs today (the copy whole per rank).

The precompute pass runs at ``--data.eval_batch_size`` rows (1 pair here, as training): its forward's transient is
not one of the planner's phases.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.models import ensure_folder, folder_of
from benchmarks.qlora_peak import CodeLoadedPeaks
from benchmarks.scale import run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
SIZE = "250m"
STRATEGIES = ("gym_fsdp", "zero3")
PLANNER_KEYS = {"gym_ddp": "ddp", "gym_fsdp": "fsdp_full", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}
PHASES = ("load", "step", "save", "export")
LORA = {"r": 16, "alpha": 32, "target_modules": ["all-linear"]}
# Each mode's objective and adapters, and the planner settings that describe it.
MODES: dict[str, dict[str, Any]] = {
    "lora": {"objective": {"name": "dpo"}, "lora": LORA, "plan": {"lora_r": 16}},
    "precompute": {
        "objective": {"name": "dpo", "precompute_ref_log_probs": True},
        "plan": {"precompute_ref_log_probs": True},
    },
    "precompute-lora": {
        "objective": {"name": "dpo", "precompute_ref_log_probs": True},
        "lora": LORA,
        "plan": {"lora_r": 16, "precompute_ref_log_probs": True},
    },
    "full": {"objective": {"name": "dpo"}, "plan": {}},
}
DEFAULT_MODES = ("lora", "precompute")
TARGET = 0.10  # the issue's: peak per rank within 10 % of the planner
STEPS = 2
MAX_LENGTH = 16  # prompt + completion tokens per row (the rows of a pair are padded to the longer)


class FSDPInitFirstPeaks(CodeLoadedPeaks):
    """``CodeLoadedPeaks`` that initialises FSDP2's root state (its lazy init) at the fit's start, before the
    objective's first forward (``--fsdp-init-first``). A LoRA DPO run's first forward is its reference's, with peft's
    ``disable_adapter`` on, which sets the adapters' ``requires_grad`` to False; FSDP2's lazy init then finds no
    trainable parameter in any group, records no reduce dtype, and the first backward under ``bf16-mixed`` fails
    ("attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float"). A workaround that
    lets the memory be measured until the fix lands; it allocates nothing."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_start(trainer, pl_module)
        from torch.distributed.fsdp import FSDPModule

        root = next((m for m in pl_module.modules() if isinstance(m, FSDPModule)), None)
        if root is not None:
            root._get_fsdp_state()._lazy_init()


def write_pairs(path: Path, count: int = 16) -> Path:
    """``count`` preference records (``prompt``, ``chosen``, ``rejected``) of a few tokens each."""
    rows = [
        {"prompt": f"Q: {i} + {i + 3} =\nA:", "chosen": f" {2 * i + 3}", "rejected": f" {i}{i + 3} or so"}
        for i in range(10, 10 + count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row_length(folder: Path, pairs: Path) -> int:
    """The padded width ``T`` of the runs' batches: the longest row of the data, as the tokenizer cuts it."""
    from gym_lightning.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(folder))
    longest = 0
    for line in pairs.read_text().splitlines():
        record = json.loads(line)
        prompt = len(tokenizer(record["prompt"])["input_ids"])
        for key in ("chosen", "rejected"):
            longest = max(longest, prompt + len(tokenizer(record[key])["input_ids"]))
    return min(longest, MAX_LENGTH)


def fit_command(folder: Path, strategy: str, mode: str, run: Path, pairs: Path, init_first: bool = False) -> list[str]:
    """The CLI fit of one row: DPO on ``pairs`` with ``mode``'s objective and adapters, the phase meter added."""
    meter = "FSDPInitFirstPeaks" if init_first else "CodeLoadedPeaks"
    callback = {
        "class_path": f"benchmarks.preference_peak.{meter}",
        "init_args": {"out": str(run / "phases"), "checkpoint": str(run / "checkpoint")},
    }
    settings = MODES[mode]
    command = [
        sys.executable, "-m", "gym_lightning", "fit", "--config", str(REPO_ROOT / "configs" / "quickstart.yaml"),
        "--trainer.devices", "2", "--trainer.strategy", strategy, "--trainer.precision", "bf16-mixed",
        "--trainer.max_steps", str(STEPS), "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(run),
        f"--trainer.callbacks+={json.dumps(callback)}",
        "--model.model", str(folder), "--model.config_overrides", "null", "--model.val_exact_match", "false",
        "--model.lr", "1e-5", "--model.scheduler", "constant", "--model.objective", json.dumps(settings["objective"]),
        "--data.dataset", "null", "--data.train_files", str(pairs), "--data.format", "preference",
        "--data.max_seq_length", str(MAX_LENGTH), "--data.batch_size", "1", "--data.eval_batch_size", "1",
        "--export.output_dir", str(run / "hf"), "--export.max_shard_size", "500MB",
    ]  # fmt: skip
    if "lora" in settings:
        command += ["--model.lora", json.dumps(settings["lora"])]
    return command


def planned_peaks(folder: Path, strategy: str, mode: str, baseline_mib: float, seq: int) -> dict[str, float]:
    """``planner.phases.phase_peaks`` of the row (host bytes per rank), as ``gym plan --stage dpo`` computes it."""
    from gym_lightning.planner import RunSpec, resolve_shape
    from gym_lightning.planner.phases import phase_peaks
    from gym_lightning.planner.strategies import STRATEGY_BY_KEY

    largest_file = max(f.stat().st_size for f in folder.glob("*.safetensors"))
    spec = RunSpec(
        gpus_per_node=2, accelerator="cpu", micro_batch_size=1, seq_length=seq, precision="bf16-mixed",
        host_process_overhead=int(baseline_mib * MIB), checkpoint_file_bytes=largest_file, stage="dpo",
        lora_targets="all-linear", **MODES[mode]["plan"],
    )  # fmt: skip
    peaks = phase_peaks(resolve_shape(str(folder)), STRATEGY_BY_KEY[PLANNER_KEYS[strategy]], spec).by_phase()
    return {phase: peak.host for phase, peak in peaks.items()}


def refusal(log: Path) -> str | None:
    """Why a run failed, from its log: the objective's refusal (a sharding strategy without HoldsFrozenModels),
    else the last error line."""
    lines = (log.read_text() if log.exists() else "").splitlines()
    found = [line for line in lines if "HoldsFrozenModels" in line] or [line for line in lines if "Error" in line]
    return found[-1].strip()[:200].replace("|", "/") if found else None


def render(results: dict[str, Any], workdir: Path) -> str:
    """The markdown table: one row per strategy, mode and phase, and each row's peak per rank against the planner."""
    lines = [
        "| strategy | mode | phase | measured r0 / r1, MiB | planner, MiB | error | within 10 % |",
        "|---|---|---|---|---|---|---|",
    ]
    folder = folder_of(workdir, SIZE)
    for key, result in results.items():
        strategy, mode = key.split("/")
        mode += " (FSDP init first)" if result.get("fsdp_init_first") else ""
        if "ranks" not in result:
            why = result.get("refused") or f"failed (exit {result.get('failed')})"
            lines.append(f"| {strategy} | {mode} | — | {why} | | | owed |")
            continue
        baseline = max(r["baseline"] for r in result["ranks"])
        planned = planned_peaks(folder, strategy, key.split("/")[1], baseline, result["seq"])
        overall = []
        for phase in PHASES:
            peaks = [r[phase]["peak"] for r in result["ranks"] if phase in r]
            plan = planned[phase] / MIB
            error = max(abs(p - plan) / p for p in peaks)
            overall.append((max(peaks), plan))
            shown = " / ".join(f"{p:,.0f}" for p in peaks)
            lines.append(
                f"| {strategy} | {mode} | {phase} | {shown} | {plan:,.0f} | {error:.1%} | "
                f"{'yes' if error <= TARGET else 'no'} |"
            )
        measured, plan = max(m for m, _ in overall), max(p for _, p in overall)
        error = abs(measured - plan) / measured
        lines.append(
            f"| {strategy} | {mode} | **peak** | {measured:,.0f} | {plan:,.0f} | {error:.1%} | "
            f"{'yes' if error <= TARGET else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(PLANNER_KEYS))
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES))
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gym-scale")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from earlier results")
    parser.add_argument(
        "--fsdp-init-first",
        action="store_true",
        help="gym_fsdp LoRA rows: initialise FSDP2 before the first (adapters-off) forward (FSDPInitFirstPeaks)",
    )
    args = parser.parse_args()
    results_file = args.workdir / "preference_results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if not args.render_only:
        folder = ensure_folder(args.workdir, SIZE)
        pairs = write_pairs(args.workdir / "pairs.jsonl")
        seq = row_length(folder, pairs)
        for strategy in args.strategies:
            for mode in args.modes:
                name = f"dpo-{SIZE}-{strategy}-{mode}"
                print(f"{name} ...", file=sys.stderr, flush=True)
                init_first = args.fsdp_init_first and strategy == "gym_fsdp" and "lora" in MODES[mode]
                command = fit_command(folder, strategy, mode, args.workdir / "runs" / name, pairs, init_first)
                result = {**run_cli(args.workdir, name, command, STEPS, seq), "fsdp_init_first": init_first}
                if "failed" in result and (why := refusal(args.workdir / f"{name}.log")):
                    result["refused"] = why
                results[f"{strategy}/{mode}"] = result
                results_file.write_text(json.dumps(results, indent=1))
    table = render({k: v for k, v in results.items() if k.split("/")[1] in MODES}, args.workdir)
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
