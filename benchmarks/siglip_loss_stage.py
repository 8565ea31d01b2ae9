"""How fast, and in how much memory, is the loss stage of the sigmoid (SigLIP) loss, beside the CLIP loss's?

The loss stage is GradCache's step 2: from the embeddings of a whole batch (anchors and positives, d = 384),
the loss and its gradient with respect to every embedding (and the scale and the bias, as tensors). Contenders,
measured side by side in one run (interleaved; medians of ``--repeats``):

* ``siglip-chunked`` / ``siglip-tiled``: ``st_cached_losses.functional.sigmoid_loss_and_grad`` on each path
  (scale 10, bias -10, both learnable): one pass, three GEMMs per block;
* ``clip-tiled``: the symmetric InfoNCE of ``CachedCLIPLoss``'s loss stage,
  ``infonce_loss_and_grad(symmetric=True, path="tiled")`` (its faster path at large B on this machine,
  ``benchmarks/results/loss_stage.md``): two passes, four GEMMs per tile pair;
* ``matmul-bound``: the three GEMMs any exact one-pass method must do (logits, G @ C, G^T @ Q), chunked like
  ours, nothing else;
* ``siglip-dense``: the naive reference (``tests/support/reference.py``), the full B x B logits with autograd,
  where it fits (``--dense-max``).

Peak memory is the peak of live tensor bytes allocated inside the call (a dispatch mode, not RSS;
``tests/support/memory.py``), in MiB and per ``B·d·4`` bytes (the size of one embedding matrix): the returned
gradients and the normalised copies grow with B, the blocks do not (their size is set by the memory budget, 64
MiB by default), so the peak per ``B·d·4`` falls as B grows. At the largest B the sigmoid loss is checked against
a float64 recomputation, a block of rows at a time.

Run: ``.venv/bin/python benchmarks/siglip_loss_stage.py`` (about 15 minutes on 2 idle CPU threads, most of it
at B = 65,536, where each contender runs once, timed with the memory meter on; ``--quick`` for a smoke run). Writes ``benchmarks/results/siglip_loss_stage.{csv,md,png}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import statistics
import time
from pathlib import Path

import torch
from _common import ROOT

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, infonce_loss_and_grad, sigmoid_loss_and_grad
from tests.support.memory import PeakMemory
from tests.support.reference import reference_sigmoid

SCALE, BIAS = 10.0, -10.0


def _inputs(b: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    p = q + 3.0 * torch.randn(b, d, generator=g)
    return q, p


def sigmoid_blockwise_float64(q: torch.Tensor, p: torch.Tensor, block: int = 2048) -> float:
    """The sigmoid loss's value in float64, a block of rows at a time (cosine, ``SCALE``, ``BIAS``)."""
    with torch.no_grad():
        qn = torch.nn.functional.normalize(q.double(), dim=1)
        pn = torch.nn.functional.normalize(p.double(), dim=1)
        total = 0.0
        for r0 in range(0, q.shape[0], block):
            r1 = min(r0 + block, q.shape[0])
            u = SCALE * qn[r0:r1] @ pn.T + BIAS  # (rows, B)
            i = torch.arange(r1 - r0)
            pos = u[i, i + r0].clone()
            u[i, i + r0] = -torch.inf
            total += float(torch.nn.functional.softplus(u).sum() + torch.nn.functional.softplus(-pos).sum())
        return total / q.shape[0]


def contenders(b: int, q: torch.Tensor, p: torch.Tensor, dense_max: int) -> dict:
    d = q.shape[1]

    def siglip(path: str):
        def run():
            s = torch.tensor(SCALE, requires_grad=True)
            bias = torch.tensor(BIAS, requires_grad=True)
            sigmoid_loss_and_grad(q, p, scale=s, bias=bias, path=path)

        return run

    def clip():
        infonce_loss_and_grad(q, p, scale=20.0, symmetric=True, path="tiled")

    def dense():
        qq, pp = q.clone().requires_grad_(), p.clone().requires_grad_()
        s = torch.tensor(SCALE, requires_grad=True)
        bias = torch.tensor(BIAS, requires_grad=True)
        reference_sigmoid(qq, pp, scale=s, bias=bias).backward()

    def matmul_bound():
        chunk = max(1, DEFAULT_MEMORY_BUDGET // (2 * 4 * b))  # the chunked plan's rows (two blocks)
        gq = torch.empty(b, d)
        gp = torch.zeros(b, d)
        for r0 in range(0, b, chunk):
            qs = q[r0 : r0 + chunk]
            s = qs @ p.T  # (c, d) @ (d, B)
            torch.mm(s, p, out=gq[r0 : r0 + chunk])  # (c, B) @ (B, d)
            gp.addmm_(s.T, qs)  # (B, c) @ (c, d)

    out = {}
    if b <= dense_max:
        out["siglip-dense"] = dense
    out["siglip-chunked"] = siglip("chunked")
    out["siglip-tiled"] = siglip("tiled")
    out["clip-tiled"] = clip
    out["matmul-bound"] = matmul_bound
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4096,16384,65536", help="B = C values")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (fewer at large B)")
    parser.add_argument("--dense-max", type=int, default=4096, help="largest B for the dense reference")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 check at the largest B")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.dim, args.repeats, args.dense_max = "512,1024", 64, 1, 1024
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]

    rows: list[dict] = []
    checks: list[str] = []
    for b in sizes:
        q, p = _inputs(b, args.dim)
        fns = contenders(b, q, p, args.dense_max)
        # large B: one run per contender, timed inside the memory meter (its cost per op is microseconds,
        # against blocks of millions of entries); smaller B: a warm-up, then interleaved repeats
        large = b > 16384
        times: dict[str, list[float]] = {name: [] for name in fns}
        if not large:
            for fn in fns.values():  # warm-up
                fn()
            for _ in range(args.repeats):
                for name, fn in fns.items():  # interleaved, so noise hits every contender alike
                    gc.collect()
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        for name, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            with PeakMemory() as mem:
                fn()
            if large:
                times[name].append(time.perf_counter() - t0)
            row = {
                "B": b,
                "contender": name,
                "seconds": statistics.median(times[name]),
                "peak_mib": mem.peak_bytes / 2**20,
                "peak_x_Bd4": mem.peak_bytes / (b * args.dim * 4),
            }
            rows.append(row)
            print(
                f"B={b:6d} {name:15s} {row['seconds']:9.3f} s   peak {row['peak_mib']:9.1f} MiB "
                f"({row['peak_x_Bd4']:.2f} x B*d*4)",
                flush=True,
            )
        if b == max(sizes) and not args.no_check:
            out = sigmoid_loss_and_grad(q, p, scale=SCALE, bias=BIAS)
            exact = sigmoid_blockwise_float64(q, p)
            rel = abs(float(out.loss) - exact) / abs(exact)
            check = (
                f"sigmoid loss at B={b}: {float(out.loss):.7f}, float64 blockwise {exact:.7f}, rel. diff "
                f"{rel:.1e}, finite: {bool(torch.isfinite(out.loss))}"
            )
            print(check, flush=True)
            checks.append(check)
    write(
        rows, checks, Path(args.out), "siglip_loss_stage_quick" if args.quick else "siglip_loss_stage", args
    )


def write(rows: list[dict], checks: list[str], out: Path, stem: str, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"Loss stage (loss + gradient wrt every embedding, the scale and the bias), d = {args.dim}, "
        f"{args.threads} CPU threads, torch {torch.__version__}, median of repeats (B > 16384: one run, timed with the memory meter on). "
        f"Command: `python benchmarks/siglip_loss_stage.py --sizes {args.sizes} --threads {args.threads}`.",
        "",
        "| B = C | contender | time (s) | vs matmul bound | vs clip-tiled | peak extra memory (MiB) | x (B·d·4 bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = {x["contender"]: x for x in rows if x["B"] == r["B"]}
        lines.append(
            f"| {r['B']} | {r['contender']} | {r['seconds']:.3f} | "
            f"{r['seconds'] / by['matmul-bound']['seconds']:.2f}x | {r['seconds'] / by['clip-tiled']['seconds']:.2f}x | "
            f"{r['peak_mib']:.1f} | {r['peak_x_Bd4']:.2f} |"
        )
    notes = []
    sizes = sorted({r["B"] for r in rows})
    for name in ("siglip-chunked", "siglip-tiled", "clip-tiled"):
        pts = [next(r for r in rows if r["B"] == b and r["contender"] == name) for b in sizes]
        notes.append(
            f"{name}: peak "
            + ", ".join(f"{r['peak_mib']:.0f} MiB ({r['peak_x_Bd4']:.2f} x B·d·4) at B={r['B']}" for r in pts)
        )
    lines += ["", *[f"- {t}" for t in notes + checks]]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("siglip-dense", "siglip-chunked", "siglip-tiled", "clip-tiled", "matmul-bound"):
        pts = sorted((r["B"], r) for r in rows if r["contender"] == name)
        if not pts:
            continue
        axes[0].plot([b for b, _ in pts], [r["seconds"] for _, r in pts], marker="o", label=name)
        axes[1].plot([b for b, _ in pts], [max(r["peak_mib"], 1e-3) for _, r in pts], marker="o", label=name)
    axes[0].set_title("loss stage: time (s)")
    axes[1].set_title("loss stage: peak extra memory (MiB)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("B = C")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
