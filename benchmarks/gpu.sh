#!/usr/bin/env bash
# GPU benchmark: Qwen3-1.7B shape (random weights from a config-only folder), bf16-mixed, sequence length 2048,
# world size 1 on one H200 (about 8 minutes). gym_lightning's GymFSDPStrategy (FSDP2) and ZeROStrategy(stage=3)
# against Lightning's own FSDPStrategy (FSDP1, one unit per Qwen3DecoderLayer) and DeepSpeedStrategy(stage=3), same
# CausalLMModule, same batches. Each run is its own process (clean CUDA peak-memory counters); rounds alternate the
# order; a second round runs only if the time budget allows. tokens/s and MFU from gym_lightning's ThroughputCallback
# (FLOPs per token 6N + 12·L·H·Q·T, PaLM appendix B); peak memory = torch.cuda.max_memory_allocated.
#
#   bash benchmarks/gpu.sh                  # on the GPU machine; results in benchmarks/results/gpu/ (and $OUT/gpu/)
#   bash benchmarks/gpu.sh --cpu-smoke      # dry run of the same code path on CPU with a tiny Qwen3 (no figures)
#   python benchmarks/run.py --sections gpu # render benchmarks/results/gpu/results.json into docs/benchmarks.md
#
# Environment: PYTHON (default python), GPU_RESULTS_DIR (default benchmarks/results/gpu), GPU_BUDGET_S (default 450:
# no new run starts after that many seconds), BATCH_SIZE (default 4), STEPS (default 15), WARMUP (default 3).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
RESULTS=${GPU_RESULTS_DIR:-benchmarks/results/gpu}
BUDGET=${GPU_BUDGET_S:-450}
BATCH_SIZE=${BATCH_SIZE:-4}
SEQ_LEN=2048
STEPS=${STEPS:-15}
WARMUP=${WARMUP:-3}
RUN_TIMEOUT=200
SMOKE=()
STRATEGIES=(gym_fsdp lightning_fsdp gym_zero3 lightning_deepspeed)

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  SMOKE=(--cpu-smoke)
  RESULTS=${GPU_RESULTS_DIR:-/tmp/gym_gpu_smoke}
  SEQ_LEN=64 BATCH_SIZE=2 STEPS=3 WARMUP=1 RUN_TIMEOUT=300
  export OMP_NUM_THREADS=1
fi

export TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
rm -rf "$RESULTS/runs" && mkdir -p "$RESULTS/runs"

"$PYTHON" - <<'EOF' || { echo "gpu.sh: the Python environment lacks a package (see above)"; exit 2; }
import deepspeed, lightning, torch, transformers, gym_lightning
print(f"torch {torch.__version__}, lightning {lightning.__version__}, deepspeed {deepspeed.__version__}, "
      f"transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

"$PYTHON" benchmarks/workers/gpu_bench.py write-config --out "$RESULTS/qwen3-1.7b" "${SMOKE[@]}" || exit 2

SECONDS=0
last=0
for round in 1 2; do
  order=("${STRATEGIES[@]}")
  if [[ $round == 2 ]]; then order=(lightning_deepspeed gym_zero3 lightning_fsdp gym_fsdp); fi
  for strategy in "${order[@]}"; do
    # Start a run only if the slowest run so far would still fit in the budget.
    if (( SECONDS + last > BUDGET )); then echo "gpu.sh: budget reached at ${SECONDS}s, skipping the rest"; break 2; fi
    start=$SECONDS
    echo "=== round $round: $strategy (t=${SECONDS}s)"
    timeout "$RUN_TIMEOUT" "$PYTHON" benchmarks/workers/gpu_bench.py run --strategy "$strategy" \
      --model "$RESULTS/qwen3-1.7b" --json "$RESULTS/runs/$strategy.$round.json" --batch-size "$BATCH_SIZE" \
      --seq-len "$SEQ_LEN" --steps "$STEPS" --warmup "$WARMUP" "${SMOKE[@]}" > "$RESULTS/runs/$strategy.$round.log" 2>&1
    status=$?
    tail -n 1 "$RESULTS/runs/$strategy.$round.log" | cut -c1-300
    if [[ $status == 124 ]]; then
      echo "{\"strategy\": \"$strategy\", \"error\": \"timed out after ${RUN_TIMEOUT}s\"}" > "$RESULTS/runs/$strategy.$round.json"
    fi
    (( SECONDS - start > last )) && last=$(( SECONDS - start ))
  done
done

meta=$(printf '{"model": "Qwen3-1.7B shape, random weights", "precision": "bf16-mixed", "micro_batch": %s, "seq_len": %s, "timed_steps": %s, "warmup_steps": %s, "world_size": 1, "flops": "6N + 12LHQT per token (PaLM app. B)", "smoke": %s}' \
  "$BATCH_SIZE" "$SEQ_LEN" "$STEPS" "$WARMUP" "$([[ ${#SMOKE[@]} -gt 0 ]] && echo true || echo false)")
"$PYTHON" benchmarks/workers/gpu_bench.py collect --runs "$RESULTS/runs" --out "$RESULTS/results.json" --meta "$meta"
if [[ -n "${OUT:-}" ]]; then mkdir -p "$OUT/gpu" && cp -r "$RESULTS/." "$OUT/gpu/"; fi
echo "gpu.sh: done in ${SECONDS}s; results in $RESULTS/results.json"
