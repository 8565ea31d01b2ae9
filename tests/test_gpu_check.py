"""``make gpu-check`` (benchmarks/gpu_check.sh): a one-line no-op without a CUDA GPU, so CPU-only CI
stays green; with one, the steps it runs (checked here as a dry run behind a fake ``nvidia-smi``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
NO_GPU = "gpu-check: skipped, no CUDA GPU on this machine ("


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without an enclosing make's or gpu-check's variables (``make test`` runs pytest
    inside make; ``make gpu-check`` runs this suite)."""
    drop = {
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
    assert list(steps) == ["install", "env", "pytest", "loss_stage", "train_step"]
    assert "-m pytest --device cuda" in steps["pytest"]
    for bench in ("loss_stage", "train_step"):
        assert f"benchmarks/{bench}.py --device cuda --out {tmp_path / 'out'}" in steps[bench]
    assert lines[-1] == f"gpu-check: done; results in {tmp_path / 'out'}"
    # nothing was created: no virtualenv, no results
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()
