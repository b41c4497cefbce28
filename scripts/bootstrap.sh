#!/usr/bin/env bash
# Set up a fresh virtual environment in .venv with everything needed to train and to run the tests.
#
#   bash scripts/bootstrap.sh                 # CPU build of torch (CI, laptops)
#   bash scripts/bootstrap.sh --torch "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128   # GPU
#
# The CPU torch wheel is installed before the package: an unpinned `torch` requirement would otherwise resolve to a
# multi-GB CUDA build. Re-running it rebuilds .venv from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_spec="torch==2.13.0"
index_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) torch_spec="$2"; shift 2 ;;
    --index-url) index_args=(--index-url "$2"); shift 2 ;;
    *) echo "bootstrap.sh: unknown option $1 (expected --torch SPEC or --index-url URL)" >&2; exit 2 ;;
  esac
done

# DeepSpeed's NVMe offload (ZeRO-Infinity) JIT-builds its async_io op against libaio.
if ! dpkg -s libaio-dev >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null) || echo "bootstrap.sh: could not install libaio-dev; NVMe offload will be unavailable" >&2
  else
    echo "bootstrap.sh: libaio-dev is missing (sudo apt-get install libaio-dev); NVMe offload will be unavailable" >&2
  fi
fi

rm -rf .venv
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$torch_spec" "${index_args[@]}"
.venv/bin/python -m pip install -q -e ".[test]"
echo "bootstrap.sh: ready — $(.venv/bin/python -c 'import torch, lightning, deepspeed, transformers; print(f"torch {torch.__version__}, lightning {lightning.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")')"
