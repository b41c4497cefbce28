"""The benchmarks are a package that runs: every module answers ``--help`` (or imports, where it is a library), every
command the docs cite names one, and the figures turn into the documented markdown (fake figures here).

No timing is asserted here: the benchmarks measure, these tests only keep their plumbing from rotting.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from benchmarks.common.launch import child_env
from benchmarks.common.paths import BENCH_DIR as BENCH
from benchmarks.common.paths import REPO_ROOT


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def run_py() -> ModuleType:
    return _load("run")


@pytest.fixture(scope="module")
def gpu_bench() -> ModuleType:
    return _load("workers.gpu_bench")


@pytest.fixture(scope="module")
def gpu_results() -> ModuleType:
    return _load("gpu_results")


def _modules() -> dict[str, bool]:
    """Every module of the package, ``benchmarks.x`` -> whether it runs as a command (``if __name__ ==
    "__main__"``); found on disk, so that a benchmark another branch adds is checked too."""
    found = {}
    for path in sorted(BENCH.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if parts[-1] != "__init__" and "results" not in parts:
            found[".".join(parts)] = 'if __name__ == "__main__":' in path.read_text()
    return found


MODULES = _modules()
ENTRY_POINTS = [name for name, runs in MODULES.items() if runs]
LIBRARIES = [name for name, runs in MODULES.items() if not runs]
# The benchmarks the docs cite, and those other branches added, by name: discovery must not have lost them.
NAMED = ["run", "scale", "host_syncs", "routed_forward_speed", "compiled_ddp", "zero3_rule", "expert_forward_peak"]
NAMED += ["plan_published", "plan_validate", "workers.gpu_bench", "gpu_results", "quickstart_seeds", "verdicts"]
NAMED += ["exit_loop", "dpo_speed", "preference_peak", "dpo_real_size"]
DOCS = [REPO_ROOT / "docs" / "benchmarks.md", REPO_ROOT / "docs" / "planner.md", REPO_ROOT / "README.md"]
DOCS.append(BENCH / "README.md")


@pytest.fixture(scope="module")
def helps() -> dict[str, Any]:
    """``python -m MODULE --help`` of every entry point and ``python -m MODULE`` of every library (an import), each
    in its own process (``helpers.forked``: the shared imports paid once)."""
    from helpers.forked import run_forked

    commands = [["-m", name, "--help"] for name in ENTRY_POINTS] + [["-m", name] for name in LIBRARIES]
    results = run_forked(commands, timeout=600)
    return dict(zip(ENTRY_POINTS + LIBRARIES, results, strict=True))


def test_the_named_benchmarks_are_found() -> None:
    assert {f"benchmarks.{name}" for name in NAMED} <= set(ENTRY_POINTS) and "benchmarks.plan_rows" in LIBRARIES


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_help(module: str, helps: dict[str, Any]) -> None:
    done = helps[module]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


@pytest.mark.parametrize("module", LIBRARIES)
def test_library_module_imports(module: str, helps: dict[str, Any]) -> None:
    done = helps[module]
    assert done.returncode == 0 and not done.stdout, done.stdout[-1000:] + done.stderr[-2000:]


def test_no_benchmark_edits_sys_path_or_imports_the_tests() -> None:
    """``python -m benchmarks.x`` from the repository root is how a benchmark runs (benchmarks/README.md): no
    ``sys.path`` edits, and nothing imported from ``tests`` (the tests import from here)."""
    offenders = []
    for path in BENCH.rglob("*.py"):
        text = path.read_text()
        if re.search(r"sys\.path\.(insert|append)|^\s*(from|import) (tests|helpers)\b", text, re.MULTILINE):
            offenders.append(str(path.relative_to(REPO_ROOT)))
    assert not offenders


def test_ports_are_picked_in_one_place() -> None:
    """A free port comes from ``benchmarks.common.launch.free_port`` (``spawn_gloo``, ``torchrun_command``): no
    benchmark binds a socket of its own to pick one."""
    launch = BENCH / "common" / "launch.py"
    offenders = [
        str(path.relative_to(REPO_ROOT))
        for path in BENCH.rglob("*.py")
        if path != launch and re.search(r"def free_port\b|socket\.socket\(", path.read_text())
    ]
    assert not offenders


def test_every_command_the_docs_cite_runs() -> None:
    """Each ``python -m benchmarks.X`` in the docs names an entry point; the old ``python benchmarks/X.py`` form
    (which needs the repository on the path) is gone from them."""
    cited, old = set(), []
    for doc in DOCS:
        text = doc.read_text()
        cited |= set(re.findall(r"python -m (benchmarks(?:\.[a-z_0-9]+)+)\b", text))
        old += [f"{doc.name}: {m}" for m in re.findall(r"python benchmarks/\S+\.py", text)]
    assert cited and not cited - set(ENTRY_POINTS), cited - set(ENTRY_POINTS)
    assert not old


def test_gpu_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def _gpu_sh(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = ["bash", str(BENCH / "gpu.sh"), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.parametrize("args", [["--part", "bogus"], ["--part"], ["--cpu-smoke", "--fast"]])
def test_gpu_script_refuses_unknown_arguments(args: list[str]) -> None:
    done = _gpu_sh(args)
    assert done.returncode == 2 and "usage: bash benchmarks/gpu.sh" in done.stderr, done.stdout + done.stderr


def test_gpu_script_help_names_the_parts() -> None:
    done = _gpu_sh(["--help"])
    assert done.returncode == 0 and "--part checks" in done.stdout and "--part bench" in done.stdout


def test_gpu_script_bench_part_over_budget(tmp_path: Path) -> None:
    """``--part bench`` alone, its time budget already spent: every run is one skip record, no checks file, and the
    other part's JSON lines in the folder are left alone (a local run of one part after the other)."""
    out = tmp_path / "out"
    (out / "gpu").mkdir(parents=True)
    (out / "gpu" / "checks.jsonl").write_text('{"check": "train/gym_ddp", "ok": true}\n')
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GYM_WHEELS": str(tmp_path / "no_wheels")}
    env |= {"GPU_WORK_DIR": str(tmp_path / "work"), "GPU_BENCH_S": "1"}
    done = _gpu_sh(["--cpu-smoke", "--part", "bench"], env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu" / "results.json").read_text())
    assert results["meta"]["parts"] == "bench"
    assert [c["check"] for c in results["checks"]] == ["train/gym_ddp"]  # the earlier checks part's, kept
    groups = _load("workers.gpu_bench").SMOKE_GROUPS
    assert set(results["runs"]) == {name for group in ("rounds", "warm") for name in groups[group][1]}
    assert all(run["skipped"].startswith("time budget") for run in results["runs"].values())
    assert [r.get("skipped", "")[:11] for r in results["routed"]] == ["time budget"]  # the routed group's record


def test_lightning_deepspeed_is_told_the_micro_batch(gpu_bench: ModuleType) -> None:
    """Lightning's DeepSpeedStrategy otherwise reads ``batch_sampler.batch_size`` of the ready-batch loader, which
    has none (the first device run failed so)."""
    strategy = gpu_bench.make_strategy("lightning_deepspeed", 4)
    assert strategy.config["train_micro_batch_size_per_gpu"] == 4
    assert strategy.config["zero_optimization"]["stage"] == 3


def test_baselines_train_on_the_gym_runs_tokens(gpu_bench: ModuleType) -> None:
    import torch

    from benchmarks.workers.dist_bench import make_batches

    args = SimpleNamespace(batch_size=2, seq_len=16, steps=3, warmup=1)
    ours = gpu_bench.token_ids(args, vocab=512)
    theirs = make_batches(vars(args), rank=0, vocab=512)
    assert len(ours) == len(theirs) == 4
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(ours, theirs, strict=True))


def test_dist_worker_imports() -> None:
    worker = _load("workers.dist_bench")
    assert set(worker.KINDS) >= {"gym_zero", "ds_engine", "gym_fsdp", "fsdp2", "ddp", "ddp_nosync", "single"}


def test_ratio_cell_and_summary(run_py: ModuleType) -> None:
    assert run_py.summary([1000.0, 3000.0, 2000.0]) == "2,000 (1,000-3,000)"
    same = [[0.1] * 8, [0.2] * 8]  # two repeats of 8 steps; both sides alike: every bootstrap sample gives 1
    assert run_py.ratio_cell(same, same) == "**1.000** [1.000, 1.000] ✅"
    # ours takes 0.11 s where the peer takes 0.10 s: tokens/s ratio 0.909, below 0.95 with no noise at all
    assert run_py.ratio_cell([[0.11] * 8] * 3, [[0.10] * 8] * 3) == "**0.909** [0.909, 0.909] ❌"
    assert run_py.ratio_cell([[0.11] * 8] * 3, [[0.10] * 8] * 3, target=None) == "**0.909** [0.909, 0.909]"


def test_speed_ratio_interval_covers_the_noise_and_is_reproducible(run_py: ModuleType) -> None:
    import random

    rng = random.Random(1)
    ours = [[0.100 + rng.uniform(-0.02, 0.02) for _ in range(30)] for _ in range(5)]
    peer = [[0.098 + rng.uniform(-0.02, 0.02) for _ in range(30)] for _ in range(5)]
    ratio, low, high = run_py.speed_ratio(ours, peer)
    assert low < ratio < high and high - low > 0.01  # jitter of +-20% per step: not a point
    assert run_py.speed_ratio(ours, peer) == (ratio, low, high)  # seeded: the same timings, the same interval
    # A repeat that ran slow on both sides (another job's burst) moves both medians alike.
    slow = [[2 * t for t in ours[0]]], [[2 * t for t in peer[0]]]
    assert run_py.speed_ratio(*slow)[0] == pytest.approx(run_py.speed_ratio([ours[0]], [peer[0]])[0])


def test_paired_steps_cancel_a_drift_both_sides_share(run_py: ModuleType) -> None:
    # Within each run the machine slows from 50 to 100 ms per step, on both sides alike (they step alternately);
    # ours is 2 % slower at every step, with +-1 % jitter of its own.
    import random

    rng = random.Random(2)
    peer = [[0.05 + 0.05 * k / 59 for k in range(60)] for _ in range(4)]
    ours = [[1.02 * t * (1 + rng.uniform(-0.01, 0.01)) for t in run] for run in peer]
    _, low, high = run_py.speed_ratio(ours, peer, paired_steps=True)
    _, unpaired_low, unpaired_high = run_py.speed_ratio(ours, peer)
    assert low < 1 / 1.02 < high and high - low < 0.02
    assert high - low < (unpaired_high - unpaired_low) / 5  # drawn apart, the drift blurs the medians
    # Each pair's ratio is taken first: a step both sides ran slow (another job's burst) is one ordinary pair.
    burst = [[t * (3 if k % 7 == 0 else 1) for k, t in enumerate(run)] for run in peer]
    burst_ours = [[t * 1.02 * (3 if k % 7 == 0 else 1) for k, t in enumerate(run)] for run in peer]
    assert run_py.speed_ratio(burst_ours, burst, paired_steps=True)[0] == pytest.approx(1 / 1.02)
    # Steps of 50-150 ms that both sides of a pair share, +-3 % jitter of each side's own: the median of the pair
    # ratios is resolved to ~1 % (interval width 0.020 here); the medians of each side, even with the same step
    # indices drawn for both (this function before 1 Dec 2026), gave a width of 0.051 on these timings.
    shocks = [[rng.uniform(0.05, 0.15) for _ in range(30)] for _ in range(4)]
    shared_peer = [[t * (1 + rng.uniform(-0.03, 0.03)) for t in run] for run in shocks]
    shared_ours = [[1.02 * t * (1 + rng.uniform(-0.03, 0.03)) for t in run] for run in shocks]
    _, low, high = run_py.speed_ratio(shared_ours, shared_peer, paired_steps=True)
    assert low < 1 / 1.02 < high and high - low < 0.03
    with pytest.raises(ValueError, match="as many steps"):
        run_py.speed_ratio(ours, [run[:-1] for run in peer], paired_steps=True)


def test_fit_and_plain_step_alternately_on_the_same_batches(tmp_path: Path) -> None:
    """benchmarks/fit_vs_plain.paired_run: both sides time every step from the warm-up on, and see the batches
    their fingerprint names (a plain loop fed other batches raises)."""
    from gym_lightning.models.loading import build_causal_lm

    fit_vs_plain = _load("fit_vs_plain")

    args = fit_vs_plain.argparse.Namespace(dataset="addition", batch_size=8, seed=0)
    init, dm = build_causal_lm("tiny-llama"), fit_vs_plain.make_datamodule(args)
    tokens, fingerprint = fit_vs_plain.timed_tokens(dm, 2, 4)
    plain, fit = fit_vs_plain.paired_run(init, dm, 2, 4, str(tmp_path), fingerprint)
    assert len(plain) == len(fit) == 4 and min(plain + fit) > 0 and tokens > 0
    with pytest.raises(RuntimeError, match="different batches"):
        fit_vs_plain.paired_run(init, dm, 2, 4, str(tmp_path), [fingerprint[0] + 1])


def test_verdict_needs_the_whole_interval_on_one_side(run_py: ModuleType) -> None:
    assert run_py.verdict(0.96, 0.99, 0.95) == "✅"
    assert run_py.verdict(0.90, 0.949, 0.95) == "❌"
    assert run_py.verdict(0.94, 0.97, 0.95) == "≈"  # median may be above the target: still undecided


def test_strategy_runs_pair_each_wrapper_with_its_peer_in_one_run(run_py: ModuleType) -> None:
    settings = run_py.Settings(**{**run_py.QUICK.__dict__, "repeats": 2})
    runs = run_py.strategy_runs(settings, ["zero3", "fsdp"])
    kinds = [(r["name"], r["kind"], r["peer"]) for r in runs]
    assert kinds == [("zero3", "gym_zero", "ds_engine"), ("fsdp", "gym_fsdp", "fsdp2")] * 2
    zero = [r for r in runs if r["name"] == "zero3"]
    assert all(r["ds_config"] == zero[0]["ds_config"] for r in zero)
    assert zero[0]["ds_config"]["zero_optimization"]["stage"] == 3


def test_document_with_fake_numbers(run_py: ModuleType, tmp_path: Path) -> None:
    report = run_py.Report(run_py.QUICK, ["python", "-m", "benchmarks.run", "--quick"])
    rows = [["zero3", "a", "b", run_py.ratio_cell([[1 / 0.97] * 4], [[1.0] * 4])]]
    report.sections["strategies"] = run_py.markdown_table(["comparison", "gym", "peer", "ratio"], rows)
    report.sections["gpu"] = run_py.gpu_section(tmp_path / "missing.json")
    text = run_py.document(report)
    assert "## Machine" in text and "Load average" in text and "`python -m benchmarks.run --quick`" in text
    assert "| zero3 | a | b | **0.970** [0.970, 0.970] ✅ |" in text
    assert "**Not run yet.**" in text


def _fake_gpu_results(gpu_bench: ModuleType, folder: Path) -> None:
    """checks.jsonl, bench.jsonl and routed.jsonl as benchmarks/gpu.sh's parts append them (one failure of each
    kind): two interleaved rounds of plain / gym_fsdp, a cold and a warm compile, zero3 beside Lightning's
    DeepSpeed, two host-sync cells, the routed forward at one size."""
    for record in (
        {"check": "train/gym_fsdp", "ok": True, "seconds": 3.2, "figures": {"global_step": 4, "losses": [3.4]}},
        {"check": "init_weights", "ok": False, "seconds": 5.0, "detail": "RuntimeError: boom | here"},
        {"check": "host_syncs/zero3/bf16-mixed", "ok": True, "seconds": 2.0, "figures": {
            "per_quiet_step": 3.0, "by_owner": {"deepspeed": 1.0, "gym_lightning": 1.0, "transformers": 1.0},
            "quiet_steps": [2, 3], "counted_by": "the census", "gym_lightning_allowed": 1}},
        {"check": "host_syncs/zero3/16-mixed", "ok": None, "seconds": 0.0, "skipped": "CUDA only"},
    ):  # fmt: skip
        gpu_bench.append_record(folder / "checks.jsonl", record)
    routed = {"routed_experts": 8, "ratio": 2.0, "ratio_min": 2.5, "max_abs_diff": {"out": 0.0}, "device": "cuda"}
    routed |= {
        v: {"median_s": s, "min_s": s, "syncs": {"read: tolist": 1}} for v, s in (("per-expert", 0.2), ("grouped", 0.1))
    }
    gpu_bench.append_record(folder / "routed.jsonl", {"key": "tiny/64", "ok": True, **routed})
    fake = [  # name, round, tokens/s, MFU, peak GiB, compile s
        ("plain", 1, 1000.0, 0.40, 50, 2.0),
        ("gym_fsdp", 1, 990.0, 0.39, 40, 2.5),
        ("plain", 2, 1200.0, 0.48, 50, 2.0),
        ("gym_fsdp", 2, 1140.0, 0.45, 40, 2.5),
        ("gym_fsdp_compiled", 1, 1400.0, 0.56, 45, 40.0),
        ("gym_fsdp_compiled_warm", 1, 1410.0, 0.56, 45, 10.0),
        ("gym_zero3", 1, 800.0, 0.32, 48, 3.0),
        ("lightning_deepspeed", 1, 500.0, 0.20, 60, 3.0),
    ]
    for name, round_, tps, mfu, gib, compile_s in fake:
        record = {"strategy": name, "round": round_, "ok": True, "tokens_per_sec": tps, "mfu": mfu}
        record |= {"peak_memory_bytes": gib * 2**30, "clock_tokens_per_sec": tps, "compile_seconds": compile_s}
        record |= {"predicted_peak_bytes": 50 * 2**30, "planner_strategy": "fsdp_full"}
        gpu_bench.append_record(folder / "bench.jsonl", record)
    gpu_bench.append_record(folder / "bench.jsonl", {"strategy": "gym_zero1", "ok": False, "error": "OOM"})
    gpu_bench.append_record(folder / "bench.jsonl", {"strategy": "gym_fsdp_liger", "ok": None, "skipped": "no liger"})
    with (folder / "bench.jsonl").open("a") as stream:
        stream.write('{"strategy": "gym_zero2')  # the line a kill cut off: skipped when read


def test_gpu_results_render(run_py: ModuleType, gpu_bench: ModuleType, gpu_results: ModuleType, tmp_path: Path) -> None:
    _fake_gpu_results(gpu_bench, tmp_path)
    payload = gpu_results.collect(tmp_path, {"seq_len": 2048})
    assert payload["failed"] == ["init_weights", "bench/gym_zero1"]
    runs = payload["runs"]
    assert list(runs) == [name for name in gpu_bench.STRATEGIES if name in runs]  # the table's order
    assert "gym_zero2" not in runs and "hf_trainer" not in runs  # no record, no row
    assert runs["gym_fsdp"]["tokens_per_sec"] == pytest.approx(1065.0) and runs["gym_fsdp"]["rounds"] == [990, 1140]
    assert runs["gym_zero1"]["error"] == "OOM" and runs["gym_fsdp_liger"]["skipped"] == "no liger"
    assert runs["gym_fsdp_compiled_warm"]["compile_vs_cold"] == pytest.approx(0.25)
    assert runs["gym_zero3"]["vs_peer"]["tokens_per_sec"] == pytest.approx(1.6)
    text = run_py.gpu_section(tmp_path / "results.json")
    assert "seq_len: 2048" in text
    assert "| train/gym_fsdp | ✅ | 3.2 | 4 steps |" in text
    assert "| init_weights | ❌ | 5.0 | RuntimeError: boom / here |" in text
    # rounds paired by number: 990 / 1000 and 1140 / 1200, median 0.97: undecided against the 0.98 bar
    row = "| gym_fsdp | 2 | 1,065 (990-1,140) | **0.970** (0.950-0.990) (>= 0.98) ≈ | 42.0% | 40.0 GiB | 0.800 |"
    assert row + " 50.0 GiB (fsdp_full), 0.800 |  |  |" in text
    # a run of one round (later in the bench) against the plain loop's median, 1,100
    assert "| gym_fsdp_compiled | 1 | 1,400 | **1.273** (>= 1.3) ❌ | 56.0% | 45.0 GiB | 0.900 (<= 1.0) ✅ |" in text
    assert "| 40.0 (<= 60 s) ✅ |" in text and "| 10.0, 0.25 of cold (<= 0.33) ✅ |" in text
    assert "| 50.0 GiB (fsdp_full), 0.960 (within 5%) ✅ |" in text  # zero3's peak beside the planner's
    assert "| lightning_deepspeed: 1.600 (>= 1.5) ✅; peak 0.800 |" in text
    assert "| gym_zero1 | failed: OOM |" in text and "| gym_fsdp_liger | skipped: no liger |" in text
    # the host syncs per quiet step, strategy x precision (also host_syncs.md beside results.json), and the routed
    # forward's table on the device
    assert "| zero3 | **3** (ds 1 · gym 1 · tf 1) | - | skipped |" in text
    assert "| zero3 | **3**" in (tmp_path / "host_syncs.md").read_text()
    assert "| tiny | 64 | 8 | read: tolist 1 | read: tolist 1 | 0.200 | 0.100 | 2.00 |" in text and "on cuda" in text
    assert text.count("\n## ") == 0  # one section: the routed table comes without its own heading
    # a warm-cache run that found the cache empty (its cold run skipped) says it compiled cold
    cold_warm = {"compile_seconds": 50.0, "inductor_cache_files_at_start": 0}
    assert gpu_results._compile_cell("gym_fsdp_compiled_warm", cold_warm, gpu_bench).endswith("a cold compile)")
    # A run killed before its results.json: the JSON lines beside it are rendered, marked partial.
    (tmp_path / "results.json").unlink()
    partial = run_py.gpu_section(tmp_path / "results.json")
    assert "partial" in partial and "| init_weights | ❌ |" in partial and "| gym_fsdp | 2 | 1,065" in partial
    # `gpu.sh --part bench` in a second device call: its results.json has no checks; the first call's are beside it.
    (tmp_path / "checks.jsonl").rename(tmp_path / "checks.first-call")
    payload = gpu_results.collect(tmp_path, {})
    assert payload["checks"] == [] and payload["runs"]["gym_fsdp"]["tokens_per_sec"]
    (tmp_path / "checks.first-call").rename(tmp_path / "checks.jsonl")
    both = run_py.gpu_section(tmp_path / "results.json")
    assert "| init_weights | ❌ |" in both and "| gym_fsdp | 2 | 1,065" in both


def test_gpu_bench_pairs_each_round_with_the_plain_round_run_beside_it(gpu_results: ModuleType) -> None:
    """Interleaved rounds: the ratio of each round to the plain loop's round of the same number, not of the medians
    (a round that ran slow on both sides is one ordinary ratio); a round plain lacks is set against its median."""
    records = [
        {"strategy": name, "round": r, "ok": True, "tokens_per_sec": tps, "peak_memory_bytes": 1}
        for name, r, tps in [("plain", 1, 100.0), ("gym_ddp", 1, 99.0), ("plain", 2, 200.0), ("gym_ddp", 2, 190.0)]
    ]
    ratio = gpu_results.merge_runs(records)["gym_ddp"]["vs_plain"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == pytest.approx((0.97, 0.95, 0.99))
    assert ratio["n"] == ratio["paired_rounds"] == 2  # the medians' ratio would say 144.5 / 150 = 0.963
    records.append({"strategy": "gym_ddp", "round": 3, "ok": True, "tokens_per_sec": 165.0, "peak_memory_bytes": 1})
    ratio = gpu_results.merge_runs(records)["gym_ddp"]["vs_plain"]
    assert ratio["max"] == pytest.approx(165 / 150) and ratio["paired_rounds"] == 2  # round 3: the median


def test_gpu_bench_groups_fit_the_issue_criteria(gpu_bench: ModuleType) -> None:
    """The default groups: plain / gym_ddp / gym_fsdp interleaved three times in one process, the cold compile
    before the process that compiles warm (whose first run it is), zero3 next to Lightning's DeepSpeed, Liger last
    in its process (its RoPE patch is process-wide); the smoke: one compiled run that runs on CPU."""
    groups = {line.split()[0]: line.split()[2:] for line in gpu_bench.group_lines(smoke=False, only=None)}
    assert list(groups) == ["rounds", "routed", "warm"] and groups["routed"] == [gpu_bench.ROUTED]
    assert groups["rounds"][:9] == ["plain", "gym_ddp", "gym_fsdp"] * 3
    assert groups["rounds"][-1] == "gym_fsdp_compiled" and groups["warm"][0] == "gym_fsdp_compiled_warm"
    warm = groups["warm"]
    assert warm.index("lightning_deepspeed") == warm.index("gym_zero3") + 1 and warm[-1] == "gym_fsdp_liger"
    default = {name for runs in groups.values() for name in runs} - {gpu_bench.ROUTED}
    assert not default & {"hf_trainer", "lightning_fsdp"}  # issue 47's rows: BENCH_GROUPS=issue
    assert default | {"hf_trainer", "lightning_fsdp"} == set(gpu_bench.STRATEGIES)
    smoke = [name for line in gpu_bench.group_lines(smoke=True, only=None) for name in line.split()[2:]]
    args = SimpleNamespace(cpu_smoke=True)
    assert [n for n in smoke if n in gpu_bench.COMPILED and not gpu_bench.skip_reason(args, n)] == ["gym_fsdp_compiled"]
    assert gpu_bench.group_lines(smoke=True, only="warm,issue")[1].startswith("issue 0 plain hf_trainer")
    with pytest.raises(SystemExit, match="unknown group"):
        gpu_bench.group_lines(smoke=False, only="rounds,nope")


def test_gpu_bench_budget_guesses_a_compiled_run_apart(gpu_bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled run not yet seen in the process is expected to take --min-compiled-run; a repeated name its own
    earlier round's time; a skipped run is one record with its round."""
    import time

    calls: list[tuple[str, int]] = []

    def fake(args: Any, strategy: str, op_loads: Any, round_: int, draws: Any) -> dict[str, Any]:
        calls.append((strategy, round_))
        return {"strategy": strategy, "round": round_, "ok": True}

    monkeypatch.setattr(gpu_bench, "run_recorded", fake)
    monkeypatch.setattr(gpu_bench, "append_record", lambda path, record: calls.append(record))
    runs = ["plain", "gym_ddp", "plain", "gym_fsdp_compiled"]
    args = SimpleNamespace(strategy=runs, round=1, jsonl=None, deadline=time.time() + 50)
    args.min_run, args.min_compiled_run = 10.0, 80.0
    assert gpu_bench.run_all(args, [], {}) is False
    assert [c for c in calls if isinstance(c, tuple)] == [("plain", 1), ("gym_ddp", 1), ("plain", 2)]
    skipped = calls[-1]
    assert skipped["strategy"] == "gym_fsdp_compiled" and skipped["ok"] is None
    assert skipped["skipped"].startswith("time budget") and "about 80 s" in skipped["skipped"]


def test_gpu_bench_compile_time_is_the_first_step_less_a_steady_one(gpu_bench: ModuleType) -> None:
    figures = gpu_bench.step_figures([41.0, 0.4], tokens_per_step=8192, tokens_per_sec=8192 / 0.32)
    assert figures["steady_step_seconds"] == pytest.approx(0.32)
    assert figures["compile_seconds"] == pytest.approx(40.68) and figures["first_step_seconds"] == 41.0
    assert gpu_bench.step_figures([], 8192, None)["compile_seconds"] is None


def test_gpu_bench_skips_liger_with_the_reason(gpu_bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_bench.skip_reason(SimpleNamespace(cpu_smoke=True), "gym_fsdp_liger").startswith("needs CUDA")
    assert gpu_bench.skip_reason(SimpleNamespace(cpu_smoke=False), "gym_fsdp_compiled") is None

    def missing(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(gpu_bench.importlib, "import_module", missing)
    why = gpu_bench.skip_reason(SimpleNamespace(cpu_smoke=False), "gym_fsdp_liger")
    assert why == "liger-kernel does not import: ModuleNotFoundError: No module named 'liger_kernel'"


def test_gpu_bundle_carries_the_liger_kernel_fused_ops_was_checked_against() -> None:
    """The GPU image has no liger-kernel: the bundle brings the release models.fused names (gpu_bench.py's
    gym_fsdp_liger run is skipped, with the reason, where it does not import)."""
    from gym_lightning.models.fused import LIGER_CHECKED

    assert f"\n  liger-kernel=={LIGER_CHECKED}\n" in (REPO_ROOT / "scripts" / "gpu_bundle.sh").read_text()


def test_memoised_draw_hands_out_the_same_values_on_new_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_common.memoise_cpu_draw: the second draw from the same generator state is the first one's values on new
    (tied) parameters, moving it leaves the kept one as drawn, and the generator ends where a real draw leaves it;
    inside an open zero.Init the real draw runs."""
    import torch
    from transformers import LlamaConfig

    from gym_lightning.models import loading, plan

    common = _load("workers.gpu_common")
    monkeypatch.setattr(plan, "draw_on_cpu", plan.draw_on_cpu)  # restored after the test
    monkeypatch.setattr(loading, "draw_on_cpu", loading.draw_on_cpu)
    original = plan.draw_on_cpu
    shape = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    options = {"dtype": torch.float32}
    config = LlamaConfig(**shape, num_attention_heads=2, tie_word_embeddings=True)
    torch.manual_seed(3)
    real, after_real = original(config, options), torch.get_rng_state()
    counts = common.memoise_cpu_draw(share=True)
    models = []
    for _ in range(2):
        torch.manual_seed(3)
        models.append(
            loading.draw_on_cpu(LlamaConfig(**shape, num_attention_heads=2, tie_word_embeddings=True), options)
        )
        assert torch.equal(torch.get_rng_state(), after_real)
    assert counts == {"drawn": 1, "reused": 1}
    first, second = models
    for a, b, r in zip(first.parameters(), second.parameters(), real.parameters(), strict=True):
        assert a is not b and torch.equal(b, r)
    assert second.lm_head.weight is second.model.embed_tokens.weight  # tied, as drawn
    second.to(torch.float64)
    assert first.lm_head.weight.dtype == torch.float32
    torch.manual_seed(3)
    assert torch.equal(next(plan.draw_on_cpu(config, options).parameters()), next(real.parameters()))
    assert counts["reused"] == 2  # plan's own callers (reference_state_dict) get it too
    deepspeed_zero = pytest.importorskip("deepspeed.runtime.zero.partition_parameters")
    monkeypatch.setattr(deepspeed_zero, "zero_init_context", 1)
    torch.manual_seed(3)
    plan.draw_on_cpu(config, options)
    assert counts == {"drawn": 1, "reused": 2}  # an open zero.Init: the real draw, not counted


def test_gpu_collect_exit_status(gpu_bench: ModuleType, tmp_path: Path) -> None:
    _fake_gpu_results(gpu_bench, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_results", "collect", "--dir", str(tmp_path)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # gpu.sh's exit status: a check or run failed
    assert "init_weights" in done.stdout and json.loads((tmp_path / "results.json").read_text())["checks"]


def test_planner_prediction_for_every_table_strategy(run_py: ModuleType) -> None:
    from benchmarks import strategies_table

    for name in strategies_table.STRATEGIES:
        estimate = run_py.predicted(name)
        assert estimate.model_states > 0
    # ZeRO-3 with persistence threshold 0 keeps no whole parameter: fewer parameter bytes per rank.
    assert run_py.predicted("zero3_persist0").params < run_py.predicted("zero3").params


def test_scaling_verdict_names_the_smallest_size_reaching_the_target(run_py: ModuleType) -> None:
    found = run_py.scaling_verdict({"small": (0.6, 0.7), "medium": (0.93, 0.95), "large": (0.97, 0.99)})
    assert "**medium**" in found
    machine = run_py.scaling_verdict({"small": (0.6, 0.8), "large": (0.7, 0.95)})
    assert "No size reached" in machine and "large, 0.70" in machine and "from **large** on" in machine
    ddp = run_py.scaling_verdict({"small": (0.6, 0.7), "large": (0.8, 0.85)})
    assert "Even DDP's own efficiency stays below" in ddp


def test_full_pass_compares_a_second_larger_step(run_py: ModuleType) -> None:
    settings = run_py.Settings(**{**run_py.FULL.__dict__, "repeats": 1})
    runs = run_py.strategy_runs(settings, ["zero1"])
    assert [(r["name"], r["batch_size"], r["steps"]) for r in runs] == [("zero1", 4, 80), ("zero1@16", 16, 48)]
    assert runs[1]["ds_config"]["train_micro_batch_size_per_gpu"] == 16
    ddp = run_py.ddp_runs(settings)
    assert {(r["name"], r["batch_size"]) for r in ddp} >= {("h256_l4_b4", 4), ("h256_l4_b16", 16)}


def test_run_py_keeps_the_sections_other_scripts_wrote(run_py: ModuleType) -> None:
    previous = "# Benchmarks\n\n## Machine\n\nold\n\n## 4. DDP scaling on this machine\n\nold\n"
    previous += "\n## Export peak memory\n\nkept\n"
    # A pass over some sections keeps this script's others as they were, in their usual place.
    kept = run_py.previous_own_sections(previous)
    assert kept == {"4. DDP scaling on this machine": "old"}
    report = run_py.Report(run_py.QUICK, ["python", "benchmarks/run.py", "--sections", "fit"])
    report.sections["fit"] = "new"
    text = run_py.document(report, kept)
    assert text.index("## 1. `Trainer.fit`") < text.index("## 4. DDP scaling on this machine\n\nold")
    assert "kept as an earlier pass wrote them: 4. DDP scaling on this machine" in text


def test_run_py_replaces_its_sections_in_place_and_keeps_the_rest(run_py: ModuleType) -> None:
    previous = "# Benchmarks\n\nIntro by hand.\n\n## Summary: one row per claim\n\n| a | b |\n\n## Machine\n\nold\n"
    previous += (
        "\n## 1. `Trainer.fit` vs a plain PyTorch loop (1 process)\n\nold fit\n\n## Export peak memory\n\nkept\n"
    )
    report = run_py.Report(run_py.QUICK, ["python", "benchmarks/run.py", "--sections", "fit"])
    report.sections["fit"] = "new fit"
    text = run_py.updated_document(previous, report)
    assert text.startswith("# Benchmarks\n\nIntro by hand.\n\n## Summary: one row per claim\n\n| a | b |\n")
    assert "new fit" in text and "old fit" not in text and text.count("## Machine") == 1
    assert text.index("## Summary") < text.index("## Machine") < text.index("## 1.") < text.index("## Export")
    assert text.endswith("## Export peak memory\n\nkept\n")
    assert run_py.updated_document("", report) == run_py.document(report)  # a new file: the whole document


def test_verdicts_put_the_runs_side_by_side_and_flag_a_disagreement(
    run_py: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdicts = _load("verdicts")
    cells = [run_py.ratio_cell([[1.0, 1.0]], [[0.9, 1.0]]), run_py.ratio_cell([[1.0, 1.0]], [[1.0, 1.0]])]
    paths = []
    for index, cell in enumerate(cells):
        text = f"# Benchmarks\n\n## {run_py.TITLES['fit']}\n\n| step | a | b | ratio |\n|---|---|---|---|\n"
        text += f"| batch 64 | 1 | 2 | {cell} |\n\n## {run_py.TITLES['ddp']}\n\n| x | {cells[0]} |\n"
        paths.append(tmp_path / f"run{index}.md")
        paths[-1].write_text(text)
    table = verdicts.comparison_table(paths)
    rows = table.splitlines()[2:]
    assert len(rows) == 1, "only sections 1 and 2-3 are compared"
    assert rows[0].startswith(f"| batch 64 | {cells[0]} | {cells[1]} |")
    assert rows[0].endswith("| no (≈ / ✅) |") and verdicts.agreement([cells[1], cells[1]]) == "yes"


def test_export_peak_table_flags_a_peak_over_the_bound() -> None:
    export_peak = _load("export_peak")
    args = type("Args", (), {"max_shard_size": "200MB", "hidden": 8, "layers": 1, "vocab": 16, "argv": []})()
    run = {"seconds": 1.0, "RssAnon_MiB": 100.0, "RssFile_MiB": 0.0}
    results = {"zero3": {"live": [run, {**run, "RssAnon_MiB": 900.0}], "offline": run, "shards": 1}}
    table = export_peak.render(results, {"params": 10**6, "largest_numel": 32_000 * 1024}, args)
    assert "| zero3 | live (end of fit) | 0 | 100 | 0.53 | 0 | 1.0 | yes |" in table
    assert "| zero3 | live (end of fit) | 1 | 900 | 4.80 | 0 | 1.0 | NO |" in table


def test_expert_forward_peak_runs_both_forwards_and_they_agree(tmp_path: Path) -> None:
    """The tiny layer through the real script: peft's and gym's forward each in its own process, their losses and
    adapter gradients compared, the table rendered, the gradient files removed."""
    command = [sys.executable, "-m", "benchmarks.expert_forward_peak", "--layers", "tiny", "--tokens", "16",
               "--steps", "1", "--workdir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, env=child_env(threads=None), capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())["tiny/16"]
    assert result["agreement"]["agree"] and result["agreement"]["expert_adapter_grads"] == 4, result["agreement"]
    for variant in ("peft", "gym"):
        assert result[variant]["peak_MiB"] >= 0 and result[variant]["seconds"] > 0, result[variant]
    assert "| tiny | 16 |" in done.stdout and "| yes |" in done.stdout
    assert not list(tmp_path.glob("*.pt"))


def test_expert_forward_peak_flags_forwards_that_disagree(tmp_path: Path) -> None:
    import torch

    bench = _load("expert_forward_peak")
    grad = torch.ones(4, 3)
    torch.save({"loss": 2.0, "grads": {"experts.lora_A": grad}}, tmp_path / "tiny-16-peft.pt")
    torch.save({"loss": 2.0, "grads": {"experts.lora_A": grad * 1.2}}, tmp_path / "tiny-16-gym.pt")
    check = bench.agreement(tmp_path, "tiny", 16)
    assert not check["agree"] and check["grad_rel"] == pytest.approx(0.2, rel=1e-5)
    run = {"peak_MiB": 10.0, "seconds": 1.0}
    table = bench.render({"tiny/16": {"peft": run, "gym": run, "agreement": check}}, steps=1)
    assert table.startswith(bench.SECTION) and "| 2.0e-01 | NO |" in table
    failed = bench.render({"tiny/16": {"peft": {"failed": -9}, "gym": run}}, steps=1)
    assert "peft failed (exit -9)" in failed


def test_overhead_budget_renders_every_line_and_the_gap(run_py: ModuleType) -> None:
    from benchmarks import overhead

    probe = {name: [0.001] * 4 for name in overhead.COMPONENTS}
    run = {"name": "ddp", "kind": "gym_ddp", "step_seconds": [0.1] * 4, "probe": probe}
    text = overhead.render(
        [run, {**run, "name": "ddp@16", "step_seconds": [0.4] * 4}], [("", 4, 30), ("@16", 16, 12)], 64, {"ddp": 5.0}
    )
    assert text.startswith("**ddp**") and "| line | batch 4 x 64: ms per step (share) | batch 16 x 64" in text
    assert "| median step (probed run, guard on) | 100.0 ms | 400.0 ms |" in text
    # 9 lines of 1 ms: 4 the wrapper's own (sigterm, log, logger, scheduler), 3 the guard's, 2 shared with the peer
    assert (
        "| sum of the wrapper's own lines (guard and shared lines excluded) | 4.00 ms (4.0%) | 4.00 ms (1.0%) |" in text
    )
    assert "| non-finite guard, all three lines | 3.00 ms (3.0%) | 3.00 ms (0.8%) |" in text
    assert "| gap not covered by the lines (Lightning's loop, hooks, closures; noise) | 1.00 ms (1.0%) | 0 |" in text
    assert "comm hooks: none registered" in text and "**fsdp**" not in text


def test_overhead_runs_probe_the_gym_side_with_the_guard(run_py: ModuleType) -> None:
    from benchmarks import overhead

    settings = run_py.Settings(**{**run_py.FULL.__dict__, "repeats": 1})
    kinds = {name: sides[0] for name, sides in run_py.PAIRS.items()}
    runs = overhead.probe_runs(run_py.strategy_workloads(settings), {"seq_len": 64}, kinds, run_py.zero_config)
    assert len(runs) == 2 * len(overhead.STRATEGIES)
    assert all(r["probe"] and r["guard"] and r["kind"].startswith("gym_") for r in runs)
    assert {r["name"] for r in runs} >= {"ddp", "zero3@16"}
    assert next(r for r in runs if r["name"] == "zero2@16")["ds_config"]["train_micro_batch_size_per_gpu"] == 16


def test_probe_counts_the_guard_reduce_net_of_the_norm_it_contains() -> None:
    from benchmarks.workers.probe import COMPONENTS, StepProbe

    probe = StepProbe(warmup=0)
    # on_before_optimizer_step (timed as guard_reduce) calls nonfinite_flag (timed as guard_norm) inside it
    probe.steps = [{"guard_reduce": 0.005, "guard_norm": 0.002, "sigterm": 0.001}, {"guard_reduce": 0.001}]
    table = probe.per_step()
    assert set(table) == set(COMPONENTS)
    assert table["guard_reduce"] == pytest.approx([0.003, 0.001])
    assert table["sigterm"] == [0.001, 0.0] and table["log"] == [0.0, 0.0]


def test_scale_table_puts_measured_peaks_beside_the_planner(tmp_path: Path) -> None:
    import transformers

    scale = _load("scale")
    folder = tmp_path / "models" / "llama-250m"
    folder.mkdir(parents=True)
    shape = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    config = transformers.LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    (folder / "config.json").write_text(config.to_json_string())
    (folder / "model.safetensors").write_bytes(b"0" * 2**20)
    from gym_lightning.planner import resolve_shape
    from gym_lightning.planner.estimate import STRATEGY_BY_KEY
    from gym_lightning.planner.phases import phase_peaks

    setup = scale.planner_setup(folder, 500.0, 4)
    assert setup.checkpoint_file_bytes == 2**20 and setup.accelerator == "cpu" and setup.seq_length == 4
    planned = phase_peaks(resolve_shape(str(folder)), STRATEGY_BY_KEY["fsdp_full"], setup).load.host / 2**20
    rank = {"baseline": 500.0, "load": {"peak": planned * 1.2, "end": 0.0}}
    results = {"250m/gym_fsdp": {"ranks": [rank, rank], "seq": 4}, "1b/zero3": {"failed": 1, "seconds": 3.0}}
    table = scale.render(results, tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| 250m | gym_fsdp | load |"))
    assert f"| {planned:,.0f} | 16.7% |" in row  # |measured - planner| / measured = 0.2 / 1.2
    assert "| 1b | zero3 | — | failed (exit 1) |" in table


def test_cuda_sync_warnings_are_recorded_per_training_batch_not_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``counting_cuda_syncs`` (tests/gpu's census on CUDA): each warning torch's sync debug mode emits inside a
    counted training batch is one event with its step, owner and site, none is printed, even where warnings are
    ignored (gpu.sh sets PYTHONWARNINGS=ignore); other warnings pass through; the mode is restored. Torch's warning
    is emitted by hand here: this CPU build has no sync debug mode."""
    import warnings

    import torch

    from benchmarks.common import host_syncs

    modes: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    counter = host_syncs.HostSyncCounter()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*synchroniz")  # an ignore filter for them, as PYTHONWARNINGS
        with host_syncs.counting_cuda_syncs(counter):
            counter.counting, counter.step = True, 3
            for _ in range(2):
                warnings.warn(host_syncs.SYNC_WARNING, stacklevel=1)  # as torch's TORCH_WARN reaches Python
            counter.counting = False
            warnings.warn(host_syncs.SYNC_WARNING, stacklevel=1)  # between training batches: not counted
            warnings.warn("another warning", stacklevel=1)
    assert modes == ["warn", 0]
    assert [(e.kind, e.step) for e in counter.events] == [(host_syncs.CUDA_SYNC, 3)] * 2
    assert counter.events[0].chain[-1].startswith("tests/test_benchmarks.py:")  # the site, not warnings.py
    assert [str(w.message) for w in shown] == ["another warning"]
