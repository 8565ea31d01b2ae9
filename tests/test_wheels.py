"""``make wheels`` (tools/wheels.py) never resolves torch: against a local index whose torch needs a CUDA
library the index lacks (as PyPI's torch 2.11 needs CUDA 13 libraries a mirror may not serve), a plain
resolution fails and the wheels step still carries every other requirement, at versions that fit the
assumed torch. No network: pip reads a local folder only, with no configuration."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_gpu_check import clean_env, make_wheel

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "wheels.py"
WHEELS = [sys.executable, str(SCRIPT)]
PIP_DRY_RUN = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index"]


def local(index: Path) -> list[str]:
    """tools/wheels.py's pip reads this folder only."""
    return ["--pip-option=--no-index", f"--pip-option=--find-links={index}"]


def _wheels_module():
    spec = importlib.util.spec_from_file_location("tools_wheels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offline_env() -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith("PIP_")}
    unreachable = "http://127.0.0.1:9"
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        HTTP_PROXY=unreachable,
        HTTPS_PROXY=unreachable,
        http_proxy=unreachable,
        https_proxy=unreachable,
    )
    return env


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """torch 2.11.0 needing a CUDA library the folder lacks; a package needing torch and a dependency whose
    newest release needs a torch newer than 2.11."""
    folder = tmp_path / "index"
    make_wheel(folder, "torch", "2.11.0", ["nvidia-cudnn-fake==9.0"], {"torch/__init__.py": ""})
    make_wheel(folder, "demo-pkg", "1.0", ["torch>=2.6", "demo-dep"], {"demo_pkg.py": ""})
    make_wheel(folder, "demo-dep", "1.0", ["torch>=2.0"], {"demo_dep.py": ""})
    make_wheel(folder, "demo-dep", "2.0", ["torch>=2.12"], {"demo_dep.py": ""})
    return folder


def test_a_plain_resolution_fails_on_torchs_missing_cuda_library(index, tmp_path):
    """The control: what `make wheels` did before, resolving torch, stops here."""
    out = subprocess.run(
        [*PIP_DRY_RUN, "--find-links", str(index), "--report", str(tmp_path / "r.json"), "demo-pkg"],
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "nvidia-cudnn-fake" in out.stdout + out.stderr


def test_wheels_carry_everything_but_torch_at_versions_that_fit_the_assumed_torch(index, tmp_path):
    dest = tmp_path / "wheels"
    out = subprocess.run(
        [*WHEELS, "--dest", str(dest), "--torch", "2.11.0", *local(index), "demo-pkg"],
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(w.name for w in dest.glob("*.whl")) == [
        "demo_dep-1.0-py3-none-any.whl",  # 2.0 needs torch >= 2.12
        "demo_pkg-1.0-py3-none-any.whl",
    ]
    assert (dest / "requirements.txt").read_text() == "demo-dep==1.0\ndemo-pkg==1.0\n"
    assert "left out: torch" in out.stdout

    # another assumed torch, another resolution: demo-dep 2.0 now fits; the old wheel is removed
    out = subprocess.run(
        [*WHEELS, "--dest", str(dest), "--torch", "2.12.1+cu130", *local(index), "demo-pkg"],
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(w.name for w in dest.glob("*.whl")) == [
        "demo_dep-2.0-py3-none-any.whl",
        "demo_pkg-1.0-py3-none-any.whl",
    ]


def test_the_standin_version_keeps_the_release_and_refuses_anything_else():
    wheels = _wheels_module()
    assert wheels.standin_version("2.11.0") == "2.11.0+wheels.standin"
    assert wheels.standin_version("2.11.0+cu130") == "2.11.0+wheels.standin"
    with pytest.raises(ValueError, match="--torch"):
        wheels.standin_version("latest")


def _report(requires: list[str], python: str = "3.11.7") -> dict:
    return {
        "environment": {"python_version": python[:4], "python_full_version": python, "sys_platform": "linux"},
        "install": [
            {"metadata": {"name": "a", "version": "1", "requires_dist": requires}, "requested": True},
            {"metadata": {"name": "b", "version": "2", "requires_dist": []}},
            {"metadata": {"name": "nvidia-ml-py", "version": "13", "requires_dist": []}},
            {"metadata": {"name": "nvidia-cublas", "version": "13", "requires_dist": []}},
        ],
    }


def test_the_walk_keeps_nvml_drops_cuda_libraries_and_what_the_target_does_not_need():
    wheels = _wheels_module()
    report = _report(["b; python_version < '3.12'", "nvidia-ml-py", "nvidia-cublas", "torch>=2.6"])
    assert wheels.kept(report, "3.11") == {"a": "1", "b": "2", "nvidia-ml-py": "13"}
    assert wheels.kept(report, "3.12") == {"a": "1", "nvidia-ml-py": "13"}


def test_a_requirement_only_the_targets_python_has_stops_the_run():
    """pip resolved on 3.11 and skipped ``c; python_version >= '3.12'``: the folder would lack it."""
    wheels = _wheels_module()
    report = _report(["c; python_version >= '3.12'"])
    assert wheels.kept(report, "3.11") == {"a": "1"}
    with pytest.raises(
        SystemExit, match=r"c needed on Python 3\.12 but not resolved by pip on Python 3\.11\.7"
    ):
        wheels.kept(report, "3.12")
