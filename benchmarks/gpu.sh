#!/usr/bin/env bash
# The device check: gym_lightning's correctness on one CUDA GPU, then one benchmark round, in one
# command that ends within 6 minutes on an H200 from a cold start (so that a rerun fits a 15-minute lease).
#
#  0. Installs the wheels of $GYM_WHEELS (scripts/gpu_bundle.sh) into $SITE, without an index: the GPU image
#     reaches no registry and lacks deepspeed, datasets and jsonargparse; gym_lightning is imported from this
#     working tree (PYTHONPATH), never installed. No wheels: the interpreter's own packages are used.
#  1. benchmarks/workers/gpu_check.py, ONE process (imports cost 10-20 s a process): every strategy (gym_ddp,
#     gym_fsdp, zero1-3) trains a tiny Llama in bf16-mixed against an fp32 run; gym_fsdp cpu_offload (shards on
#     the host); val/loss and val/ppl equal across strategies; the end-of-fit HF export reloads to the trained
#     logits; equal random initial weights; chunked loss on = off; DDP fp16 / bf16 / PowerSGD hooks. No DeepSpeed
#     op is built (torch optimizers only, no offload ZeRO variant; a JIT build is refused and fails its check).
#  2. benchmarks/workers/gpu_bench.py, one process per run (clean CUDA peak counters), ONE round: Qwen3-1.7B shape,
#     random weights, bf16-mixed, sequence 2048: tokens/s, MFU and peak CUDA memory (max allocated) of gym_fsdp and
#     gym_zero3 against Lightning's FSDPStrategy and DeepSpeedStrategy(stage=3), beside the planner's predicted peak.
#
# Results are written as they come (one JSON line per check or run, flushed), straight into $OUT/gpu/ when OUT is
# set (the device machine), else benchmarks/results/gpu/ (or /tmp/gym_gpu_smoke with --cpu-smoke): env.txt,
# checks.jsonl, bench.jsonl, log.txt (this script's whole output) and, at the end, results.json. A command killed
# at its limit still hands back everything it finished. Scratch (model config, exports, logs): $GPU_WORK_DIR.
#
# Time budget: no benchmark run starts after GPU_BUDGET_S (330 s) or when the slowest run so far would pass
# GPU_DEADLINE_S (350 s), and every process is killed by GPU_DEADLINE_S (checks: at most 180 s, a run 110 s).
# Exit status: 0 when every check and run that should run passed, 1 if one failed, 2 if nothing could run.
#
#   device tool:  run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=400)
#   here:         PYTHON=.venv/bin/python bash benchmarks/gpu.sh --cpu-smoke   # the same script on CPU, tiny models
#   render:       python benchmarks/run.py --sections gpu    # benchmarks/results/gpu/ -> docs/benchmarks.md
#
# --cpu-smoke runs exactly this on CPU ranks (tiny Qwen3, sequence 64, 3 steps): Lightning's FSDPStrategy and
# DeepSpeedStrategy refuse CPUs and are recorded as skipped; cpu_offload's host placement is recorded as a no-op.
# Environment: PYTHON (python3), GYM_WHEELS (.whl), SITE (/tmp/gym_site), GPU_RESULTS_DIR, GPU_WORK_DIR
# (/tmp/gym_gpu_work), GPU_BUDGET_S, GPU_DEADLINE_S, BATCH_SIZE (4), STEPS (10 timed), WARMUP (3).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2

SMOKE=()
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE=(--cpu-smoke)
PYTHON=${PYTHON:-python3}
GYM_WHEELS=${GYM_WHEELS:-.whl}
SITE=${SITE:-/tmp/gym_site}
WORK=${GPU_WORK_DIR:-/tmp/gym_gpu_work}
STRATEGIES=(gym_fsdp lightning_fsdp gym_zero3 lightning_deepspeed)  # each next to its peer: pairs finish together
if (( ${#SMOKE[@]} )); then
  RESULTS=${GPU_RESULTS_DIR:-/tmp/gym_gpu_smoke}
  BUDGET=${GPU_BUDGET_S:-600} DEADLINE=${GPU_DEADLINE_S:-900} CHECK_TIMEOUT=600 RUN_TIMEOUT=300 MIN_RUN=20
  BATCH_SIZE=${BATCH_SIZE:-2} SEQ_LEN=64 STEPS=${STEPS:-3} WARMUP=${WARMUP:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  RESULTS=${GPU_RESULTS_DIR:-benchmarks/results/gpu}
  BUDGET=${GPU_BUDGET_S:-330} DEADLINE=${GPU_DEADLINE_S:-350} CHECK_TIMEOUT=180 RUN_TIMEOUT=110 MIN_RUN=45
  BATCH_SIZE=${BATCH_SIZE:-4} SEQ_LEN=2048 STEPS=${STEPS:-10} WARMUP=${WARMUP:-3}
fi
[[ -n "${OUT:-}" ]] && RESULTS="$OUT/gpu"  # the device machine hands back only what is under $OUT
CHECKS="$RESULTS/checks.jsonl" BENCH="$RESULTS/bench.jsonl"

# Only this script's files are removed: the folder may hold other things (the default folder also loses the
# runs/ and qwen3-1.7b/ folders of the earlier layout).
mkdir -p "$RESULTS" || exit 2
rm -rf "$RESULTS"/{env.txt,checks.jsonl,bench.jsonl,log.txt,results.json} "$WORK"
[[ "$RESULTS" == benchmarks/results/gpu ]] && rm -rf "$RESULTS"/{runs,qwen3-1.7b}
mkdir -p "$WORK"
exec > >(tee -a "$RESULTS/log.txt") 2>&1
tee_pid=$!
SECONDS=0
export TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

note() { printf '%s\n' "$1" >> "$2"; }  # one JSON line (bash-made records: a process that never wrote its own)
finish() { exec 1>&- 2>&-; wait "$tee_pid" 2>/dev/null; exit "$1"; }  # log.txt complete before the exit

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
if (( ${#wheels[@]} == 0 )); then
  echo "gpu.sh: no wheels in $GYM_WHEELS: using $PYTHON's own packages"
elif [[ -n "$foreign" ]]; then
  echo "gpu.sh: NOT installing $GYM_WHEELS: $PYTHON cannot install $foreign; using its own packages"
  note "{\"check\": \"wheels\", \"ok\": null, \"skipped\": \"not for this Python: $foreign\"}" "$CHECKS"
else
  echo "gpu.sh: installing ${#wheels[@]} wheels from $GYM_WHEELS into $SITE"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${wheels[@]}"; then
    note "{\"check\": \"wheels\", \"ok\": false, \"detail\": \"pip could not install $GYM_WHEELS/*.whl\"}" "$CHECKS"
  fi
fi
export PYTHONPATH="$repo:$SITE${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), mode: ${SMOKE[*]:-cuda}, wheels: ${#wheels[@]} from $GYM_WHEELS"
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

cap() { local left=$(( DEADLINE - SECONDS )); echo $(( $1 < left ? $1 : left )); }  # a timeout within the deadline

# ---------------------------------------------------------------------------------------------- checks 1-7
limit=$(cap "$CHECK_TIMEOUT")
echo "=== correctness checks (t=${SECONDS}s, limit ${limit}s)"
timeout -k 10 "$limit" "$PYTHON" benchmarks/workers/gpu_check.py --out "$CHECKS" --work "$WORK/checks" "${SMOKE[@]}"
status=$?
if [[ $status == 2 ]]; then
  echo "gpu.sh: no CUDA device: nothing to check"
  finish 2
elif [[ $status == 124 || $status == 137 ]]; then
  note "{\"check\": \"checks_process\", \"ok\": false, \"detail\": \"killed at its ${limit}s limit\"}" "$CHECKS"
elif [[ $status != 0 && $status != 1 ]]; then
  note "{\"check\": \"checks_process\", \"ok\": false, \"detail\": \"exited with status $status\"}" "$CHECKS"
fi

# ---------------------------------------------------------------------------------------------- check 8: benchmark
"$PYTHON" benchmarks/workers/gpu_bench.py write-config --out "$WORK/model" "${SMOKE[@]}" >/dev/null || finish 2
slowest=$MIN_RUN
for strategy in "${STRATEGIES[@]}"; do
  if (( SECONDS > BUDGET || SECONDS + slowest > DEADLINE )); then
    echo "gpu.sh: time budget reached at ${SECONDS}s: $strategy not run"
    note "{\"strategy\": \"$strategy\", \"ok\": null, \"skipped\": \"time budget reached at ${SECONDS}s\"}" "$BENCH"
    continue
  fi
  start=$SECONDS limit=$(cap "$RUN_TIMEOUT")
  echo "=== benchmark $strategy (t=${SECONDS}s, limit ${limit}s)"
  timeout -k 10 "$limit" "$PYTHON" benchmarks/workers/gpu_bench.py run --strategy "$strategy" --model "$WORK/model" \
    --jsonl "$BENCH" --work "$WORK/bench" --batch-size "$BATCH_SIZE" --seq-len "$SEQ_LEN" --steps "$STEPS" \
    --warmup "$WARMUP" "${SMOKE[@]}"
  status=$?
  if [[ $status == 124 || $status == 137 ]]; then
    note "{\"strategy\": \"$strategy\", \"ok\": false, \"error\": \"killed at its ${limit}s limit\"}" "$BENCH"
  fi
  (( SECONDS - start > slowest )) && slowest=$(( SECONDS - start ))
done

# ---------------------------------------------------------------------------------------------- results
smoke=$( (( ${#SMOKE[@]} )) && echo true || echo false)
meta="{\"model\": \"Qwen3-1.7B shape, random weights\", \"precision\": \"bf16-mixed\", \"micro_batch\": $BATCH_SIZE,"
meta+=" \"seq_len\": $SEQ_LEN, \"timed_steps\": $STEPS, \"warmup_steps\": $WARMUP, \"world_size\": 1,"
meta+=" \"flops\": \"6N + 12LHQT per token (PaLM app. B)\", \"smoke\": $smoke, \"seconds\": $SECONDS}"
"$PYTHON" benchmarks/workers/gpu_bench.py collect --checks "$CHECKS" --bench "$BENCH" --out "$RESULTS/results.json" \
  --meta "$meta"
status=$?
echo "gpu.sh: done in ${SECONDS}s; results in $RESULTS (exit status $status)"
finish $(( status == 0 ? 0 : 1 ))
