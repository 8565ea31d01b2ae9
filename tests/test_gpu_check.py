"""``make gpu-check`` (tools/gpu_check.sh): a one-line no-op without a CUDA GPU, so CPU-only CI
stays green; with one, the steps it runs (checked here as a dry run behind a fake ``nvidia-smi``)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
NO_GPU = "gpu-check: skipped, no CUDA GPU on this machine ("


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without an enclosing make's or gpu-check's variables (``make test`` runs pytest
    inside make; ``make gpu-check`` runs this suite), nor a PYTHONPATH (a checkout on it would shadow the
    package a virtualenv installs)."""
    drop = {
        "PYTHONPATH",
        "MAKEFLAGS",
        "MAKELEVEL",
        "MFLAGS",
        "GPU_CHECK_RUNNING",
        "GPU_CHECK_DRY_RUN",
        "CUDA_VISIBLE_DEVICES",
    }
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def has_gpu() -> bool:
    """The script's own test: nvidia-smi runs and lists a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(line.startswith("GPU ") for line in out.stdout.splitlines())


def fake_nvidia_smi(folder: Path, body: str) -> dict[str, str]:
    """An environment whose ``nvidia-smi`` is a shell script running ``body``."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return clean_env(PATH=f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")


def test_make_gpu_check_is_a_one_line_no_op_without_a_gpu():
    if os.environ.get("GPU_CHECK_RUNNING"):
        pytest.skip("inside `make gpu-check`: it must not start itself again")
    if has_gpu():
        pytest.skip("a CUDA GPU is present: `make gpu-check` would run the whole check")
    out = subprocess.run(
        ["make", "--no-print-directory", "gpu-check"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [out.stdout.strip()], out.stdout
    assert out.stdout.startswith(NO_GPU) and "nothing to check" in out.stdout, out.stdout
    assert out.stderr == ""


@pytest.mark.parametrize(
    ("body", "env", "reason"),
    [
        (
            "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
            {},
            "failed",
        ),
        ("echo 'No devices were found'; exit 0", {}, "lists no GPU"),
        ("echo 'GPU 0: Fake GPU (UUID: GPU-0)'", {"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES"),
        ("echo 'GPU 0: Fake GPU (UUID: GPU-0)'", {"CUDA_VISIBLE_DEVICES": "-1"}, "CUDA_VISIBLE_DEVICES"),
    ],
    ids=["nvidia-smi-fails", "no-gpu-listed", "devices-hidden", "devices-hidden-minus-one"],
)
def test_gpu_check_without_a_usable_gpu_says_why_in_one_line(tmp_path, body, env, reason):
    run_env = {**fake_nvidia_smi(tmp_path / "bin", body), **env, "GPU_OUT": str(tmp_path / "out")}
    out = subprocess.run(["bash", str(SCRIPT)], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [out.stdout.strip()], out.stdout
    assert out.stdout.startswith(NO_GPU) and reason in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()


def test_gpu_check_with_a_gpu_runs_suite_and_benchmarks_on_cuda(tmp_path):
    """Dry run behind a fake nvidia-smi listing a GPU: every step is announced, none is run."""
    env = fake_nvidia_smi(tmp_path / "bin", "echo 'GPU 0: Fake GPU (UUID: GPU-0)'")
    env.update(GPU_CHECK_DRY_RUN="1", GPU_OUT=str(tmp_path / "out"), GPU_VENV=str(tmp_path / "venv"))
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "gpu-check: GPU 0: Fake GPU (UUID: GPU-0)"
    steps = {line.split("]")[0].split("[")[1]: line for line in lines if line.startswith("gpu-check: [")}
    assert list(steps) == ["install", "env", "pytest", "loss_stage", "train_step", "gpu_train_step"]
    assert "-m pytest --device cuda" in steps["pytest"]
    for bench in ("loss_stage", "train_step", "gpu_train_step"):
        assert f"benchmarks/{bench}.py --device cuda --out {tmp_path / 'out'}" in steps[bench]
    assert lines[-1] == f"gpu-check: done; results in {tmp_path / 'out'}"
    # nothing was created: no virtualenv, no results
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


# --- the offline install step (tools/gpu_venv.sh) -------------------------------------------------

VENV_SCRIPT = ROOT / "tools" / "gpu_venv.sh"


def make_wheel(folder: Path, name: str, version: str, requires: list[str], files: dict[str, str]) -> Path:
    """A pure-Python wheel written directly (no build backend, no index): METADATA, WHEEL, RECORD."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    contents = {
        **files,
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in contents.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}\n")
    record.append(f"{info}/RECORD,,\n")
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in contents.items():
            zf.writestr(path, text)
        zf.writestr(f"{info}/RECORD", "".join(record))
    return wheel


def package_wheel(folder: Path, local: str) -> Path:
    """This checkout's package as a wheel, with pyproject.toml's dependencies, its version tagged ``+local``
    (so that a copy of the package this Python already has does not satisfy it). ``make wheels`` builds
    the real one with ``pip wheel``; this one needs no setuptools and no index."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    files = {
        str(p.relative_to(ROOT)): p.read_text()
        for p in sorted((ROOT / "st_cached_losses").rglob("*"))
        if p.is_file() and (p.suffix == ".py" or p.name == "py.typed")
    }
    # the version is written once, in the package (pyproject.toml reads it: dynamic = ["version"])
    written = re.search(
        r'^__version__ = "([^"]+)"', (ROOT / "st_cached_losses" / "__init__.py").read_text(), re.M
    )
    version = f"{project.get('version') or written.group(1)}+{local}"
    return make_wheel(folder, project["name"], version, project["dependencies"], files)


def test_install_step_offline_keeps_the_given_pythons_torch(tmp_path):
    """The install step with a torch already present (GPU_SYSTEM_TORCH=1 stands in for 'CUDA torch'): a
    virtualenv that sees this Python's packages, the package and a dependency from a local wheel folder
    with --no-index and no pip configuration, and the torch this Python has, not reinstalled even though
    the folder offers a newer 'torch' and a requirement asks for it."""
    import torch

    wheels = tmp_path / "wheels"
    package = package_wheel(wheels, "offline").name.split("-")[1]
    make_wheel(wheels, "gpu-check-dummy", "1.0", ["torch>=2.1"], {"gpu_check_dummy.py": "OK = True\n"})
    make_wheel(wheels, "gpu-check-greedy", "1.0", ["torch>=99"], {"gpu_check_greedy.py": "OK = True\n"})
    make_wheel(wheels, "torch", "99.0", [], {"torch/__init__.py": "__version__ = '99.0'\n"})
    venv = tmp_path / "venv"
    env = {k: v for k, v in clean_env().items() if not k.startswith("PIP_")}
    unreachable = "http://127.0.0.1:9"  # any network access fails at once
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # no find-links or extra index from this machine's pip configuration
        HTTP_PROXY=unreachable,
        HTTPS_PROXY=unreachable,
        http_proxy=unreachable,
        https_proxy=unreachable,
        PYTHON=sys.executable,
        GPU_VENV=str(venv),
        GPU_WHEELS=str(wheels),
        GPU_SYSTEM_TORCH="1",
        GPU_OPTIONAL="gpu-check-greedy",
    )
    out = subprocess.run(
        ["bash", str(VENV_SCRIPT), f"st_cached_losses=={package}", "gpu-check-dummy"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    installed = importlib.metadata.version("torch")  # pip's version of it (PyPI's CUDA wheels: no +cu130)
    assert f"gpu-check: torch {installed} of {sys.executable} kept" in out.stdout, out.stdout
    assert f"from {wheels} only (--no-index)" in out.stdout, out.stdout
    # a requirement that needs another torch is refused, and only that one
    assert "gpu-check-greedy did not install" in out.stdout, out.stdout
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()

    probe = (
        "import json, torch, st_cached_losses, gpu_check_dummy, importlib.metadata as md, importlib.util; "
        "print(json.dumps([torch.__version__, torch.__file__, st_cached_losses.__file__, "
        "md.version('st_cached_losses'), "
        "importlib.util.find_spec('gpu_check_greedy') is None]))"
    )
    seen = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seen.returncode == 0, seen.stderr
    version, torch_file, package_file, package_version, greedy_missing = json.loads(seen.stdout)
    assert (version, Path(torch_file).resolve()) == (torch.__version__, Path(torch.__file__).resolve())
    # the package from the wheel folder, into the virtualenv
    assert package_version == package and venv.resolve() in Path(package_file).resolve().parents
    assert greedy_missing
    site_packages = next(venv.glob("lib/python*/site-packages"))
    assert not list(site_packages.glob("torch*")), sorted(p.name for p in site_packages.iterdir())


def test_install_step_offline_with_a_cuda_torch_as_pypi_ships_it(tmp_path):
    """The GPU machine's case: a CUDA torch whose ``torch.__version__`` carries a local label (2.11.0+cu130)
    that its installed distribution does not (PyPI's wheels say 2.11.0), found by the default
    GPU_SYSTEM_TORCH=auto since ``torch.version.cuda`` is set. Pinning the ``+cu130`` matched no installed
    torch, and pip, with --no-index, then found none at all (ResolutionImpossible)."""
    import zipfile

    wheels = tmp_path / "wheels"
    make_wheel(wheels, "gpu-check-dummy", "1.0", ["torch>=2.1"], {"gpu_check_dummy.py": "OK = True\n"})
    make_wheel(wheels, "torch", "99.0", [], {"torch/__init__.py": "__version__ = '99.0'\n"})
    # the stand-in GPU machine's Python: a virtualenv holding only the CUDA-looking torch
    gpu_python = tmp_path / "gpu-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(gpu_python)], check=True, timeout=300)
    standin = make_wheel(
        tmp_path / "standin",
        "torch",
        "2.11.0",
        [],
        {
            "torch/__init__.py": "from torch import version\n__version__ = '2.11.0+cu130'\n",
            "torch/version.py": "cuda = '13.0'\n",
        },
    )
    with zipfile.ZipFile(standin) as zf:
        zf.extractall(next(gpu_python.glob("lib/python*/site-packages")))
    venv = tmp_path / "venv"
    env = {k: v for k, v in clean_env().items() if not k.startswith("PIP_")}
    unreachable = "http://127.0.0.1:9"
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        HTTP_PROXY=unreachable,
        HTTPS_PROXY=unreachable,
        http_proxy=unreachable,
        https_proxy=unreachable,
        PYTHON=str(gpu_python / "bin" / "python"),
        GPU_VENV=str(venv),
        GPU_WHEELS=str(wheels),
        GPU_OPTIONAL="",
    )
    env.pop("GPU_SYSTEM_TORCH", None)
    out = subprocess.run(
        ["bash", str(VENV_SCRIPT), "gpu-check-dummy"], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"gpu-check: torch 2.11.0 of {gpu_python / 'bin' / 'python'} kept" in out.stdout, out.stdout
    assert "gpu-check: torch 2.11.0 (2.11.0+cu130) from " in out.stdout, out.stdout
    seen = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch, gpu_check_dummy; print(torch.__version__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seen.returncode == 0 and seen.stdout.strip() == "2.11.0+cu130", seen.stdout + seen.stderr
