"""The Triton kernels of the loss stage (``functional/flash.py``) under Triton's interpreter on a CPU: each
case runs in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before Triton is imported) and
``ST_CACHED_LOSSES_KERNELS=1``, tiny shapes (the interpreter is slow), blocks of 16 rows so that the batches
cut into uneven tiles. The kernels' result is checked against float64 (values, every gradient, a learnable
scale's gradient) and against the torch tiles at the same precision; the kernels must have run (launches
counted), and a planted fault in a kernel's output must fail the same checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from st_cached_losses.functional import flash, infonce_loss_and_grad
    from st_cached_losses.functional.parallel import gathered_loss_and_grad
    from st_cached_losses.functional.options import Bank
    from tests.support.reference import reference_infonce

    case = json.loads(sys.argv[1])
    launches = []
    real_launch = flash._launch
    def counting(name, args, *rest, **kw):
        launches.append(name)
        real_launch(name, args, *rest, **kw)
        if case.get("fault") and name == "grad":  # planted: one gradient row block doubled
            args[9][:4] *= 2.0
    flash._launch = counting

    g = torch.Generator().manual_seed(case["b"])
    b, d, near = case["b"], case["d"], case["near"]
    q = torch.randn(b, d, generator=g)
    cols = [q + near * torch.randn(b, d, generator=g) for _ in range(case["k"])]
    q, cols = q.bfloat16(), [c.bfloat16() for c in cols]
    bank = torch.randn(case.get("bank", 0), d, generator=g).bfloat16() if case.get("bank") else None
    kw = dict(symmetric=case["sym"], path=case["path"], tile_size=16, matmul_precision=case["prec"])
    if bank is not None:
        kw["bank"] = Bank(bank)

    def run():
        s = torch.tensor(case["scale"], requires_grad=True)
        if case.get("offset"):  # this process's rows against columns gathered around them
            o = case["offset"]
            other = [torch.randn(o, d, generator=torch.Generator().manual_seed(7)).bfloat16() for _ in cols]
            full = [torch.cat([x, c]) for x, c in zip(other, cols)]
            out = infonce_loss_and_grad(q, full, scale=s, row_offset=o, **kw)
            return out.loss, [out.grad_anchors] + [gc[o:] for gc in out.grad_candidates], out.grad_scale, full
        out = infonce_loss_and_grad(q, cols, scale=s, **kw)
        return out.loss, [out.grad_anchors, *out.grad_candidates], out.grad_scale, cols

    import os
    loss, grads, g_s, full = run()
    n_launch = len(launches)
    os.environ["ST_CACHED_LOSSES_KERNELS"] = "0"
    t_loss, t_grads, t_s, _ = run()
    os.environ["ST_CACHED_LOSSES_KERNELS"] = "1"

    q64 = q.double().requires_grad_()
    c64 = [c.double().requires_grad_() for c in full]
    s64 = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    ref = reference_infonce(q64, c64, scale=s64, symmetric=case["sym"], row_offset=case.get("offset", 0),
                            bank_candidates=bank.double() if bank is not None else None)
    r = torch.autograd.grad(ref, [q64, *c64, s64])
    o = case.get("offset", 0)
    r_grads = [r[0]] + [x[o:] for x in r[1:-1]]
    top = max(float(x.abs().max()) for x in r_grads)
    err = lambda a, b_: float((a.double() - b_.double()).abs().max())
    print(json.dumps({
        "launches": n_launch,
        "loss": float(loss), "ref_loss": float(ref), "torch_loss": float(t_loss),
        "grad_err": max(err(a, b_) for a, b_ in zip(grads, r_grads)) / top,
        "vs_torch": max(err(a, b_) for a, b_ in zip(grads, t_grads)) / top,
        "min_grad": min(float(x.abs().max()) for x in grads),
        "scale": float(g_s), "ref_scale": float(r[-1]), "torch_scale": float(t_s),
        "dtypes": sorted({str(x.dtype) for x in grads}),
    }))
    """
)


def _run(case: dict) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", ST_CACHED_LOSSES_KERNELS="1", PYTHONPATH=root)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(case)], env=env, capture_output=True, text=True, timeout=600
    )
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


@pytest.mark.parametrize("change", CASES)
def test_kernels_against_float64_and_the_torch_tiles(change):
    case = {**BASE, **change}
    got = _run(case)
    assert got["launches"] > 0, "the kernels did not run"
    assert got["min_grad"] > 0
    assert got["dtypes"] == ["torch.bfloat16"]
    loose = (
        case["scale"] == 100.0
    )  # bf16 operands at scale 100 with cosines near 1: see test_matmul_precision
    # one bf16 row of 40 lanes moves a logit by ~scale * 2^-9: a loss near 0.1 (B = 1) by ~2e-3
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=2e-2 if loose else 5e-3, abs=2e-3)
    assert got["grad_err"] <= (0.2 if loose else 2e-2)
    # the torch tiles at the same precision round the probabilities elsewhere (bf16 noise), nothing more
    assert got["loss"] == pytest.approx(got["torch_loss"], rel=1e-5)
    assert got["vs_torch"] <= (0.1 if loose else 1e-2)
    assert got["scale"] == pytest.approx(got["torch_scale"], rel=1e-3, abs=1e-5)
    assert got["scale"] == pytest.approx(got["ref_scale"], rel=5e-2, abs=5e-3)


def test_a_planted_fault_fails_the_checks():
    got = _run({**BASE, "fault": True})
    assert got["launches"] > 0
    assert got["grad_err"] > 2e-2 or got["vs_torch"] > 1e-2
