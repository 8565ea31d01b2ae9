"""``make wheels``: a folder of wheels that lets ``make gpu-check`` install the package on a GPU machine
with no network and a CUDA torch already installed.

On a connected machine it
  0. builds here a wheel of each distribution the index serves only as a source archive (deepspeed):
     it resolves once for this Python, which may use source archives, and runs ``pip wheel --no-deps``
     on those it would build. Step 1 cannot: a resolution for another Python or platform takes wheels
     only (pip refuses source archives there, since it cannot build them for the target), and without
     this it would pick an old release that happens to have a wheel (deepspeed 0.3.1.dev3, which needs
     torchvision and tensorboardX 1.8) or fail. Only pure-Python wheels (``none-any``) are kept; a
     platform wheel built here would be for this machine, not the target, and stops the run;
  1. resolves the package with its ``dev`` and ``examples`` extras, ``inf-cl`` and the package's build
     requirements (an editable install builds it) for a target Python and platform
     (``pip install --dry-run --ignore-installed --report``: nothing is installed here), with torch
     taken out of the resolution (below) and the wheels of step 0 offered (``--find-links``);
  2. keeps every resolved distribution except PyTorch's own stack: ``torch``, ``triton``,
     ``pytorch-triton``, the CUDA libraries (``nvidia-*`` but ``nvidia-ml-py``, which is NVML's Python
     binding that DeepSpeed asks for, not a part of torch) and ``cuda-*``, and whatever is reachable
     from the requested distributions only through them. The GPU machine brings its own torch with
     these;
  3. downloads the kept distributions with ``--no-deps`` at the resolved versions, binary wheels only,
     for that Python and platform (so pip never fetches torch);
  4. adds a wheel of the package itself (``pip wheel --no-deps .``) and prints the folder's size.

Why torch is kept out of the resolution, and how. Resolving torch for the target means resolving the
CUDA libraries its Linux wheels require, at the versions its release pins; torch 2.11's are CUDA 13
builds (``nvidia-cudnn-cu13``, ``nvidia-cublas``, ...) that a registry or mirror need not serve, and
then pip stops with ``ResolutionImpossible`` although nothing here wants those libraries.
So the resolution never sees a real torch: a *stand-in* ``torch`` wheel is written to a temporary
folder (``py3-none-any``, no requirements, version ``<--torch>+wheels.standin``, by default 2.11.0,
the GPU machine's torch), that folder is added with ``--find-links``, and a constraint
``torch==<that version>`` is given. A constraint with a local version label (``+wheels.standin``)
matches that label exactly (PEP 440), so no index's torch can satisfy it and the stand-in is the only
candidate; every requirement on torch (``torch>=2.6``, accelerate's, peft's, ...) is still checked
against its version, so what is resolved fits a torch of that version. Because the stand-in requires
nothing, none of torch's own requirements enter the resolution. This keeps pip's resolver for
everything else (markers, extras, the constraints in constraints.txt, the target's tags), which a walk
of our own over ``--no-deps`` downloads would have to redo; and a plain constraint cannot do it (it only
narrows which torch, it never removes torch's requirements).

``python tools/wheels.py --dest wheels --python-version 3.12 --platform manylinux_2_28_x86_64 ...``
``python tools/wheels.py --dest D --pip-option=--no-index --pip-option=--find-links=F some-package``
(requirements named: those instead of the package, no package wheel; tests/test_wheels.py)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: PyTorch and the CUDA libraries and compiler it pulls: the GPU machine has its own
EXCLUDED = re.compile(r"^(torch|triton|pytorch-triton|nvidia-(?!ml-py$).*|cuda-.*)$")
DEFAULT_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
#: the torch the resolution assumes by default: the GPU machine's (torch 2.11.0+cu130)
DEFAULT_TORCH = "2.11.0"
#: the local version label of the stand-in torch wheel; no index serves a torch with it
STANDIN_LABEL = "wheels.standin"


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


def standin_version(torch: str) -> str:
    """``2.11.0`` (or ``2.11.0+cu130``: the label is replaced) -> ``2.11.0+wheels.standin``."""
    public = torch.split("+")[0].strip()
    if not re.fullmatch(r"\d+(\.\d+)*", public):
        raise ValueError(f"--torch {torch!r}: give a release such as 2.11.0 (the GPU machine's torch)")
    return f"{public}+{STANDIN_LABEL}"


def torch_standin(folder: Path, version: str) -> Path:
    """A ``torch`` wheel of this version that requires nothing and holds no code: what the resolution
    sees instead of PyTorch. Written directly (METADATA, WHEEL, RECORD), so no build and no index."""
    info = f"torch-{version}.dist-info"
    contents = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        "Summary: stand-in for the target's own torch while tools/wheels.py resolves\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tools/wheels.py\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}\n")
    record.append(f"{info}/RECORD,,\n")
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in contents.items():
            zf.writestr(path, text)
        zf.writestr(f"{info}/RECORD", "".join(record))
    return wheel


def kept(report: dict, python_version: str) -> dict[str, str]:
    """name -> version of the resolved distributions reachable from the requested ones without passing
    through an excluded one, following only the requirements whose markers hold on the target (its
    Python version; the extras asked of each distribution along the way).

    pip evaluates markers for the Python that runs it, whatever ``--python-version`` says: this walk drops
    what only that Python needs, but cannot add what only the target needs. A requirement that holds on
    the target and is missing from the resolution is such a case, and stops the run (run this with the
    target's Python: the Makefile does where one is installed)."""
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
    missing: set[str] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or EXCLUDED.match(name):
            continue
        if name not in items:
            missing.add(name)
            continue
        seen.add((name, extras))
        keep.add(name)
        for line in items[name]["metadata"].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras or {""}):
                todo.append((canonical(req.name), frozenset(req.extras)))
    if missing:
        raise SystemExit(
            f"wheels: {', '.join(sorted(missing))} needed on Python {python_version} but not resolved by pip "
            f"on Python {report['environment'].get('python_full_version', '?')} (a marker on the Python "
            f"version): run tools/wheels.py with a Python {python_version} (make wheels WHEELS_HOST=...)"
        )
    return {name: items[name]["metadata"]["version"] for name in sorted(keep)}


def from_source(report: dict) -> dict[str, str]:
    """name -> version of the resolved distributions pip would build from a source archive (those whose
    chosen file is not a wheel; a local project, this checkout, is not one of them)."""
    out = {}
    for item in report["install"]:
        info = item.get("download_info", {})
        if "dir_info" in info:
            continue
        if not info.get("url", "").split("#")[0].endswith(".whl"):
            out[canonical(item["metadata"]["name"])] = item["metadata"]["version"]
    return out


def run(cmd: list[str]) -> None:
    print("wheels:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "requirements",
        nargs="*",
        help="what to carry instead of this checkout with --extras, --also and its build requirements "
        "(then no wheel of the package is built)",
    )
    parser.add_argument("--dest", type=Path, default=ROOT / "wheels")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--implementation", default="cp")
    parser.add_argument("--platform", action="append", dest="platforms")
    parser.add_argument(
        "--torch",
        default=DEFAULT_TORCH,
        help="the target's torch version; the resolution assumes it, without resolving torch itself",
    )
    parser.add_argument(
        "--extras", default="dev,examples", help="the package's extras to carry (comma-separated)"
    )
    parser.add_argument("--also", nargs="*", default=["inf-cl"], help="further requirements to carry")
    parser.add_argument(
        "--pip-option",
        action="append",
        default=[],
        help="an option for pip's resolve and download, e.g. --pip-option=--no-index (repeatable)",
    )
    args = parser.parse_args(argv)
    platforms = args.platforms or DEFAULT_PLATFORMS
    target = ["--only-binary=:all:", "--python-version", args.python_version]
    target += ["--implementation", args.implementation]
    for platform in platforms:
        target += ["--platform", platform]
    pip = [sys.executable, "-m", "pip"]
    args.dest.mkdir(parents=True, exist_ok=True)
    if args.requirements:
        requested, own_wheel = list(args.requirements), False
    else:
        package = f"{ROOT}[{args.extras}]" if args.extras else str(ROOT)
        requested, own_wheel = [package, *args.also, *build_requirements()], True

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        torch = standin_version(args.torch)
        torch_standin(Path(tmp) / "standin", torch)
        (Path(tmp) / "standin.txt").write_text(f"torch=={torch}\n")
        standin = ["--find-links", str(Path(tmp) / "standin"), "-c", str(Path(tmp) / "standin.txt")]
        report_to = ["--report", str(report_path)]
        resolve = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", *report_to]
        constraints = ["-c", str(ROOT / "constraints.txt")]  # the dev environment's holds
        # 0. wheels of what the index has only as source archives, built here
        built = Path(tmp) / "built"
        built.mkdir()
        run([*resolve, *args.pip_option, *standin, *constraints, *requested])
        for name, version in from_source(json.loads(report_path.read_text())).items():
            build = [*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(built), *args.pip_option]
            run([*build, f"{name}=={version}"])
        for wheel in built.glob("*.whl"):
            if not wheel.name.endswith("-none-any.whl"):
                raise SystemExit(
                    f"wheels: {wheel.name} was built here for this machine; the index has no wheel of it "
                    f"for CPython {args.python_version} on {', '.join(platforms)}: build it there"
                )
        offer = ["--find-links", str(built)]
        # 1. the resolution for the target
        run([*resolve, *target, *args.pip_option, *standin, *offer, *constraints, *requested])
        report = json.loads(report_path.read_text())
        versions = kept(report, args.python_version)
        versions.pop(canonical("st_cached_losses"), None)  # built below from this checkout
        dropped = sorted(canonical(i["metadata"]["name"]) for i in report["install"])
        dropped = [name for name in dropped if name not in versions and name != "st-cached-losses"]
        pins = args.dest / "requirements.txt"
        pins.write_text("".join(f"{name}=={version}\n" for name, version in versions.items()))
        print(f"wheels: {len(versions)} distributions to download; left out: {', '.join(dropped)}")
        download = [*pip, "download", "--quiet", "--no-deps", "--dest", str(args.dest), *target]
        run([*download, *args.pip_option, *offer, "-r", str(pins)])
    if own_wheel:
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
        f"(CPython {args.python_version}, {', '.join(platforms)}; for torch {args.torch}, not included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
