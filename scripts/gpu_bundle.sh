#!/usr/bin/env bash
# Build the wheel bundle that the GPU machine's image needs to run gym_lightning. That machine reaches no package
# registry, and its image (python 3.12, torch 2.11.0, lightning 2.6.6, transformers 5.17.0, ...: the package list
# in the device tool's KINDS.md) lacks deepspeed, datasets and jsonargparse, which gym_lightning imports, some of
# their own needs, and liger-kernel (the optional Liger fused ops the GPU bench measures). This script downloads exactly those, one version each, into one folder; there they are
# installed with
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/*.whl
#   export PYTHONPATH="$repo:$SITE"      # gym_lightning itself runs from the working tree
#
#   bash scripts/gpu_bundle.sh                                    # cp312 manylinux x86-64 (the image) into .whl/
#   bash scripts/gpu_bundle.sh --python-version 3.11 --dest DIR   # the same set for another Python (CI, here)
#
# Run again, it reuses an up-to-date folder (a stamp of this script and the Python version; no network). Otherwise
# it builds the new set in a scratch folder next to DIR and then swaps it in: earlier wheels of these distributions
# (another version or Python) are removed, so that the `--no-deps` install above never meets two versions of one.
# Wheels of other distributions in DIR are left alone, with a warning: the install takes every *.whl there.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
self="$repo/scripts/$(basename "$0")"

python_version=3.12
dest="$repo/.whl"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) python_version="$2"; shift 2 ;;
    --dest) dest="$2"; shift 2 ;;
    *) echo "gpu_bundle.sh: unknown option $1 (expected --python-version X.Y or --dest DIR)" >&2; exit 2 ;;
  esac
done
[[ $python_version =~ ^3\.[0-9]+$ ]] || { echo "gpu_bundle.sh: --python-version must look like 3.12" >&2; exit 2; }

# Pinned to what this repository's .venv tests with (setup.cfg's ranges must hold each one). Each line says what
# imports the distribution and why the image lacks it (its list names none of them, except where said).
wheels=(
  # gym_lightning.strategies (ZeRO) and Lightning's DeepSpeedStrategy; absent from the image. PyPI has only an
  # sdist: it is built here into a pure-Python wheel (no ops compiled; DeepSpeed JIT-builds them with the
  # image's nvcc and ninja when a run needs one).
  deepspeed==0.19.8
  hjson==3.1.0                # deepspeed: parses its config (imported by `import deepspeed`)
  pydantic==2.14.4            # deepspeed: its config models (imported by `import deepspeed`)
  pydantic-core==2.50.5       # pydantic: exactly this version (compiled: the one per-Python wheel)
  annotated-types==0.8.0      # pydantic
  typing-inspection==0.4.5    # pydantic (the image has typing-inspect, another package)
  # pydantic needs typing-extensions>=4.16.0; the image has typing-extensions, but at a version nobody has read.
  # 4.16 only adds to older ones, so shadowing the image's costs nothing and rules the mismatch out.
  typing-extensions==4.16.0
  datasets==5.2.0             # gym_lightning.data (tokenised datasets, Arrow cache)
  dill==0.4.1                 # datasets (pins dill<0.4.2): fingerprints of map functions
  multiprocess==0.70.19       # datasets (pins multiprocess<0.70.20): num_proc map; a per-Python wheel (py3XX)
  # datasets pins fsspec<=2026.9.0; the image's fsspec is of an unread version. The install's --target folder comes
  # first on PYTHONPATH, so this one shadows whatever the image has.
  fsspec==2026.9.0
  jsonargparse==4.53.0        # gym_lightning.cli: Lightning's LightningCLI
  docstring-parser==0.18.0    # jsonargparse[signatures]: LightningCLI refuses to start without that extra
  typeshed-client==2.15.0     # jsonargparse[signatures]
  # gym_lightning.models.fused's fused_ops kernels liger (the `liger` extra; benchmarks/gpu.sh's gym_fsdp_liger run).
  # Pure Python (py3-none-any, 0.9 MB); its needs, torch and triton, are the image's. The version fused.py was
  # checked against (LIGER_CHECKED).
  liger-kernel==0.8.5
)
# datasets' other needs are in the image: pyarrow (datasets wants >=24), pandas, xxhash, huggingface-hub
# (>=1.31,<3; the image has 1.33.0), filelock, tqdm, pyyaml, packaging, numpy. deepspeed's: einops, msgpack, ninja,
# psutil, py-cpuinfo, tqdm, packaging, numpy, torch.

# Wheel files name distributions with '_' for '-' and '.' (PEP 427), in any case.
normalize() { tr 'A-Z.-' 'a-z__' <<<"$1"; }
ours=" "
for spec in "${wheels[@]}"; do ours+="$(normalize "${spec%%==*}") "; done

# A relative --dest is the caller's; then work from the repository.
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
cd "$repo"
stamp_file="$dest/.gpu-bundle-stamp"
stamp=$({ cat "$self"; echo "python $python_version"; } | sha256sum | cut -d' ' -f1)

is_ours() { local name; name=$(basename "$1"); [[ $ours == *" $(normalize "${name%%-*}") "* ]]; }

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

report() {
  local bytes tree_bytes whl
  bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
  echo "gpu_bundle.sh: $(ls "$dest"/*.whl | wc -l) wheels for Python $python_version in $dest: $(mib "$bytes")"
  # The device tool sends the working tree (tracked and untracked-not-ignored files) and the carried bundle, 64 MiB
  # at most: warn well before that.
  if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    tree_bytes=$(cd "$repo" && git ls-files -z --cached --others --exclude-standard |
      xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
    tree_bytes=${tree_bytes:-0}
    echo "gpu_bundle.sh: with the working tree ($(mib "$tree_bytes")):" \
      "$(mib $((bytes + tree_bytes))) of the 64 MiB a device call takes"
    if ((bytes + tree_bytes > 40 * 1048576)); then
      echo "gpu_bundle.sh: warning: over 40 MiB together; the device tool refuses more than 64 MiB" >&2
    fi
  fi
  for whl in "$dest"/*.whl; do
    if ! is_ours "$whl"; then
      echo "gpu_bundle.sh: warning: $(basename "$whl") is no part of the bundle, but the install takes it too" >&2
    fi
  done
}

if [[ -f $stamp_file ]] && [[ $(head -1 "$stamp_file") == "$stamp" ]] &&
  (tail -n +2 "$stamp_file" | while read -r name; do [[ -f $dest/$name ]] || exit 1; done); then
  echo "gpu_bundle.sh: $dest is up to date (stamp matches); reusing it"
  report
  exit 0
fi

# Inside DIR (same file system, so the swap is a rename), hidden from the install's "$DIR"/*.whl.
stage=$(mktemp -d "$dest/.partial.XXXXXX")
trap 'rm -rf "$stage"' EXIT
log="$stage/pip.log"

# pip's error for a missing distribution is long; say which one in one line, with the log's last line below it.
fail() {
  local missing
  missing=$(grep -oE 'No matching distribution found for [^ ]+' "$log" | head -1 | awk '{print $NF}' || true)
  if [[ -n $missing ]]; then
    echo "gpu_bundle.sh: pip found no $1 of $missing for Python $python_version (manylinux x86-64)" >&2
  else
    echo "gpu_bundle.sh: pip failed ($1): $(grep -E '^ERROR' "$log" | tail -1)" >&2
  fi
  exit 1
}

mkdir "$stage/whl"
binary=()
for spec in "${wheels[@]}"; do [[ $spec == deepspeed==* ]] || binary+=("$spec"); done
# Wheels only (no sdist may sneak in and be built for this machine's Python); pip matches a manylinux tag exactly,
# so each glibc level in use is named; the image (Python 3.12.3, Ubuntu 24.04) has glibc 2.39.
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
  manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${tag}_x86_64"); done
python3 -m pip download --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d "$stage/whl" "${binary[@]}" >"$log" 2>&1 || fail "wheel"

# DeepSpeed: one pure-Python wheel serves every Python, so an earlier build in DIR is reused.
ds_spec=$(printf '%s\n' "${wheels[@]}" | grep '^deepspeed==')
ds_wheel="deepspeed-${ds_spec#deepspeed==}-py3-none-any.whl"
if [[ -f $dest/$ds_wheel ]]; then
  cp "$dest/$ds_wheel" "$stage/whl/"
else
  # DS_BUILD_OPS=0: compile no op (its default, said outright). The isolated build has no torch, which DeepSpeed's
  # setup.py accepts ("pre-compiling ops will be disabled"), so nothing of this machine gets baked in.
  DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-binary=:all: -w "$stage/whl" "$ds_spec" >"$log" 2>&1 ||
    fail "sdist"
fi
if [[ ! -f $stage/whl/$ds_wheel ]]; then
  got=$(ls "$stage/whl" | grep -i '^deepspeed' || echo nothing)
  echo "gpu_bundle.sh: the DeepSpeed build gave $got, not $ds_wheel (a wheel for every Python)" >&2
  exit 1
fi

count=$(ls "$stage/whl" | wc -l)
if ((count != ${#wheels[@]})); then
  echo "gpu_bundle.sh: expected ${#wheels[@]} wheels, got $count: $(ls "$stage/whl" | tr '\n' ' ')" >&2
  exit 1
fi

# Swap in: drop every wheel of these distributions (older pins, another Python's), then move the new set in.
rm -f "$stamp_file"
for whl in "$dest"/*.whl; do
  if [[ -e $whl ]] && is_ours "$whl"; then rm -f "$whl"; fi
done
new=$(ls "$stage/whl")
mv "$stage/whl"/*.whl "$dest/"
# Written last: an interrupted run leaves no stamp, so the next one builds again.
printf '%s\n%s\n' "$stamp" "$new" >"$stamp_file"
report
