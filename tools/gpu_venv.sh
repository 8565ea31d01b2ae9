#!/usr/bin/env bash
# The install step of `make gpu-check` (tools/gpu_check.sh): the virtualenv $GPU_VENV (default
# .venv-gpu) with the package and its test and benchmark dependencies on a torch that can use the GPU.
#
#   bash tools/gpu_venv.sh [REQUIREMENT...]
#
# installs the REQUIREMENTs (default: -e ".[dev,examples]", the checkout with its extras), then each of
# $GPU_OPTIONAL (default: inf-cl; one that does not install is reported and skipped). Two ways:
#
# * $PYTHON (default python3) already imports a CUDA build of torch (`torch.version.cuda` is set), as on
#   a GPU machine with PyTorch preinstalled: that torch is used, never reinstalled. The virtualenv sees
#   $PYTHON's packages (--system-site-packages, and when $PYTHON is itself a virtualenv, a .pth file
#   adding its site-packages after the new one's); a constraint pins torch to the version $PYTHON has,
#   so pip can neither upgrade nor replace it. That version is the installed distribution's, as pip
#   sees it, not torch.__version__: PyPI's CUDA wheels say 2.11.0 where torch.__version__ says
#   2.11.0+cu130, and a constraint with the +cu130 would match no installed torch. If $GPU_WHEELS (default wheels/, made by `make wheels` on
#   a connected machine) holds wheels, everything is installed from there with --no-index: no network
#   is used. Otherwise the missing packages come from the configured index.
#   GPU_SYSTEM_TORCH=1 takes $PYTHON's torch without asking whether it is a CUDA build (the tests'
#   stand-in for a CUDA torch on a CPU-only machine); GPU_SYSTEM_TORCH=0 never takes it.
# * Otherwise: a virtualenv of its own with $GPU_TORCH (default torch==2.13.0 from the default index,
#   whose Linux wheels are CUDA builds; $GPU_TORCH_INDEX_URL picks another index), as before.
#
# Exit status: non-zero if the virtualenv or a REQUIREMENT could not be installed, or if the torch the
# virtualenv imports is not the one $PYTHON had (first way).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${GPU_VENV:-.venv-gpu}
TORCH=${GPU_TORCH:-torch==2.13.0}
WHEELS=${GPU_WHEELS:-wheels}
SYSTEM_TORCH=${GPU_SYSTEM_TORCH:-auto}
OPTIONAL=${GPU_OPTIONAL-inf-cl}
PY=$VENV/bin/python
if [ "$#" -gt 0 ]; then reqs=("$@"); else reqs=(-e ".[dev,examples]"); fi

say() { echo "gpu-check: $*"; }

# the version of $PYTHON's torch if it is to be used, else nothing
system_torch=
case $SYSTEM_TORCH in
    0) ;;
    1)
        system_torch=$("$PYTHON" -c 'import importlib.metadata as md, torch; print(md.version("torch"))') ||
            { say "GPU_SYSTEM_TORCH=1 but $PYTHON imports no torch"; exit 1; }
        ;;
    auto)
        system_torch=$("$PYTHON" -c 'import importlib.metadata as md, sys, torch; print(md.version("torch")) if torch.version.cuda else sys.exit(1)' 2>/dev/null) ||
            system_torch=
        ;;
    *) say "GPU_SYSTEM_TORCH is auto, 0 or 1, not '$SYSTEM_TORCH'"; exit 1 ;;
esac

if [ -z "$system_torch" ]; then
    index=()
    [ -n "${GPU_TORCH_INDEX_URL:-}" ] && index=(--index-url "$GPU_TORCH_INDEX_URL")
    { test -x "$PY" || "$PYTHON" -m venv "$VENV"; } &&
        echo '*' >"$VENV/.gitignore" && # the venv ignores itself
        "$PY" -m pip install --quiet --upgrade pip &&
        "$PY" -m pip install --quiet ${index[@]+"${index[@]}"} "$TORCH" &&
        # keep the CUDA torch just installed: nothing below may swap it for another build
        "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' >"$VENV/constraints.txt" &&
        "$PY" -m pip install --quiet -c "$VENV/constraints.txt" "${reqs[@]}" || exit 1
    for req in $OPTIONAL; do
        "$PY" -m pip install --quiet -c "$VENV/constraints.txt" "$req" ||
            say "$req did not install (comparisons with it unavailable); going on"
    done
    exit 0
fi

source=()
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    source=(--no-index --find-links "$WHEELS")
    say "torch $system_torch of $PYTHON kept; the rest from $WHEELS only (--no-index)"
else
    say "torch $system_torch of $PYTHON kept; the rest from the index ($WHEELS has no wheels)"
fi
# --without-pip: a pip (and, before Python 3.12, a setuptools) of its own would hide newer ones that
# $PYTHON has, and torch may need them (torch 2.13 requires setuptools >= 77); $PYTHON's pip is used.
{ test -x "$PY" || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"; } &&
    echo '*' >"$VENV/.gitignore" || exit 1
# A virtualenv's --system-site-packages are its base interpreter's: when $PYTHON is itself a virtualenv,
# its own site-packages (and their .pth files) are added after the new virtualenv's.
"$PYTHON" - "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" <<'EOF' || exit 1
import pathlib
import site
import sys

pth = pathlib.Path(sys.argv[1]) / "_gpu_check_parent.pth"
if sys.prefix == sys.base_prefix:
    pth.unlink(missing_ok=True)
else:
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
EOF
"$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --default-pip >/dev/null || exit 1
echo "torch==$system_torch" >"$VENV/constraints.txt"
"$PY" -m pip install --quiet ${source[@]+"${source[@]}"} -c "$VENV/constraints.txt" "${reqs[@]}" || exit 1
for req in $OPTIONAL; do
    "$PY" -m pip install --quiet ${source[@]+"${source[@]}"} -c "$VENV/constraints.txt" "$req" ||
        say "$req did not install (comparisons with it unavailable); going on"
done
# the torch the virtualenv imports must be $PYTHON's, untouched
"$PY" - "$system_torch" "$VENV" <<'EOF'
import importlib.metadata as md
import pathlib
import sys

import torch

version, venv = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
where = pathlib.Path(torch.__file__).resolve()
if md.version("torch") != version or venv in where.parents:
    sys.exit(f"gpu-check: torch changed: {md.version('torch')} from {where}, expected {version} from outside {venv}")
print(f"gpu-check: torch {md.version('torch')} ({torch.__version__}) from {where.parent}")
EOF
