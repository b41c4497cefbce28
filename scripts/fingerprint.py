"""A behaviour fingerprint of gym_lightning: exact per-step losses and per-tensor hashes of the exports, recorded
before a restructuring and compared after it (the two must be bit-identical).

    # before: the old tree first on the path (its tests/helpers and configs are used too)
    PYTHONPATH=/tmp/base_tree python scripts/fingerprint.py --out /tmp/fp_base.json \\
        --keep-checkpoints /tmp/old_ckpts --workdir /tmp/fp_work
    # after: the working tree, resuming from the checkpoints the old code wrote (--resume-from, never
    # --keep-checkpoints /tmp/old_ckpts: that would replace them with the new code's)
    python scripts/fingerprint.py --out /tmp/fp_new.json --resume-from /tmp/old_ckpts --workdir /tmp/fp_work
    python scripts/fingerprint.py --compare /tmp/fp_base.json /tmp/fp_new.json   # exit 1 on any difference

Parts (``--parts``, default all three):

- ``families``: the family matrix of ``tests/models/test_families.py`` (its ``matrix``: every family x gym_ddp,
  gym_fsdp, zero3 x the same full/LoRA selection), each run the test's YAML (``helpers.families.family_run_config``:
  2 steps, bf16-mixed, 2 CPU ranks, one ``torchrun`` launch per strategy) plus the ``StepLosses`` callback
  (``scripts/fingerprint_probe.py``). The llama full run also writes its step-2 checkpoint.
- ``resume``: for each strategy, ``gym fit`` from a checkpoint kept by ``--keep-checkpoints`` (``--resume-from``, or
  the one just kept) to step 4; its losses and export are fingerprinted like the others.
- ``scale``: ``benchmarks.scale``'s 250M runs (its folder, its CLI command, its 2 steps of 1 x 4 tokens, its
  strategies: gym_ddp, gym_fsdp, zero1, zero2, zero3), the ``PhasePeaks`` callback replaced by ``StepLosses``.

Recorded per run: every rank's loss per step (``training_step``'s return and the logged ``train/loss``) as
``float.hex``, the sha256 of every tensor of the end-of-fit export(s) (``hf``, and ``hf-adapter`` for LoRA) and of
their other files (config, index, tokenizer), of the logits the families' ``LogitsProbe`` saved, and of the source
model folders' tensors. Which ``gym_lightning`` each rank
imported is recorded too (``meta.imported``) but not compared.

The code under test is the tree ``gym_lightning`` is imported from here (``PYTHONPATH``): its ``configs/`` and
``tests/helpers`` are used, and every child process gets that tree first on its path.

``--keep-checkpoints DIR`` leaves, per strategy, ``DIR/<strategy>/checkpoints/step-00000002.ckpt`` (the tiny llama
full run after 2 steps), ``DIR/llama-folder`` (its model) and ``DIR/<strategy>/resume.yaml``. To resume one by hand
with any version of the code (2 CPU ranks; the YAML carries ``ckpt_path`` and trains to step 4)::

    python -m gym_lightning fit --config DIR/gym_fsdp/resume.yaml --trainer.default_root_dir /tmp/resumed \\
        --export.output_dir /tmp/resumed/hf
    # or, explicitly: ... --config DIR/gym_fsdp/resume.yaml --ckpt_path DIR/gym_fsdp/checkpoints/step-00000002.ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

import gym_lightning

SCRIPTS = Path(__file__).resolve().parent  # fingerprint_probe.py (``StepLosses``)
# This checkout's benchmarks, after the tree under test: a tree that has its own ``benchmarks`` package (with an
# ``__init__.py``) uses its own, an older one (a plain folder, which never shadows a package) this checkout's.
sys.path.append(str(SCRIPTS.parent))

from benchmarks import scale  # noqa: E402
from benchmarks.common.models import SIZES, ensure_folder  # noqa: E402
from benchmarks.common.paths import CONFIGS  # noqa: E402

# The tree under test: where gym_lightning was imported from (PYTHONPATH=/tmp/base_tree gives the old one).
CODE_ROOT = Path(gym_lightning.__file__).resolve().parents[1]
FAMILY_STRATEGIES = ("gym_ddp", "gym_fsdp", "zero3")
RESUME_STEPS = 4
PROBE = "fingerprint_probe.StepLosses"
KEPT = ("llama", 0)  # the run whose step-2 checkpoint --keep-checkpoints keeps
CHECKPOINT = "step-00000002.ckpt"
LAUNCH_TIMEOUT = 3 * 3600


def child_pythonpath() -> str:
    """The tree under test, its tests/ (the helpers) and scripts/ (``StepLosses``), in that order."""
    return os.pathsep.join([str(CODE_ROOT), str(CODE_ROOT / "tests"), str(SCRIPTS)])


def setup_paths() -> None:
    """Import ``helpers`` from the tree under test, and give every child process the same path."""
    sys.path.insert(0, str(CODE_ROOT / "tests"))
    sys.path.insert(1, str(SCRIPTS))
    os.environ["PYTHONPATH"] = child_pythonpath()  # helpers.dist.rank_env puts its REPO_ROOT first: the same tree


# ----------------------------------------------------------------------------------------------------- hashing
def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_digest(tensor: Any) -> str:
    """``dtype shape sha256`` of a tensor's raw bytes."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} {sha(raw.numpy().tobytes())}"


def folder_hashes(folder: Path) -> dict[str, str]:
    """Every tensor of a Hugging Face folder's safetensors files, by name (one tensor in memory at a time)."""
    from safetensors import safe_open

    hashes: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                hashes[name] = tensor_digest(handle.get_tensor(name))
    return dict(sorted(hashes.items()))


def logits_hashes(path: Path) -> dict[str, str]:
    """The ``LogitsProbe`` file: each tensor's digest, anything else as text."""
    import torch

    saved = torch.load(path, weights_only=True)
    return {k: tensor_digest(v) if isinstance(v, torch.Tensor) else str(v) for k, v in sorted(saved.items())}


def text_sha(path: Path, workdir: Path) -> str:
    """sha256 of a file with ``workdir`` written as ``<workdir>`` (an adapter config names its base model's folder)."""
    return sha(path.read_bytes().replace(str(workdir).encode(), b"<workdir>"))


def run_record(run: Path, workdir: Path) -> dict[str, Any]:
    """What one finished run left: each rank's step losses, the export hashes, the logits' hashes (``workdir``: the
    folder whose path is left out of the hashes of text files)."""
    ranks = [json.loads(p.read_text()) for p in sorted((run / "losses").glob("rank*.json"))]
    record: dict[str, Any] = {
        "losses": [r["steps"] for r in ranks],
        "imported": sorted({r["gym_lightning"] for r in ranks}),
        "export": folder_hashes(run / "hf"),
    }
    if (run / "hf-adapter").is_dir():
        record["adapter"] = folder_hashes(run / "hf-adapter")
    exports = [run / "hf", run / "hf-adapter"]  # their other files too: config.json, index, tokenizer, adapter config
    record["files"] = {
        f"{p.parent.name}/{p.name}": text_sha(p, workdir)
        for folder in exports
        for p in sorted(folder.glob("*"))
        if p.is_file() and p.suffix != ".safetensors"
    }
    if (run / "logits.pt").exists():
        record["logits"] = logits_hashes(run / "logits.pt")
    for config in sorted(run.glob("*.yaml")):  # not compared: a note when the helpers wrote another YAML
        record["config_sha256"] = text_sha(config, workdir)
    return record


def probe_callback(run: Path) -> dict[str, Any]:
    return {"class_path": PROBE, "init_args": {"out": str(run / "losses")}}


def add_probe(config: Path, run: Path) -> None:
    """Append ``StepLosses`` to the trainer callbacks of a YAML written by the test helpers."""
    data = yaml.safe_load(config.read_text())
    data["trainer"]["callbacks"].append(probe_callback(run))
    config.write_text(yaml.safe_dump(data, sort_keys=False))


# ---------------------------------------------------------------------------------------------------- families
def test_families_module() -> Any:
    """``tests/models/test_families.py`` of the tree under test (for its ``matrix``), loaded from its file."""
    path = CODE_ROOT / "tests" / "models" / "test_families.py"
    spec = importlib.util.spec_from_file_location("fingerprint_test_families", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def family_folders(workdir: Path) -> dict[str, Path]:
    """The tiny folders of every family, built once under ``workdir/families`` (seeded: rebuilt identically)."""
    from helpers.families import FAMILIES, make_family_folder

    folders = {}
    for family in FAMILIES:
        folder = workdir / "families" / family
        if not (folder / "config.json").exists():
            shutil.rmtree(folder, ignore_errors=True)
            make_family_folder(family, folder)
        folders[family] = folder
    return folders


def run_name(family: str, lora: int) -> str:
    return f"{family}-{'lora' if lora else 'full'}"


def family_strategy(strategy: str, folders: dict[str, Path], workdir: Path) -> dict[str, Any]:
    """One launch of 2 ranks training every ``(family, lora)`` of ``matrix(strategy)``; their records by name."""
    from helpers.cli_runs import fit_in_one_launch
    from helpers.families import family_run_config

    base = workdir / "runs" / "families" / strategy
    shutil.rmtree(base, ignore_errors=True)
    runs = {(f, lora): base / run_name(f, lora) for f, lora in test_families_module().matrix(strategy)}
    configs = []
    for (family, lora), out in runs.items():
        config = family_run_config(
            family, strategy, bool(lora), folders[family], out, checkpoints=(family, lora) == KEPT
        )
        add_probe(config, out)
        configs.append(config)
    start = time.perf_counter()
    try:
        fit_in_one_launch(configs, timeout=LAUNCH_TIMEOUT)
    except AssertionError as failed:
        return {f"families/{strategy}/*": {"failed": str(failed)[-4000:]}}
    print(f"families {strategy}: {len(configs)} runs in {time.perf_counter() - start:.0f} s", flush=True)
    return {f"families/{strategy}/{run_name(f, lora)}": run_record(out, workdir) for (f, lora), out in runs.items()}


def copy_path(source: Path, target: Path) -> None:
    """Copy a checkpoint: a file (DDP) or a folder (FSDP, DeepSpeed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True)
    else:
        shutil.copy2(source, target)


def keep_checkpoint(strategy: str, folders: dict[str, Path], workdir: Path, keep: Path) -> None:
    """Copy the llama full run's step-2 checkpoint and its model to ``keep``; write ``resume.yaml`` beside it."""
    run = workdir / "runs" / "families" / strategy / run_name(*KEPT)
    if not (keep / "llama-folder").exists():
        shutil.copytree(folders["llama"], keep / "llama-folder")
    target = keep / strategy
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    copy_path(run / "checkpoints" / CHECKPOINT, target / "checkpoints" / CHECKPOINT)
    shutil.copy2(run / "run.yaml", target / "run.yaml")
    config = yaml.safe_load((run / "run.yaml").read_text())
    trainer = config["trainer"]
    # Only the shipped callbacks: the test probes live outside the package; no checkpoints on the way to step 4.
    trainer["callbacks"] = [c for c in trainer["callbacks"] if c["class_path"].startswith("gym_lightning.")]
    trainer["callbacks"] = [c for c in trainer["callbacks"] if not c["class_path"].endswith("StepCheckpoint")]
    trainer.update(max_steps=RESUME_STEPS, enable_checkpointing=False, default_root_dir=str(target / "resumed"))
    config["model"].update(model=str(keep / "llama-folder"), tokenizer=str(keep / "llama-folder"))
    config["export"]["output_dir"] = str(target / "resumed" / "hf")
    config["ckpt_path"] = str(target / "checkpoints" / CHECKPOINT)
    header = f"# python -m gym_lightning fit --config {target / 'resume.yaml'}  (resumes the base code's step 2)\n"
    (target / "resume.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))


def families_part(args: argparse.Namespace) -> dict[str, Any]:
    """Every strategy's family matrix; with ``--keep-checkpoints``, also the kept checkpoints."""
    folders = family_folders(args.workdir)
    records: dict[str, Any] = {f"folders/{f}": {"export": folder_hashes(p)} for f, p in folders.items()}
    for strategy in args.strategies:
        records.update(family_strategy(strategy, folders, args.workdir))
        if args.keep_checkpoints and f"families/{strategy}/*" not in records:
            keep_checkpoint(strategy, folders, args.workdir, args.keep_checkpoints)
    return records


# ------------------------------------------------------------------------------------------------------ resume
def resume_part(args: argparse.Namespace) -> dict[str, Any]:
    """``gym fit`` of each kept ``resume.yaml`` (from step 2 to 4), outputs redirected under the workdir."""
    from helpers.cli_runs import fit_in_one_launch

    kept = args.resume_from or args.keep_checkpoints
    runs, configs = {}, []
    for strategy in args.strategies:
        source = kept / strategy / "resume.yaml"
        if not source.exists():
            continue
        out = args.workdir / "runs" / "resume" / strategy
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        config = yaml.safe_load(source.read_text())
        config["trainer"]["default_root_dir"] = str(out)
        config["export"]["output_dir"] = str(out / "hf")
        config["trainer"]["callbacks"].append(probe_callback(out))
        (out / "resume.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        runs[f"resume/{strategy}"], configs = out, [*configs, out / "resume.yaml"]
    if not configs:
        return {}
    try:
        fit_in_one_launch(configs, timeout=LAUNCH_TIMEOUT)
    except AssertionError as failed:
        return {"resume/*": {"failed": str(failed)[-4000:]}}
    return {name: run_record(out, args.workdir) for name, out in runs.items()}


# ------------------------------------------------------------------------------------------------------- scale
def scale_folder(workdir: Path, size: str) -> Path:
    """``benchmarks.scale``'s model folder, built once (in a child process, with the tree under test's path)."""
    return ensure_folder(workdir, size, CODE_ROOT)


def scale_command(folder: Path, strategy: str, run: Path, args: argparse.Namespace) -> list[str]:
    """``scale.fit_command`` with the tree under test's quickstart YAML and ``StepLosses`` instead of ``PhasePeaks``."""
    command = scale.fit_command(folder, strategy, run, args.steps, args.seq)
    quickstart = str(CONFIGS / "quickstart.yaml")
    command = [str(CODE_ROOT / "configs" / "quickstart.yaml") if part == quickstart else part for part in command]
    return [f"--trainer.callbacks+={json.dumps(probe_callback(run))}" if "PhasePeaks" in p else p for p in command]


def scale_part(args: argparse.Namespace) -> dict[str, Any]:
    """One CLI run per strategy at ``args.size`` (outputs deleted after hashing; logs kept in the workdir)."""
    folder = scale_folder(args.workdir, args.size)
    records: dict[str, Any] = {f"folders/{args.size}": {"export": folder_hashes(folder)}}
    for strategy in args.scale_strategies or scale.STRATEGIES[args.size]:
        name = f"scale/{args.size}/{strategy}"
        run = args.workdir / "runs" / "scale" / f"{args.size}-{strategy}"
        shutil.rmtree(run, ignore_errors=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
        start = time.perf_counter()
        done = subprocess.run(
            scale_command(folder, strategy, run, args), env=env, cwd=CODE_ROOT, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        log = args.workdir / f"scale-{args.size}-{strategy}.log"
        log.write_text(done.stdout + done.stderr)
        print(f"{name}: rc {done.returncode} in {seconds:.0f} s (log {log})", flush=True)
        records[name] = run_record(run, args.workdir) if done.returncode == 0 else {"failed": done.stderr[-4000:]}
        records[name]["seconds"] = round(seconds)
        shutil.rmtree(run, ignore_errors=True)
    return records


# ----------------------------------------------------------------------------------------------------- compare
def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when two run records are identical (losses, exports, logits); else where they first differ."""
    if "failed" in a or "failed" in b:
        return "a run failed: " + ("A" if "failed" in a else "B")
    losses_a, losses_b = a.get("losses", []), b.get("losses", [])  # model folders have none
    if len(losses_a) != len(losses_b):
        return f"ranks: {len(losses_a)} vs {len(losses_b)}"
    for rank, (steps_a, steps_b) in enumerate(zip(losses_a, losses_b, strict=True)):
        for index, (x, y) in enumerate(zip(steps_a, steps_b, strict=False)):
            if x != y:
                return f"rank {rank} batch {index} (global step {x['global_step']}): {x} vs {y}"
        if len(steps_a) != len(steps_b):
            return f"rank {rank}: {len(steps_a)} vs {len(steps_b)} batches"
    for kind in ("export", "adapter", "logits", "files"):
        ha, hb = a.get(kind, {}), b.get(kind, {})
        for name in sorted(ha.keys() | hb.keys()):
            if ha.get(name) != hb.get(name):
                return f"{kind} {name}: {ha.get(name)} vs {hb.get(name)}"
    return None


def compare(path_a: Path, path_b: Path) -> int:
    """Print each run's verdict; 1 if anything differs or is missing on one side."""
    a, b = (json.loads(p.read_text())["runs"] for p in (path_a, path_b))
    differences = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            print(f"{name}: only in {'A' if name in a else 'B'}")
            differences += 1
            continue
        found = first_difference(a[name], b[name])
        differences += found is not None
        note = " (the run's YAML differs)" if a[name].get("config_sha256") != b[name].get("config_sha256") else ""
        print(f"{name}: {'identical' if found is None else 'DIFFERS: ' + found}{note}")
    print(f"{len(a.keys() | b.keys())} runs, {differences} different")
    return 1 if differences else 0


# -------------------------------------------------------------------------------------------------------- main
def meta() -> dict[str, Any]:
    import torch

    head = subprocess.run(["git", "-C", str(CODE_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"code_root": str(CODE_ROOT), "head": head.stdout.strip(), "torch": torch.__version__,
            "argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="the fingerprint JSON to write")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two fingerprints")
    parser.add_argument("--parts", nargs="+", default=["families", "resume", "scale"],
                        choices=["families", "resume", "scale"])  # fmt: skip
    parser.add_argument("--strategies", nargs="+", default=list(FAMILY_STRATEGIES), help="family matrix / resume")
    parser.add_argument("--scale-strategies", nargs="+", help="default: every strategy benchmarks.scale runs")
    parser.add_argument("--size", default="250m", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=2, help="scale runs' optimizer steps (scale.py's default)")
    parser.add_argument("--seq", type=int, default=4, help="scale runs' tokens per row (scale.py's default)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp_work"))
    parser.add_argument("--keep-checkpoints", type=Path, help="keep each strategy's step-2 llama checkpoint here")
    parser.add_argument("--resume-from", type=Path, help="resume from checkpoints kept earlier (resume part)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        raise SystemExit("--out FILE (or --compare A B) is required")
    setup_paths()
    args.workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"meta": meta(), "seconds": {}, "runs": {}}
    parts = {"families": families_part, "resume": resume_part, "scale": scale_part}
    for part in args.parts:
        if part == "resume" and not (args.resume_from or args.keep_checkpoints):
            continue
        start = time.perf_counter()
        result["runs"].update(parts[part](args))
        result["seconds"][part] = round(time.perf_counter() - start)
        imported = sorted({i for r in result["runs"].values() for i in r.get("imported", [])})
        result["meta"]["imported"] = imported
        args.out.write_text(json.dumps(result, indent=1))
        print(f"{part}: {result['seconds'][part]} s; gym_lightning imported from {imported}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
