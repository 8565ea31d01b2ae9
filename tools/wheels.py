"""``make wheels``: a folder of wheels that lets ``make gpu-check`` install the package on a GPU machine
with no network and a CUDA torch already installed.

On a connected machine it
  1. resolves the package with its ``dev`` and ``examples`` extras, ``inf-cl`` and the package's build
     requirements (an editable install builds it) for a target Python and platform
     (``pip install --dry-run --ignore-installed --report``: nothing is installed here);
  2. keeps every resolved distribution except PyTorch and what only PyTorch needs: ``torch``,
     ``triton``, ``nvidia-*`` and ``cuda-*`` are dropped, and so is whatever is reachable from the
     requested ones only through them (sympy, networkx, ...). The GPU machine brings its own torch;
  3. downloads the kept distributions with ``--no-deps`` at the resolved versions, binary wheels only,
     for that Python and platform (so pip never sees torch here);
  4. adds a wheel of the package itself (``pip wheel --no-deps .``) and prints the folder's size.

``python tools/wheels.py --dest wheels --python-version 3.12 --platform manylinux_2_28_x86_64 ...``
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: PyTorch and the CUDA libraries and compiler it pulls: the GPU machine has its own
EXCLUDED = re.compile(r"^(torch|triton|pytorch-triton|nvidia-.*|cuda-.*)$")
DEFAULT_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def canonical(name: str) -> str:
    """PEP 503 normalised name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_requirements() -> list[str]:
    """``[build-system] requires`` of pyproject.toml (an editable install builds the package)."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the one-line list this pyproject.toml has
        match = re.search(r"^\[build-system\][^\[]*?^requires\s*=\s*\[([^\]]*)\]", text, re.M | re.S)
        if match is None:
            raise ValueError("no [build-system] requires in pyproject.toml") from None
        return re.findall(r"[\"']([^\"']+)[\"']", match.group(1))
    return list(tomllib.loads(text)["build-system"]["requires"])


def kept(report: dict, python_version: str) -> dict[str, str]:
    """name -> version of the resolved distributions reachable from the requested ones without passing
    through an excluded one, following only the requirements whose markers hold on the target (its
    Python version; the extras asked of each distribution along the way)."""
    from packaging.requirements import Requirement

    env = {
        **report["environment"],
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
    }
    items = {canonical(i["metadata"]["name"]): i for i in report["install"]}
    todo = [
        (name, frozenset(i.get("requested_extras") or ())) for name, i in items.items() if i.get("requested")
    ]
    seen: set[tuple[str, frozenset[str]]] = set()
    keep: set[str] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or EXCLUDED.match(name) or name not in items:
            continue
        seen.add((name, extras))
        keep.add(name)
        for line in items[name]["metadata"].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras or {""}):
                todo.append((canonical(req.name), frozenset(req.extras)))
    return {name: items[name]["metadata"]["version"] for name in sorted(keep)}


def run(cmd: list[str]) -> None:
    print("wheels:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / "wheels")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--implementation", default="cp")
    parser.add_argument("--platform", action="append", dest="platforms")
    parser.add_argument(
        "--extras", default="dev,examples", help="the package's extras to carry (comma-separated)"
    )
    parser.add_argument("--also", nargs="*", default=["inf-cl"], help="further requirements to carry")
    args = parser.parse_args(argv)
    platforms = args.platforms or DEFAULT_PLATFORMS
    target = ["--only-binary=:all:", "--python-version", args.python_version]
    target += ["--implementation", args.implementation]
    for platform in platforms:
        target += ["--platform", platform]
    pip = [sys.executable, "-m", "pip"]
    args.dest.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        package = f"{ROOT}[{args.extras}]" if args.extras else str(ROOT)
        report_to = ["--report", str(report_path)]
        resolve = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", *report_to]
        constraints = ["-c", str(ROOT / "constraints.txt")]  # the dev environment's holds
        run([*resolve, *target, package, *args.also, *build_requirements(), *constraints])
        report = json.loads(report_path.read_text())
    versions = kept(report, args.python_version)
    versions.pop(canonical("st_cached_losses"), None)  # built below from this checkout
    dropped = sorted(canonical(i["metadata"]["name"]) for i in report["install"])
    dropped = [name for name in dropped if name not in versions and name != "st-cached-losses"]
    pins = args.dest / "requirements.txt"
    pins.write_text("".join(f"{name}=={version}\n" for name, version in versions.items()))
    print(f"wheels: {len(versions)} distributions to download; left out: {', '.join(dropped)}")
    run([*pip, "download", "--quiet", "--no-deps", "--dest", str(args.dest), *target, "-r", str(pins)])
    run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(args.dest), str(ROOT)])
    for wheel in args.dest.glob("*.whl"):  # left by an earlier run for other versions
        name, version = wheel.name.split("-")[:2]
        if canonical(name) != "st-cached-losses" and versions.get(canonical(name)) != version:
            print(f"wheels: removing {wheel.name} (not in this resolution)")
            wheel.unlink()

    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:9.2f} MiB  {wheel.name}")
    print(
        f"wheels: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest} "
        f"(CPython {args.python_version}, {', '.join(platforms)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
