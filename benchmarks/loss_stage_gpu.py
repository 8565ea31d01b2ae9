"""The loss stage on tensor cores: ours at each ``matmul_precision`` (torch tiles and Triton kernels) against
memeff 0.3.1 (Triton kernels for CLIP / InfoNCE, skipped where it or CUDA is missing) and the matmul bound.

Loss + gradient wrt every embedding, cosine, scale 20, d = 384, bf16 embeddings, one direction
(``infonce_loss_and_grad``) and symmetric. For each contender: the median time (CUDA events; wall clock on
a CPU), the peak memory beyond the inputs (``torch.cuda.max_memory_allocated``; on a CPU the live tensor
bytes, ``tests/support/memory.PeakMemory``), and the accuracy against float64 on the bf16 embeddings (the
loss's relative error, the largest gradient error over the largest gradient entry; float64 on the GPU is
chunked, so it fits). The matmul bound is the bare bf16 GEMMs any exact method does (one direction: 3 of
``B x B x d``; symmetric: 4), cuBLAS, chunked.

Run on a GPU: ``python benchmarks/loss_stage_gpu.py --out benchmarks/results/gpu`` (defaults: B = 16,384 and
65,536). On a CPU, small: ``python benchmarks/loss_stage_gpu.py --device cpu --sizes 512,2048 --out /tmp/x``
(no Triton kernels there). Writes ``loss_stage_gpu.csv`` and ``.md`` under ``--out``."""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.functional import infonce_loss_and_grad

SCALE = 20.0


def inputs(b: int, d: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    p = q + 3.0 * torch.randn(b, d, generator=g)
    return q.to(device, torch.bfloat16), p.to(device, torch.bfloat16)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes(fn, device: torch.device) -> float:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from tests.support.memory import PeakMemory

    with PeakMemory(device) as mem:
        fn()
    return mem.peak_bytes


def float64_reference(q, p, symmetric: bool, chunk: int = 4096):
    """Loss and gradients in float64, chunked over rows (the B x B matrix never whole)."""
    qn = torch.nn.functional.normalize(q.double(), dim=1)
    pn = torch.nn.functional.normalize(p.double(), dim=1)
    b = q.shape[0]

    def lse_rows(x, y):
        out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
        for r0 in range(0, x.shape[0], chunk):
            out[r0 : r0 + chunk] = torch.logsumexp(SCALE * x[r0 : r0 + chunk] @ y.T, 1)
        return out

    pos = SCALE * (qn * pn).sum(1)
    lq = lse_rows(qn, pn)
    loss = (lq - pos).mean()
    lp = lse_rows(pn, qn) if symmetric else None
    if symmetric:
        loss = (loss + (lp - pos).mean()) / 2
    w = 0.5 if symmetric else 1.0
    g_qn, g_pn = torch.zeros_like(qn), torch.zeros_like(pn)
    for r0 in range(0, b, chunk):
        s = SCALE * qn[r0 : r0 + chunk] @ pn.T  # (c, B)
        g = w * torch.exp(s - lq[r0 : r0 + chunk, None])
        if symmetric:
            g += w * torch.exp(s - lp[None, :])
        idx = torch.arange(r0, min(r0 + chunk, b), device=q.device)
        g[idx - r0, idx] -= 2 * w if symmetric else w
        g_qn[r0 : r0 + chunk] = SCALE * g @ pn / b
        g_pn += SCALE * g.T @ qn[r0 : r0 + chunk] / b

    def back(x, gx):  # through the normalisation
        xn = torch.nn.functional.normalize(x, dim=1)
        return (gx - xn * (gx * xn).sum(1, keepdim=True)) / x.norm(dim=1, keepdim=True)

    return float(loss), back(q.double(), g_qn), back(p.double(), g_pn)


def accuracy(out, ref) -> tuple[float, float]:
    loss, g_q, g_p = out
    r_loss, r_q, r_p = ref
    pairs = [(g_q, r_q)] if g_p is None else [(g_q, r_q), (g_p, r_p)]  # None: a locked tower (memeff's LiT)
    top = max(float(r.abs().max()) for _, r in pairs)
    err = max(float((g.double() - r).abs().max()) for g, r in pairs)
    return abs(float(loss) - r_loss) / abs(r_loss), err / top


def ours(q, p, symmetric: bool, precision: str, kernels: bool):
    def run():
        os.environ["ST_CACHED_LOSSES_KERNELS"] = "1" if kernels else "0"
        try:
            out = infonce_loss_and_grad(q, p, scale=SCALE, symmetric=symmetric, matmul_precision=precision)
        finally:
            os.environ.pop("ST_CACHED_LOSSES_KERNELS", None)
        return out.loss, out.grad_anchors, out.grad_candidates[0]

    return run


def memeff_contenders(q, p, symmetric: bool) -> dict:
    """memeff 0.3.1's losses, their temperature 1 / SCALE, ``stable=False`` (the plain gradient), gradients by
    autograd; none where it is not installed. Symmetric: ``MemoryEfficientCLIPLoss`` (both towers).
    One direction: ``MemoryEfficientQwen3Loss`` with ``margin=2`` (its false-negative mask off: query -> document
    InfoNCE, both towers get gradients, as ours), and ``MemoryEfficientLiTLoss`` (the document tower locked:
    the anchors' gradient only, half the work; its accuracy is over that gradient alone)."""
    try:
        import memeff
    except ImportError:
        return {}
    if symmetric:
        losses = {"memeff-0.3.1-clip": memeff.MemoryEfficientCLIPLoss(temperature=1.0 / SCALE, stable=False)}
    else:
        losses = {
            "memeff-0.3.1-qwen3": memeff.MemoryEfficientQwen3Loss(
                temperature=1.0 / SCALE, margin=2.0, stable=False
            ),
            "memeff-0.3.1-lit(anchors only)": memeff.MemoryEfficientLiTLoss(
                temperature=1.0 / SCALE, stable=False
            ),
        }

    def runner(loss_fn, locked: bool):
        def run():
            qq = q.detach().requires_grad_()
            pp = p.detach() if locked else p.detach().requires_grad_()
            loss = loss_fn(qq, pp)
            if locked:
                (g_q,) = torch.autograd.grad(loss, [qq])
                return loss.detach(), g_q, None
            g_q, g_p = torch.autograd.grad(loss, [qq, pp])
            return loss.detach(), g_q, g_p

        return run

    return {name: runner(fn, "lit" in name) for name, fn in losses.items()}


def matmul_bound(q, p, symmetric: bool):
    """The bare bf16 GEMMs, chunked: 3 per row block one direction, 4 symmetric."""
    b = q.shape[0]
    chunk = 8192

    def run():
        gq = torch.empty_like(q)
        gp = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for r0 in range(0, b, chunk):
            qs = q[r0 : r0 + chunk]
            s = (qs @ p.T).to(q.dtype)
            if symmetric:
                s = (qs @ p.T).to(q.dtype)
            torch.mm(s, p, out=gq[r0 : r0 + chunk])
            gp += (s.T @ qs).float()

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16384,65536")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/gpu")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the float64 references")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --device cpu --sizes 512,2048")
    cuda = device.type == "cuda"
    rows = []
    t_start = time.perf_counter()
    for b in [int(x) for x in args.sizes.split(",")]:
        q, p = inputs(b, args.dim, args.device)
        for symmetric in (False, True):
            direction = "symmetric" if symmetric else "one-direction"
            ref = None if args.no_accuracy else float64_reference(q, p, symmetric)
            contenders = {}
            for prec in ("highest", "high", "medium"):
                contenders[f"ours-{prec}-torch"] = ours(q, p, symmetric, prec, kernels=False)
                if cuda and prec != "highest":
                    contenders[f"ours-{prec}-triton"] = ours(q, p, symmetric, prec, kernels=True)
            if cuda:
                contenders.update(memeff_contenders(q, p, symmetric))
            contenders["matmul-bound"] = matmul_bound(q, p, symmetric)
            for name, fn in contenders.items():
                try:
                    seconds = timed(fn, device, args.repeats)
                    peak = peak_bytes(fn, device)
                    acc = (
                        accuracy(fn(), ref)
                        if ref is not None and name != "matmul-bound"
                        else (math.nan, math.nan)
                    )
                except Exception as e:  # a contender that fails must not cost the others their numbers
                    print(f"B={b} {direction} {name}: failed: {type(e).__name__}: {e}", flush=True)
                    continue
                row = {
                    "B": b, "direction": direction, "contender": name, "ms": seconds * 1e3,
                    "peak_mib": peak / 2**20, "loss_rel_err": acc[0], "grad_err_over_max": acc[1],
                }  # fmt: skip
                rows.append(row)
                print(
                    f"B={b:6d} {direction:13s} {name:30s} {row['ms']:9.2f} ms  peak {row['peak_mib']:8.1f} MiB  "
                    f"loss err {acc[0]:.1e}  grad err {acc[1]:.1e}  ({time.perf_counter() - t_start:.0f} s)",
                    flush=True,
                )
            del ref
            gc.collect()
    write(rows, Path(args.out), device)


def write(rows: list[dict], out: Path, device: torch.device) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "loss_stage_gpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    lines = [
        f"Loss stage on {name} (torch {torch.__version__}), d = 384, bf16 embeddings, cosine, scale 20: loss + "
        "gradients, median time, peak memory beyond the inputs, accuracy against float64.",
        "",
        "| B | direction | contender | ms | vs bound | peak MiB | loss rel. err | grad err / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = next(
            (
                x["ms"]
                for x in rows
                if (x["B"], x["direction"], x["contender"]) == (r["B"], r["direction"], "matmul-bound")
            ),
            math.nan,
        )
        lines.append(
            f"| {r['B']} | {r['direction']} | {r['contender']} | {r['ms']:.2f} | {r['ms'] / bound:.2f}x | "
            f"{r['peak_mib']:.1f} | {r['loss_rel_err']:.1e} | {r['grad_err_over_max']:.1e} |"
        )
    (out / "loss_stage_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
