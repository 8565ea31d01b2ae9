#!/usr/bin/env bash
# `make gpu-check`: on a machine with an NVIDIA GPU, one command that proves and times every CUDA path.
#
# Without a usable GPU (no nvidia-smi, nvidia-smi failing or listing no GPU, CUDA_VISIBLE_DEVICES
# hiding them all) it prints one line and exits 0, so CPU-only CI stays green.
#
# With one, it
#   1. makes its own virtualenv ($GPU_VENV, default .venv-gpu; `make test` keeps the CPU-only .venv) with
#      the package, its dev and examples extras, and inf-cl (tools/gpu_venv.sh). If $PYTHON already
#      imports a CUDA build of torch, that torch is kept, never reinstalled, and with a wheel folder
#      ($GPU_WHEELS, default wheels/, from `make wheels`) nothing is downloaded: the offline way for a GPU
#      machine with PyTorch preinstalled and no network. Otherwise the virtualenv gets a CUDA build of
#      torch ($GPU_TORCH, default torch==2.13.0 from the default index, whose Linux wheels are CUDA
#      builds; $GPU_TORCH_INDEX_URL picks another index);
#   2. records the GPU, driver, torch, CUDA and package versions in $GPU_OUT/env.txt;
#   3. runs the test suite with `--device cuda` (every device-parametrised test on the GPU);
#   4. runs benchmarks/loss_stage.py, benchmarks/train_step.py and benchmarks/gpu_train_step.py (the
#      trainer's step in bf16 on BERT-base and MiniLM shapes, theirs against ours) with `--device cuda`.
# Results and logs land in $GPU_OUT (default benchmarks/results/gpu). Every step runs even if an
# earlier one failed; the exit status is non-zero if any did. Extra arguments: $PYTEST_ARGS,
# $LOSS_STAGE_ARGS, $TRAIN_STEP_ARGS, $GPU_TRAIN_STEP_ARGS (they replace the defaults below). GPU_CHECK_DRY_RUN=1 prints
# the steps without running them.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${GPU_CHECK_RUNNING:-}" ]; then  # the suite it runs must not start it again
    echo "gpu-check: skipped, already running (a nested call); nothing to check."
    exit 0
fi
export GPU_CHECK_RUNNING=1
no_gpu() {
    echo "gpu-check: skipped, no CUDA GPU on this machine ($1); nothing to check."
    exit 0
}
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi not found"
gpus=$(nvidia-smi -L 2>/dev/null) || no_gpu "nvidia-smi failed"
grep -q '^GPU ' <<<"$gpus" || no_gpu "nvidia-smi lists no GPU"
if [ "${CUDA_VISIBLE_DEVICES+set}" = set ] && { [ -z "$CUDA_VISIBLE_DEVICES" ] || [ "$CUDA_VISIBLE_DEVICES" = -1 ]; }; then
    no_gpu "CUDA_VISIBLE_DEVICES hides every GPU"
fi

PYTHON=${PYTHON:-python3}
VENV=${GPU_VENV:-.venv-gpu}
export PYTHON GPU_VENV=$VENV  # for tools/gpu_venv.sh
OUT=${GPU_OUT:-benchmarks/results/gpu}
DRY=${GPU_CHECK_DRY_RUN:-}
PY=$VENV/bin/python
PYTEST_ARGS=${PYTEST_ARGS:--q}
LOSS_STAGE_ARGS=${LOSS_STAGE_ARGS:---sizes 4096,16384,65536,262144 --repeats 5 --st-max 65536 --st-max-symmetric 16384}
TRAIN_STEP_ARGS=${TRAIN_STEP_ARGS:---batch-sizes 64,256,1024 --steps 5 --memory-sizes 64,256,1024,4096,16384}
GPU_TRAIN_STEP_ARGS=${GPU_TRAIN_STEP_ARGS:---steps 5}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

echo "gpu-check: $(head -n 1 <<<"$gpus")"
[ -n "$DRY" ] || mkdir -p "$OUT"
failed=()

# step NAME CMD...: run CMD, its output shown and kept in $OUT/NAME.log (or $LOG); a failure is remembered
step() {
    local name=$1
    shift
    local log=${LOG:-$OUT/$name.log}
    echo "gpu-check: [$name] $*"
    [ -n "$DRY" ] && return 0
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "gpu-check: [$name] FAILED (exit $rc), log in $log"
        failed+=("$name")
    fi
    return "$rc"
}

# 1. the GPU virtualenv: a failure here ends the check
install() {
    bash tools/gpu_venv.sh || return 1
    "$PY" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(
        f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}) sees no CUDA device: install a "
        "CUDA build (GPU_TORCH, GPU_TORCH_INDEX_URL) matching this driver, or check CUDA_VISIBLE_DEVICES."
    )
EOF
}
step install install || { echo "gpu-check: FAILED: could not set up $VENV"; exit 1; }

# 2. what this run measured on
environment() {
    "$PY" - <<'EOF'
import datetime
import importlib.metadata as md
import platform
import subprocess

import torch

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"

commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
props = torch.cuda.get_device_properties(0)
lines = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit + (" (with uncommitted changes)" if dirty else ""),
    "device": f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)",
    "device memory": f"{props.total_memory / 2**30:.1f} GiB",
    "compute capability": f"{props.major}.{props.minor}",
    "torch": torch.__version__,
    "torch CUDA": torch.version.cuda,
    "cuDNN": torch.backends.cudnn.version(),
    "python": platform.python_version(),
    "platform": platform.platform(),
    **{name: version(name) for name in ("sentence-transformers", "transformers", "accelerate", "inf-cl", "triton")},
}
for key, value in lines.items():
    print(f"{key}: {value}")
EOF
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
}
LOG=$OUT/env.txt step env environment

# 3. the suite, device-parametrised tests on the GPU; all of it (-m "": not only pytest's default fast lane)
# shellcheck disable=SC2086  # the *_ARGS are word lists
step pytest "$PY" -m pytest --device cuda -m "" $PYTEST_ARGS
# 4. the benchmarks, on the GPU
# shellcheck disable=SC2086
step loss_stage "$PY" benchmarks/loss_stage.py --device cuda --out "$OUT" $LOSS_STAGE_ARGS
# shellcheck disable=SC2086
step train_step "$PY" benchmarks/train_step.py --device cuda --out "$OUT" $TRAIN_STEP_ARGS
# shellcheck disable=SC2086
step gpu_train_step "$PY" benchmarks/gpu_train_step.py --device cuda --out "$OUT" $GPU_TRAIN_STEP_ARGS

if [ "${#failed[@]}" -ne 0 ]; then
    echo "gpu-check: FAILED: ${failed[*]} (logs in $OUT)"
    exit 1
fi
echo "gpu-check: done; results in $OUT"
