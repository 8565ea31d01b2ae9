"""One check of the loss stage's Triton kernels (``functional/softmax/flash.py``), shared by the interpreter's run on a
CPU (a subprocess with ``TRITON_INTERPRET=1``, which must be set before Triton is imported) and the native
run on CUDA (in the test's own process): the kernels' loss and gradients against float64 and against the
torch tiles at the same precision, with the kernels' launches counted (a silent fallback cannot pass) and,
with ``case["fault"]``, a planted fault in one gradient block that the same checks must catch.

``python -m tests.support.triton_case '<case as JSON>'`` prints the result as one line of JSON."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from st_cached_losses.functional import infonce_loss_and_grad
from st_cached_losses.functional.softmax import flash
from st_cached_losses.functional.softmax.options import Bank
from tests.support.reference import reference_infonce


def check(case: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Run ``case`` (batch ``b``, width ``d``, ``k`` candidate columns at distance ``near`` from the anchors,
    ``scale``, ``sym``, ``path``, ``prec``; optional ``offset`` rows of other processes before these, ``bank``
    rows, ``fault``) with the kernels on, then off, and against float64; the numbers the tests compare."""
    launches: list[str] = []
    real_launch = flash._launch

    def counting(name, args, *rest, **kw):
        launches.append(name)
        real_launch(name, args, *rest, **kw)
        if case.get("fault") and name == "grad":  # planted: one gradient row block doubled
            args[9][:4] *= 2.0

    flash._launch = counting
    try:
        return _check(case, device, launches)
    finally:
        flash._launch = real_launch


def _check(case: dict[str, Any], device: str, launches: list[str]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(case["b"])
    b, d, near = case["b"], case["d"], case["near"]
    q = torch.randn(b, d, generator=g)
    cols = [q + near * torch.randn(b, d, generator=g) for _ in range(case["k"])]
    q, cols = q.bfloat16().to(device), [c.bfloat16().to(device) for c in cols]
    bank = torch.randn(case["bank"], d, generator=g).bfloat16().to(device) if case.get("bank") else None
    kw: dict[str, Any] = dict(
        symmetric=case["sym"], path=case["path"], tile_size=16, matmul_precision=case["prec"]
    )
    if bank is not None:
        kw["bank"] = Bank(bank)

    def run():
        s = torch.tensor(case["scale"], requires_grad=True, device=device)
        if case.get("offset"):  # this process's rows against columns gathered around them
            o = case["offset"]
            gen = torch.Generator().manual_seed(7)
            other = [torch.randn(o, d, generator=gen).bfloat16().to(device) for _ in cols]
            full = [torch.cat([x, c]) for x, c in zip(other, cols)]
            out = infonce_loss_and_grad(q, full, scale=s, row_offset=o, **kw)
            return out.loss, [out.grad_anchors] + [gc[o:] for gc in out.grad_candidates], out.grad_scale, full
        out = infonce_loss_and_grad(q, cols, scale=s, **kw)
        return out.loss, [out.grad_anchors, *out.grad_candidates], out.grad_scale, cols

    previous = os.environ.get("ST_CACHED_LOSSES_KERNELS")
    os.environ["ST_CACHED_LOSSES_KERNELS"] = "1"
    try:
        loss, grads, g_s, full = run()
        n_launch = len(launches)
        os.environ["ST_CACHED_LOSSES_KERNELS"] = "0"
        t_loss, t_grads, t_s, _ = run()
    finally:
        if previous is None:
            os.environ.pop("ST_CACHED_LOSSES_KERNELS", None)
        else:
            os.environ["ST_CACHED_LOSSES_KERNELS"] = previous

    q64 = q.cpu().double().requires_grad_()
    c64 = [c.cpu().double().requires_grad_() for c in full]
    s64 = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    ref = reference_infonce(
        q64, c64, scale=s64, symmetric=case["sym"], row_offset=case.get("offset", 0),
        bank_candidates=bank.cpu().double() if bank is not None else None,
    )  # fmt: skip
    r = torch.autograd.grad(ref, [q64, *c64, s64])
    o = case.get("offset", 0)
    r_grads = [r[0]] + [x[o:] for x in r[1:-1]]
    top = max(float(x.abs().max()) for x in r_grads)

    def err(a: torch.Tensor, b_: torch.Tensor) -> float:
        return float((a.cpu().double() - b_.cpu().double()).abs().max())

    return {
        "launches": n_launch,
        "loss": float(loss),
        "ref_loss": float(ref),
        "torch_loss": float(t_loss),
        "grad_err": max(err(a, b_) for a, b_ in zip(grads, r_grads)) / top,
        "vs_torch": max(err(a, b_) for a, b_ in zip(grads, t_grads)) / top,
        "min_grad": min(float(x.abs().max()) for x in grads),
        "scale": float(g_s),
        "ref_scale": float(r[-1]),
        "torch_scale": float(t_s),
        "dtypes": sorted({str(x.dtype) for x in grads}),
    }


if __name__ == "__main__":
    print(json.dumps(check(json.loads(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu")))
