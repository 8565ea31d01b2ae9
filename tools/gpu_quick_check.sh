#!/usr/bin/env bash
# A short GPU check for a lent GPU machine that takes at most 64 MiB of carried files (make wheels' folder
# is about 320 MiB): `make gpu-kit` here copies the few wheels such a machine lacks (sentence-transformers
# at our floor, the test runner and hypothesis) from wheels/ into build/gpu_kit/wheels; on the GPU machine
# `bash tools/gpu_quick_check.sh` keeps its CUDA torch, installs the kit offline, runs every
# device-parametrised test on cuda and the loss-stage benchmark on cuda, results in $OUT.
# Measured 2026-11-26 on an H100 (torch 2.11.0+cu130): 217 s in all. `make gpu-check` is the whole check.
set -uo pipefail
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=build/gpu_kit/wheels
{
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|sentence|accelerate|datasets|pyarrow|numpy|pytest|hypothesis|triton|peft|pyyaml|inf)" 
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 150 python3 -m pip install --quiet --no-index --find-links "$K" --no-deps --break-system-packages "$K"/*.whl > "$OUT/install.log" 2>&1 || \
  timeout 150 python3 -m pip install --quiet --no-index --find-links "$K" --no-deps "$K"/*.whl >> "$OUT/install.log" 2>&1
echo "install rc=$?"; tail -3 "$OUT/install.log"
python3 -c "import sentence_transformers as s; print('st', s.__version__)"
export PYTHONPATH=$PWD
timeout 260 python3 -m pytest -q -p no:cacheprovider --device cuda -k cuda --continue-on-collection-errors \
  tests/functional tests/engine tests/losses tests/st_upstream > "$OUT/pytest_full.log" 2>&1
echo "pytest rc=$?"; tail -40 "$OUT/pytest_full.log" > "$OUT/pytest.log"
cat "$OUT/pytest.log"
timeout 170 python3 benchmarks/loss_stage.py --device cuda --sizes 4096,16384,65536 --repeats 3 --out "$OUT" > "$OUT/loss_stage.log" 2>&1
echo "loss_stage rc=$?"; tail -30 "$OUT/loss_stage.log"
