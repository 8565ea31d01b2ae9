"""Build the release and prove that it installs: what `make dist` runs.

1. ``python -m build``: the sdist and the wheel into ``dist/`` (the folder is emptied first);
2. ``twine check --strict``: their metadata renders (README as the long description, license, version);
3. the wheel holds the package and its license only: every ``.py`` of ``st_cached_losses/`` in the
   source tree, ``py.typed``, and the ``.dist-info`` folder with ``licenses/LICENSE``; nothing else
   (no tests, benchmarks or examples);
4. a fresh virtual environment (``build/dist-venv``, made anew): torch first, as the Makefile installs
   it (a CPU build through ``--torch-index`` when given), then the wheel by itself from ``dist/``,
   its dependencies from the default index;
5. ``tools/smoke_train.py`` run there from a temporary directory: one training step with the
   installed package (it checks that the package was imported from that environment).

    python tools/dist_check.py [--torch torch==2.13.0] [--torch-index URL] [--python python3]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "st_cached_losses"


def run(*cmd: str | Path, cwd: Path = ROOT) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True)


def check_wheel(wheel: Path) -> None:
    """Refuse a wheel that misses a module of the source package or holds anything besides the package
    and its license."""
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    stray = [n for n in names if not (n.startswith(f"{PACKAGE}/") or n.startswith(f"{dist_info}/"))]
    if stray:
        sys.exit(f"{wheel.name} holds files outside the package: {stray[:10]}")
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")}
    expected.add(f"{PACKAGE}/py.typed")
    missing = sorted(expected - set(names))
    if missing:
        sys.exit(f"{wheel.name} misses {missing[:10]}")
    extra = sorted(n for n in names if n.startswith(f"{PACKAGE}/") and n not in expected)
    if extra:
        sys.exit(f"{wheel.name} holds files that are not the package's sources: {extra[:10]}")
    if f"{dist_info}/licenses/LICENSE" not in names:
        sys.exit(f"{wheel.name} has no {dist_info}/licenses/LICENSE")
    print(f"{wheel.name}: {len(expected)} package files + {dist_info}/ (LICENSE included), nothing else")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python", default="python3", help="the Python that makes the fresh environment")
    parser.add_argument("--torch", default="torch==2.13.0", help="the torch requirement installed first")
    parser.add_argument("--torch-index", default="", help="an extra index for torch (PyTorch's CPU index)")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    parser.add_argument("--venv", type=Path, default=ROOT / "build" / "dist-venv")
    args = parser.parse_args()

    shutil.rmtree(args.dist, ignore_errors=True)
    run(sys.executable, "-m", "build", "--outdir", args.dist, ROOT)
    built = sorted(args.dist.iterdir())
    run(sys.executable, "-m", "twine", "check", "--strict", *built)
    wheels = [p for p in built if p.suffix == ".whl"]
    if len(wheels) != 1 or not any(p.name.endswith(".tar.gz") for p in built):
        sys.exit(f"expected one wheel and one sdist in {args.dist}, found {[p.name for p in built]}")
    check_wheel(wheels[0])

    shutil.rmtree(args.venv, ignore_errors=True)
    run(args.python, "-m", "venv", args.venv)
    py = args.venv / "bin" / "python"
    run(py, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    index = ["--extra-index-url", args.torch_index] if args.torch_index else []
    # torch first, by itself, as the Makefile does: a bare requirement would pull the CUDA build on Linux
    run(py, "-m", "pip", "install", "--quiet", "--no-deps", *index, args.torch)
    run(py, "-m", "pip", "install", "--quiet", wheels[0])
    with tempfile.TemporaryDirectory() as tmp:  # not the source tree: the installed package is imported
        run(py, ROOT / "tools" / "smoke_train.py", cwd=Path(tmp))
    print(f"dist: {', '.join(p.name for p in built)} built, checked, installed in {args.venv} and trained")


if __name__ == "__main__":
    main()
