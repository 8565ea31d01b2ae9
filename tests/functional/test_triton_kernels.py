"""The Triton kernels of the loss stage (``functional/softmax/flash.py``) under Triton's interpreter on a CPU, and
natively on CUDA (``--device cuda``; ``make gpu-check``). On a CPU each case runs in a subprocess with
``TRITON_INTERPRET=1`` (it must be set before Triton is imported) and ``ST_CACHED_LOSSES_KERNELS=1``, tiny
shapes (the interpreter is slow), blocks of 16 rows so that the batches cut into uneven tiles; CUDA adds the
real layout (d = 384). The kernels' result is checked against float64 (values, every gradient, a learnable
scale's gradient) and against the torch tiles at the same precision; the kernels must have run (launches
counted), and a planted fault in a kernel's output must fail the same checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _run(case: dict, device: str) -> dict:
    """The check of ``case`` on ``device``: natively in this process on CUDA, in the interpreter in a
    subprocess on a CPU."""
    if device == "cuda":
        from tests.support.triton_case import check

        return check(case, "cuda")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", ST_CACHED_LOSSES_KERNELS="1", PYTHONPATH=root)
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_case", json.dumps(case)],
        env=env, capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


BASE = {
    "b": 37,
    "d": 40,
    "k": 2,
    "near": 1.0,
    "scale": 20.0,
    "sym": False,
    "path": "chunked",
    "prec": "medium",
}
CASES = [
    pytest.param({}, id="one-fused"),
    pytest.param({"sym": True}, id="sym"),
    pytest.param({"path": "tiled"}, id="one-tiled"),
    pytest.param({"sym": True, "path": "tiled", "prec": "high"}, id="sym-tf32"),
    pytest.param({"b": 1}, id="b1"),
    pytest.param({"offset": 21, "k": 1}, id="row-offset"),
    pytest.param({"bank": 19}, id="bank"),
    pytest.param({"scale": 100.0, "near": 0.05, "sym": True}, id="scale100-near1"),
]


#: on CUDA also the real layout (d = 384 as 3 chunks of 128) with a batch that cuts into uneven blocks
CUDA_CASES = [
    pytest.param({"b": 300, "d": 384}, id="d384"),
    pytest.param({"b": 300, "d": 384, "sym": True}, id="d384-sym"),
    pytest.param({"b": 300, "d": 384, "sym": True, "prec": "high"}, id="d384-sym-tf32"),
]


@pytest.mark.parametrize("change", CASES + CUDA_CASES)
def test_kernels_against_float64_and_the_torch_tiles(change, device):
    if device == "cpu" and change in [c.values[0] for c in CUDA_CASES]:
        pytest.skip("the interpreter is too slow for d = 384 at B = 300; runs on CUDA")
    case = {**BASE, **change}
    got = _run(case, device)
    assert got["launches"] > 0, "the kernels did not run"
    assert got["min_grad"] > 0
    assert got["dtypes"] == ["torch.bfloat16"]
    loose = (
        case["scale"] == 100.0
    )  # bf16 operands at scale 100 with cosines near 1: see test_matmul_precision
    # one bf16 row of 40 lanes moves a logit by ~scale * 2^-9: a loss near 0.1 (B = 1) by ~2e-3
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=2e-2 if loose else 5e-3, abs=2e-3)
    assert got["grad_err"] <= (0.2 if loose else 2e-2)
    # the torch tiles at the same precision round the probabilities elsewhere (bf16 noise), nothing more; on
    # CUDA, TF32 products ("high") round the fp32 operands in the kernel and in cuBLAS each their own way
    tf32_on_cuda = device == "cuda" and case["prec"] == "high"
    assert got["loss"] == pytest.approx(got["torch_loss"], rel=2e-4 if tf32_on_cuda else 1e-5)
    assert got["vs_torch"] <= (0.1 if loose else 1e-2)
    assert got["scale"] == pytest.approx(got["torch_scale"], rel=1e-3, abs=1e-5)
    assert got["scale"] == pytest.approx(got["ref_scale"], rel=5e-2, abs=5e-3)


def test_a_planted_fault_fails_the_checks(device):
    got = _run({**BASE, "fault": True}, device)
    assert got["launches"] > 0
    assert got["grad_err"] > 2e-2 or got["vs_torch"] > 1e-2
