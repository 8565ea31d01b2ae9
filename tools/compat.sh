#!/usr/bin/env bash
# `make compat`: the suite against the newest releases the registry offers and against the package's declared
# floors, each in a throw-away virtual environment (build/compat-newest, build/compat-floor), made anew.
#
#   newest: the newest torch (on Linux PyPI's CUDA build, which runs on a CPU), transformers,
#           sentence-transformers and accelerate, with none of constraints.txt's pins and no pip cap on torch
#   floor:  torch, transformers and sentence-transformers at pyproject.toml's floors (read from it)
#
# The development environment (make install, CI) pins sentence-transformers in constraints.txt to the release last
# tested; where newest resolves another one, the summary says so, so that the pin is moved on purpose.
#
# The source tree is tested (pytest imports the package from the checkout); each environment gets the
# package's dependencies and its dev and examples extras. COMPAT_ENVS picks environments (default
# "newest floor"), COMPAT_PYTEST the pytest arguments (default: the whole suite, -q, every marker: -m "" comes
# first, a -m there replaces it; COMPAT_SUBSET=1: the
# subset below), COMPAT_KEEP=1 reuses
# environments an earlier run built (to run other tests in them). The versions each
# environment ran and its pytest summary line are appended to build/compat/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
ENVS=${COMPAT_ENVS:-newest floor}
# COMPAT_SUBSET=1: a stated subset (the functional core on every path, the engine's replay, its autocast cache and padding-free
# layouts, the losses' exactness against sentence-transformers, the stock trainers, the reranker loss and the
# arguments of every model kind) where the whole suite is too slow for two more environments
SUBSET="tests/functional tests/engine/test_rng.py tests/engine/test_autocast_cache.py tests/engine/test_flattened.py \
tests/losses/test_losses.py \
tests/losses/test_trainer.py tests/losses/test_cached_cross_encoder.py tests/config/test_model_kinds.py"
if [ "${COMPAT_SUBSET:-0}" = 1 ]; then
    DEFAULT_PYTEST="-q -p no:cacheprovider $SUBSET"
else
    DEFAULT_PYTEST="-q -p no:cacheprovider"
fi
read -r -a PYTEST_ARGS <<<"${COMPAT_PYTEST:-$DEFAULT_PYTEST}"
OUT=build/compat
mkdir -p "$OUT"
: >"$OUT/summary.txt"

# the floors, as pyproject.toml declares them ("name>=X")
floor() { sed -n "s/^ *\"$1>=\([0-9.]*\).*/\1/p" pyproject.toml | head -1; }

status=0
for env in $ENVS; do
    venv=build/compat-$env
    py=$venv/bin/python
    if [ "${COMPAT_KEEP:-0}" = 1 ] && [ -x "$py" ]; then
        env=keep-$env
    else
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv"
        "$py" -m pip install --quiet --upgrade pip
    fi
    case $env in
    keep-*) env=${env#keep-} ;;
    newest)
        # an empty constraints file replaces a machine-wide pip constraint (some machines cap torch);
        # constraints.txt is not used either
        PIP_CONSTRAINT=/dev/null "$py" -m pip install --quiet --upgrade torch
        PIP_CONSTRAINT=/dev/null "$py" -m pip install --quiet --upgrade ".[dev,examples]" transformers \
            sentence-transformers accelerate
        ;;
    floor)
        "$py" -m pip install --quiet "torch==$(floor torch)"
        "$py" -m pip install --quiet ".[dev,examples]" "torch==$(floor torch)" \
            "transformers==$(floor transformers)" "sentence-transformers==$(floor sentence-transformers)"
        ;;
    *)
        echo "unknown environment $env (newest, floor)" >&2
        exit 2
        ;;
    esac
    versions=$("$py" -c "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in \
        ('torch', 'transformers', 'sentence-transformers', 'accelerate', 'datasets', 'peft', 'deepspeed')))")
    echo "== $env: $versions"
    # the checkout's package, not the installed copy: pytest puts the repository root first on sys.path
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_BUILD_OPS=0 \
        "$py" -m pytest -m "" "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/$env.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || status=1
    echo "$env: $versions" >>"$OUT/summary.txt"
    echo "  pytest exit $rc: $(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|tests? collected)' "$OUT/$env.log" | tail -1)" >>"$OUT/summary.txt"
    if [ "$env" = newest ]; then
        pinned=$(sed -n 's/^sentence-transformers==\([0-9.]*\).*/\1/p' constraints.txt)
        newest=$("$py" -c "import importlib.metadata as m; print(m.version('sentence-transformers'))")
        if [ -n "$pinned" ] && [ "$newest" != "$pinned" ]; then
            echo "  sentence-transformers $newest is out; constraints.txt pins $pinned: move the pin once this is green" \
                >>"$OUT/summary.txt"
        fi
    fi
done
echo
cat "$OUT/summary.txt"
exit $status
