#!/usr/bin/env bash
# The device check: gym_lightning on one CUDA GPU, in two parts, each one device call (the machine stays warm 30 s
# after a call: make the second at once). Run both, checks first, whenever a GPU is lent:
#
#   device tool:  run(command="bash benchmarks/gpu.sh --part checks", carry=[".whl"], timeout_s=280)
#                 run(command="bash benchmarks/gpu.sh --part bench", carry=[".whl"], timeout_s=390)
#   here:         PYTHON=.venv/bin/python bash benchmarks/gpu.sh --cpu-smoke [--part checks|bench]   # on CPU
#   render:       python -m benchmarks.run --sections gpu    # benchmarks/results/gpu/ -> docs/benchmarks.md
#
# Device time: about 12 of the 15 minutes a session has (a start of 1-2 min, checks <= 4 min, bench <= 6 min,
# the transfers); no --part runs both in one call, which needs about 10 min, a device call's limit.
#
#  0. Installs the wheels of $GYM_WHEELS (scripts/gpu_bundle.sh) into $SITE, without an index: the GPU image
#     reaches no registry and lacks deepspeed, datasets, jsonargparse and liger-kernel; gym_lightning and the
#     benchmarks run from this working tree (PYTHONPATH), never installed. No wheels: the interpreter's own packages.
#  1. checks (GPU_CHECKS_S, 240 s): `python -m pytest tests/gpu`, one process, the tests in this order (their
#     docstrings say how each decides): every strategy (gym_ddp, gym_fsdp, zero1-3) trains a tiny Llama in bf16-mixed
#     against an fp32 run, gym_fsdp cpu_offload, validation metrics, the HF export reloaded, equal random initial
#     weights, the chunked loss, QLoRA, DDP's compression hooks (test_gpu_checks.py); `gym fit` of every shipped
#     config that runs on one GPU, each export reloaded (test_gpu_configs.py); the host syncs per quiet training step
#     of `gym fit`, strategy x precision, counted under torch.cuda.set_sync_debug_mode("warn")
#     (test_gpu_host_syncs.py: the table is printed at the end and written to host_syncs.md); no DeepSpeed op built
#     (test_gpu_op_builds.py).
#     tests/gpu/conftest.py writes one JSON line per test as it ends (checks.jsonl) and starts none that would likely
#     end past the deadline (recorded as skipped: the host-sync cells go first, 16-mixed before 32-true).
#  2. bench (GPU_BENCH_S, 345 s): benchmarks/workers/gpu_bench.py (its docstring says what each run is), Qwen3-1.7B
#     shape, random weights, fp32 parameters, bf16 autocast, SDPA, fused AdamW lr 1e-5, micro-batch 4 x 2048, 2
#     warm-up + 8 timed steps a run: tokens/s, MFU, peak CUDA memory beside the planner's predicted peak and tokens/s,
#     and the compile time (first step less a steady one). Three processes ("groups", gpu_bench.py GROUPS), in this
#     order, which is also what is given up first when time runs short (last first):
#       rounds: plain, gym_ddp, gym_fsdp, three times interleaved (the wrapper tax: ratio medians and min-max over
#               rounds), then gym_fsdp_compiled, the bench's first compile, in an empty inductor cache (cold);
#       routed: benchmarks/routed_forward_speed.py --device cuda (the MoE routed forward, grouped by expert against
#               the per-expert forward it replaced, at moe-400m and Qwen3-30B-A3B widths, 2,048 and 8,192 tokens;
#               routed.jsonl), about 40 s;
#       warm:   gym_fsdp_compiled_warm (the same compile in a second process, same TORCHINDUCTOR_CACHE_DIR: the
#               warm-cache criterion), gym_zero3 then Lightning's DeepSpeedStrategy(stage=3) (the ZeRO-3 rule:
#               zero3's ratio to it), gym_ddp_compiled, plain_compiled (the plain loop with the same per-layer
#               compile), gym_zero1, gym_zero2, gym_fsdp_liger (Liger's kernels; skipped, with why, where liger-kernel
#               does not import).
#     Each run's record carries the planner's predicted peak and tokens/s (the planner's one-GPU rows,
#     benchmarks/plan_rows.py GYM_H200). Not run by default (issue 47 measured them): transformers.Trainer and
#     Lightning's FSDPStrategy, BENCH_GROUPS=issue runs them beside plain and gym_fsdp. Owed and not here: gym_ddp +
#     compile at world size 2 (benchmarks/compiled_ddp.py needs two GPUs).
#
# Results are written as they come (one JSON line per test, run or routed size, flushed), straight into $OUT/gpu/
# when OUT is set (the device machine), else benchmarks/results/gpu/ (or /tmp/gym_gpu_smoke with --cpu-smoke):
# env.txt, checks.jsonl, bench.jsonl, routed.jsonl, log.txt (this invocation's whole output), results.json and
# host_syncs.md (at most 7 files; the device tool hands back 8). A part replaces only its own JSON lines;
# results.json merges the JSON lines the folder holds (benchmarks.gpu_results; `python -m benchmarks.run --sections
# gpu` fills a part missing from it from the JSON lines beside it: copy two calls' files into one folder). A command
# killed at its limit still hands back everything it finished; every failure is one line in its record.
# Scratch (model config, exports, logs, caches): $GPU_WORK_DIR.
#
# Time: no bench group starts with less than MIN_RUN seconds left before its own deadline (the bench's, less what it
# keeps for later groups), and inside a group the worker starts no run that would likely end past it (its earlier
# round's seconds, else MIN_RUN, or MIN_COMPILED_RUN for a compiled run); each is recorded as skipped, with the time
# left. BENCH_GROUPS="warm" (or "routed", "issue") runs just those groups, e.g. in another device call after one that
# gave up the last runs (the warm group alone compiles cold: $GPU_WORK_DIR, with the cache, starts empty each time).
# Exit status: 0 when every check and run that should run passed, 1 if one failed, 2 if nothing could run (no CUDA
# device; a usage error).
#
# --cpu-smoke runs the same on CPU (CI's image-like environment runs it, .ci/run): tests/gpu with
# GYM_GPU_CPU_SMOKE=1 (the tiny models on the CPU; what needs CUDA, such as 16-mixed and most host-sync cells, is
# skipped with why), a tiny Qwen3 at sequence 64 for the bench (1 + 3 steps a run, two rounds instead of three, one
# compiled run: gym_fsdp_compiled), the routed forward at its tiny layer; Lightning's FSDPStrategy and
# DeepSpeedStrategy refuse CPUs and Liger needs Triton on CUDA: recorded as skipped.
# Environment: PYTHON (python3), GYM_WHEELS (.whl), SITE (/tmp/gym_site), GPU_RESULTS_DIR, GPU_WORK_DIR
# (/tmp/gym_gpu_work; the bench's inductor and Triton caches live there), GPU_CHECKS_S, GPU_BENCH_S, BENCH_GROUPS
# (rounds routed warm), BATCH_SIZE (4), STEPS (8 timed), WARMUP (2).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2

usage="usage: bash benchmarks/gpu.sh [--cpu-smoke] [--part checks|bench|all]"
SMOKE=() PARTS=(checks bench)
while (( $# )); do
  case "$1" in
    --cpu-smoke) SMOKE=(--cpu-smoke); shift ;;
    --part) part=${2:-}; shift $(( $# > 1 ? 2 : 1 ))
      case "$part" in
        checks|bench) PARTS=("$part") ;;
        all) PARTS=(checks bench) ;;
        *) echo "gpu.sh: --part takes checks, bench or all, not '${part}'" >&2; echo "$usage" >&2; exit 2 ;;
      esac ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; echo "$usage"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
runs_part() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

PYTHON=${PYTHON:-python3}
GYM_WHEELS=${GYM_WHEELS:-.whl}
SITE=${SITE:-/tmp/gym_site}
WORK=${GPU_WORK_DIR:-/tmp/gym_gpu_work}
BENCH_GROUPS=${BENCH_GROUPS:-}  # gpu_bench.py's groups to run, e.g. "warm" or "issue" (default: rounds routed warm)
if (( ${#SMOKE[@]} )); then
  RESULTS=${GPU_RESULTS_DIR:-/tmp/gym_gpu_smoke}
  CHECKS_S=${GPU_CHECKS_S:-600} BENCH_S=${GPU_BENCH_S:-600} RUN_TIMEOUT=300 MIN_RUN=20 MIN_COMPILED_RUN=60
  BATCH_SIZE=${BATCH_SIZE:-2} SEQ_LEN=64 STEPS=${STEPS:-3} WARMUP=${WARMUP:-1}
  ROUTED_ARGS=(--device cpu --layers tiny --tokens 64 --repeats 1) ROUTED_S=120
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} GYM_GPU_CPU_SMOKE=1
else
  RESULTS=${GPU_RESULTS_DIR:-benchmarks/results/gpu}
  # MIN_RUN / MIN_COMPILED_RUN: a run's seconds before one of its kind ran in the process (guesses: an eager run
  # after the process's first draw is a build, 10 steps of ~0.32 s and a teardown; a compiled one adds the <= 60 s
  # cold compile that issue 47 asks for); a run takes its own earlier round's time after that.
  CHECKS_S=${GPU_CHECKS_S:-240} BENCH_S=${GPU_BENCH_S:-345} RUN_TIMEOUT=110 MIN_RUN=30 MIN_COMPILED_RUN=80
  BATCH_SIZE=${BATCH_SIZE:-4} SEQ_LEN=2048 STEPS=${STEPS:-8} WARMUP=${WARMUP:-2}
  # The routed forward: two layer widths x two lengths, 5 alternating rounds each (ROUTED_S: its time limit).
  ROUTED_ARGS=(--device cuda --layers moe-400m qwen3-30b-a3b --tokens 2048 8192 --repeats 5) ROUTED_S=45
fi
[[ -n "${OUT:-}" ]] && RESULTS="$OUT/gpu"  # the device machine hands back only what is under $OUT
CHECKS="$RESULTS/checks.jsonl" BENCH="$RESULTS/bench.jsonl" ROUTED="$RESULTS/routed.jsonl"
ROUTED_RUN=routed_forward_speed  # the routed group's record key when it did not run
GRACE=10  # timeout's -k: a process that ignores SIGTERM is killed this much later

# Only this script's files are removed, and of the JSON lines only those of the parts this invocation runs: the
# folder may hold the other part's (a local run of one part after the other) and other things (the default folder
# also loses the runs/ and qwen3-1.7b/ folders of an earlier layout).
mkdir -p "$RESULTS" || exit 2
rm -rf "$RESULTS"/{env.txt,log.txt,results.json,host_syncs.md} "$WORK"
for part in "${PARTS[@]}"; do rm -f "$RESULTS/$part.jsonl"; done
runs_part bench && rm -f "$ROUTED"
[[ "$RESULTS" == benchmarks/results/gpu ]] && rm -rf "$RESULTS"/{runs,qwen3-1.7b}
mkdir -p "$WORK"
exec > >(tee -a "$RESULTS/log.txt") 2>&1
tee_pid=$!
SECONDS=0
export TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

note() { printf '%s\n' "$1" >> "$2"; }  # one JSON line (bash-made records: a process that never wrote its own)
finish() { exec 1>&- 2>&-; wait "$tee_pid" 2>/dev/null; exit "$1"; }  # log.txt complete before the exit
cap() {  # timeout $1 within deadline $2 (at least 1 s: timeout takes no 0 or less)
  local left=$(( $2 - SECONDS )); left=$(( $1 < left ? $1 : left )); echo $(( left < 1 ? 1 : left ))
}

# ---------------------------------------------------------------------------------------------- environment
shopt -s nullglob
wheels=("$GYM_WHEELS"/*.whl)
shopt -u nullglob
# Wheels this interpreter cannot install (a bundle made for another Python, e.g. the device's cp312 bundle in a
# 3.11 checkout): pip would refuse the whole set, so none is installed and the interpreter's own packages are used.
foreign=$("$PYTHON" - "${wheels[@]}" <<'EOF' 2>/dev/null
import sys
from pathlib import Path

try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:  # pip's own copy, where packaging is not installed
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename
supported = set(sys_tags())
print(" ".join(Path(w).name for w in sys.argv[1:] if not parse_wheel_filename(Path(w).name)[3] & supported))
EOF
)
wheel_problem=
if (( ${#wheels[@]} == 0 )); then
  echo "gpu.sh: no wheels in $GYM_WHEELS: using $PYTHON's own packages"
elif [[ -n "$foreign" ]]; then
  echo "gpu.sh: NOT installing $GYM_WHEELS: $PYTHON cannot install $foreign; using its own packages"
  wheel_problem="\"ok\": null, \"skipped\": \"not for this Python: $foreign\""
else
  echo "gpu.sh: installing ${#wheels[@]} wheels from $GYM_WHEELS into $SITE"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${wheels[@]}"; then
    wheel_problem="\"ok\": false, \"detail\": \"pip could not install $GYM_WHEELS/*.whl\""
  fi
fi
if [[ -n "$wheel_problem" ]]; then  # into a file this invocation writes (results.json reads only those two)
  if runs_part checks; then
    note "{\"check\": \"wheels\", $wheel_problem}" "$CHECKS"
  else
    note "{\"strategy\": \"wheels\", $wheel_problem}" "$BENCH"
  fi
fi
export PYTHONPATH="$repo:$SITE${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), mode: ${SMOKE[*]:-cuda}, parts: ${PARTS[*]}," \
    "wheels: ${#wheels[@]} from $GYM_WHEELS"
  echo "repo: $repo, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$PYTHON" - <<'EOF' || echo "python: $PYTHON does not run"
import importlib.metadata as metadata, importlib.util, platform

print("python:", platform.python_version())
for name in ("torch", "lightning", "transformers", "deepspeed", "datasets", "jsonargparse", "peft", "torchmetrics"):
    try:
        print(f"{name}: {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}: MISSING")
spec = importlib.util.find_spec("gym_lightning")
print("gym_lightning from:", spec.origin if spec else "NOT IMPORTABLE")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

# ---------------------------------------------------------------------------------------------- part 1: checks
cuda_or_finish() {  # the checks part finds out first where both run
  (( ${#SMOKE[@]} )) && return 0
  "$PYTHON" -c 'import sys, torch
sys.exit(0 if torch.cuda.is_available() else 2)' && return 0
  echo "gpu.sh: no CUDA device: nothing to $1"
  finish 2
}

part_checks() {
  local deadline=$(( SECONDS + CHECKS_S - GRACE )) limit status
  limit=$(cap "$CHECKS_S" "$deadline")
  cuda_or_finish check
  echo "=== checks: python -m pytest tests/gpu (t=${SECONDS}s, limit ${limit}s)"
  # GYM_GPU_DEADLINE: no test starts that would likely end after it (a test's margin before the kill).
  GYM_GPU_RECORDS="$CHECKS" GYM_GPU_WORK="$WORK/checks" GYM_GPU_DEADLINE=$(( $(date +%s) + limit - 15 )) \
    timeout -k "$GRACE" "$limit" "$PYTHON" -m pytest -p no:cacheprovider -q -o addopts=--strict-markers tests/gpu
  status=$?
  if [[ $status == 124 || $status == 137 ]]; then
    note "{\"check\": \"checks_process\", \"ok\": false, \"detail\": \"killed at its ${limit}s limit\"}" "$CHECKS"
  elif [[ $status != 0 && $status != 1 ]]; then  # pytest: 1 = a test failed (its record says which)
    note "{\"check\": \"checks_process\", \"ok\": false, \"detail\": \"pytest exited with status $status\"}" "$CHECKS"
  fi
}

# ---------------------------------------------------------------------------------------------- part 2: bench
part_bench() {
  local deadline=$(( SECONDS + BENCH_S - GRACE )) line group reserve until limit status name want have why
  local -a groups words runs names
  local -A before
  echo "=== bench: Qwen3-1.7B shape (t=${SECONDS}s, deadline t=${deadline}s)"
  runs_part checks || cuda_or_finish benchmark
  "$PYTHON" -m benchmarks.workers.gpu_bench write-config --out "$WORK/model" "${SMOKE[@]}" >/dev/null || finish 2
  mapfile -t groups < <("$PYTHON" -m benchmarks.workers.gpu_bench groups "${SMOKE[@]}" --only "$BENCH_GROUPS")
  (( ${#groups[@]} )) || finish 2
  # One inductor / Triton cache for the bench, empty at its start ($WORK is removed above): the first compile is
  # cold, the warm group's process compiles the same layers again from it.
  export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton"
  for line in "${groups[@]}"; do
    read -ra words <<< "$line"
    group=${words[0]} reserve=${words[1]} runs=("${words[@]:2}")
    mapfile -t names < <(printf '%s\n' "${runs[@]}" | awk '!seen[$0]++')  # each run once, in order
    until=$(( deadline - reserve ))  # the seconds a group keeps for the groups after it
    if (( SECONDS + MIN_RUN > until )); then
      echo "gpu.sh: time budget reached at ${SECONDS}s: group $group (${runs[*]}) not run"
      why="time budget reached at ${SECONDS}s"
      if [[ $group == routed ]]; then
        note "{\"key\": \"$ROUTED_RUN\", \"ok\": null, \"skipped\": \"$why\"}" "$ROUTED"
        continue
      fi
      for name in "${names[@]}"; do
        note "{\"strategy\": \"$name\", \"ok\": null, \"skipped\": \"$why\"}" "$BENCH"
      done
      continue
    fi
    if [[ $group == routed ]]; then
      part_routed "$until"
      continue
    fi
    for name in "${names[@]}"; do before[$name]=$(grep -c "\"strategy\": \"$name\"" "$BENCH" 2>/dev/null); done
    limit=$(cap $(( RUN_TIMEOUT * ${#runs[@]} )) "$until")
    echo "=== benchmark group $group: ${runs[*]} (t=${SECONDS}s, limit ${limit}s)"
    # --deadline / --min-run: the worker starts no run that would likely end after its kill (it records a skip).
    timeout -k "$GRACE" "$limit" "$PYTHON" -m benchmarks.workers.gpu_bench run --strategy "${runs[@]}" \
      --model "$WORK/model" --jsonl "$BENCH" --work "$WORK/bench" --batch-size "$BATCH_SIZE" --seq-len "$SEQ_LEN" \
      --steps "$STEPS" --warmup "$WARMUP" --deadline $(( $(date +%s) + limit - 5 )) --min-run "$MIN_RUN" \
      --min-compiled-run "$MIN_COMPILED_RUN" "${SMOKE[@]}"
    status=$?
    # Every round the process never recorded (killed, or the process died before it): one failure record each.
    for name in "${names[@]}"; do
      want=$(printf '%s\n' "${runs[@]}" | grep -cx "$name")
      have=$(grep -c "\"strategy\": \"$name\"" "$BENCH" 2>/dev/null)
      have=$(( ${have:-0} - ${before[$name]:-0} ))
      while (( have < want )); do
        have=$(( have + 1 ))
        if [[ $status == 124 || $status == 137 ]]; then
          why="killed at its ${limit}s limit"
        else
          why="process exited with $status, no record"
        fi
        note "{\"strategy\": \"$name\", \"round\": $have, \"ok\": false, \"error\": \"$why\"}" "$BENCH"
      done
    done
  done
}

# The routed group: benchmarks/routed_forward_speed.py on the device, one record per layer and length (routed.jsonl).
part_routed() {
  local limit status
  limit=$(cap "$ROUTED_S" "$1")
  echo "=== routed forward: ${ROUTED_ARGS[*]} (t=${SECONDS}s, limit ${limit}s)"
  timeout -k "$GRACE" "$limit" "$PYTHON" -m benchmarks.routed_forward_speed "${ROUTED_ARGS[@]}" --jsonl "$ROUTED" \
    --out "$WORK/routed.json"
  status=$?
  if [[ $status == 124 || $status == 137 ]]; then
    note "{\"key\": \"$ROUTED_RUN\", \"ok\": false, \"error\": \"killed at its ${limit}s limit\"}" "$ROUTED"
  elif [[ $status != 0 && ! -s $ROUTED ]]; then
    note "{\"key\": \"$ROUTED_RUN\", \"ok\": false, \"error\": \"exited with $status, no record\"}" "$ROUTED"
  fi
}

runs_part checks && part_checks
runs_part bench && part_bench

# ---------------------------------------------------------------------------------------------- results
smoke=$( (( ${#SMOKE[@]} )) && echo true || echo false)
meta="{\"parts\": \"${PARTS[*]}\", \"smoke\": $smoke, \"seconds\": $SECONDS"
if runs_part bench; then
  meta+=", \"model\": \"Qwen3-1.7B shape, random weights\", \"precision\": \"bf16-mixed\","
  meta+=" \"micro_batch\": $BATCH_SIZE, \"seq_len\": $SEQ_LEN, \"timed_steps\": $STEPS, \"warmup_steps\": $WARMUP,"
  meta+=" \"world_size\": 1, \"groups\": \"${BENCH_GROUPS:-rounds routed warm}\","
  meta+=" \"compile\": \"per decoder layer, inductor defaults, cache under \$WORK, empty at the start\","
  meta+=" \"flops\": \"6N + 12LHQT per token (PaLM app. B)\""
fi
"$PYTHON" -m benchmarks.gpu_results collect --dir "$RESULTS" --meta "$meta}"
status=$?
runs_part checks && "$PYTHON" -m benchmarks.gpu_results syncs --dir "$RESULTS"
echo "gpu.sh: done in ${SECONDS}s; results in $RESULTS (exit status $status)"
finish $(( status == 0 ? 0 : 1 ))
