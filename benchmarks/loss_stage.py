"""How fast, and in how much memory, is the loss stage of a cached contrastive loss?

The loss stage is GradCache's step 2: from the embeddings of a whole batch (anchors and positives,
d = 384), the loss and its gradient with respect to every embedding. Contenders, measured side by
side in one run (medians of ``--repeats``), one direction (anchor -> candidates) and symmetric:

* ``dense``: the naive reference (``tests/support/reference.py``), full B x C logits, autograd;
* ``st-cached``: sentence-transformers' ``CachedMultipleNegativesRankingLoss.calculate_loss(...,
  with_backward=True)`` at ``mini_batch_size=32`` (symmetric: ``directions=("query_to_doc",
  "doc_to_query"), partition_mode="per_direction"``);
* ``ours-chunked`` / ``ours-tiled``: ``st_cached_losses.functional.infonce_loss_and_grad`` on each path;
* ``matmul-bound``: the GEMMs alone that any exact method must do (one direction: logits, P @ C and
  P^T @ Q; symmetric, as the two-pass algorithm: logits twice, P @ C and P^T @ Q), chunked like ours.

Peak memory is the peak of live tensor bytes allocated inside the call (a dispatch mode, not RSS).
At B = 65,536 the dense logits cannot fit in this machine's memory and sentence-transformers takes
minutes per step, so only ours run there; the tiled symmetric loss is checked against a float64
blockwise recomputation.

Run: ``.venv/bin/python benchmarks/loss_stage.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/loss_stage.{csv,md,png}``. ``--device cuda`` runs the same code on a GPU (inputs
drawn on the CPU, then moved; timings synchronise the device) and adds the CUDA allocator's peak
(``torch.cuda.max_memory_allocated``) to the tables; ``make gpu-check`` runs it with GPU-sized settings.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, infonce_loss_and_grad
from tests.support.memory import PeakMemory
from tests.support.reference import reference_infonce, reference_infonce_blockwise_float64

DENSE_LIMIT_BYTES = 12 * 2**30  # three B x C fp32 matrices must fit
CHUNK_BUDGET = DEFAULT_MEMORY_BUDGET  # the matmul bound is chunked like ours


def _inputs(b: int, d: int, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    p = q + 3.0 * torch.randn(b, d, generator=g)
    return q.to(device), p.to(device)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA is asynchronous), so that a clock read means done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"{torch.get_num_threads()} CPU threads"


def _st_loss(symmetric: bool):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from tests.support.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "bert")
    kwargs = (
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}
        if symmetric
        else {}
    )
    return CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=32, **kwargs)


def contenders(b: int, symmetric: bool, q: torch.Tensor, p: torch.Tensor, st_loss) -> dict:
    d = q.shape[1]

    def dense():
        qq, pp = q.clone().requires_grad_(), p.clone().requires_grad_()
        reference_infonce(qq, pp, scale=20.0, symmetric=symmetric).backward()

    def st():
        reps = [[t.clone().requires_grad_() for t in x.split(32)] for x in (q, p)]
        st_loss.calculate_loss(reps, None, with_backward=True)

    def ours(path):
        return lambda: infonce_loss_and_grad(q, p, scale=20.0, symmetric=symmetric, path=path)

    def matmul_bound():
        chunk = max(1, CHUNK_BUDGET // (4 * b))
        gq = torch.empty(b, d, device=q.device)
        gp = torch.zeros(b, d, device=q.device)
        for r0 in range(0, b, chunk):
            qs = q[r0 : r0 + chunk]
            s = qs @ p.T  # (c, d) @ (d, B)
            if symmetric:  # the two-pass algorithm recomputes the logits
                s = qs @ p.T
            torch.mm(s, p, out=gq[r0 : r0 + chunk])
            gp.addmm_(s.T, qs)

    out = {}
    if 3 * b * b * 4 <= DENSE_LIMIT_BYTES:
        out["dense"] = dense
    if st_loss is not None:
        out["st-cached"] = st
    out["ours-chunked"] = ours("chunked")
    out["ours-tiled"] = ours("tiled")
    out["matmul-bound"] = matmul_bound
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4096,16384,65536", help="B = C values")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (after a warm-up)")
    parser.add_argument(
        "--st-max", type=int, default=16384, help="largest B for sentence-transformers, one direction"
    )
    parser.add_argument(
        "--st-max-symmetric",
        type=int,
        default=4096,
        help="largest B for sentence-transformers' symmetric loss (34 s per step at 4096 here, ~16x that at 16384)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument(
        "--device", default="cpu", help="torch device to run on: cpu (default), cuda, cuda:1, ..."
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available to torch {torch.__version__}")
    if args.quick:
        args.sizes, args.dim, args.repeats, args.st_max, args.st_max_symmetric = "512,1024", 64, 1, 1024, 1024

    rows = []
    for b in [int(x) for x in args.sizes.split(",")]:
        q, p = _inputs(b, args.dim, device=args.device)
        for symmetric in (False, True):
            direction = "symmetric" if symmetric else "one-direction"
            st_limit = args.st_max_symmetric if symmetric else args.st_max
            st_loss = _st_loss(symmetric) if b <= st_limit else None
            fns = contenders(b, symmetric, q, p, st_loss)
            # large sizes: fewer repeats (the slow contenders once)
            repeats = args.repeats if b <= 4096 else max(1, args.repeats - 1)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for name, fn in fns.items():  # warm-up (skipped for the slow ones at large B)
                if b <= 4096 or name not in ("st-cached", "dense"):
                    fn()
            for _ in range(repeats):
                for name, fn in fns.items():  # interleaved, so noise hits every contender alike
                    if name == "st-cached" and b > 4096 and times[name]:
                        continue
                    gc.collect()
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    times[name].append(time.perf_counter() - t0)
            for name, fn in fns.items():
                gc.collect()
                with PeakMemory(device) as mem:
                    fn()
                row = {
                    "B": b,
                    "direction": direction,
                    "contender": name,
                    "seconds": statistics.median(times[name]),
                    "peak_mib": mem.peak_bytes / 2**20,
                    "peak_x_Bd4": mem.peak_bytes / (b * args.dim * 4),
                }
                if mem.cuda_peak_bytes is not None:
                    row["allocator_peak_mib"] = mem.cuda_peak_bytes / 2**20
                rows.append(row)
                print(
                    f"B={b:6d} {direction:13s} {name:13s} {row['seconds']:9.3f} s   peak {row['peak_mib']:9.1f} MiB "
                    f"({row['peak_x_Bd4']:.2f} x B*d*4)",
                    flush=True,
                )
            for name in ("dense", "st-cached"):
                if name not in fns:
                    print(
                        f"B={b:6d} {direction:13s} {name:13s} skipped (does not fit / too slow)", flush=True
                    )
        if b == max(int(x) for x in args.sizes.split(",")):
            out = infonce_loss_and_grad(q, p, scale=20.0, symmetric=True, path="tiled")
            exact = reference_infonce_blockwise_float64(q, p, scale=20.0, symmetric=True)
            rel = abs(float(out.loss) - exact) / abs(exact)
            check = f"tiled symmetric loss at B={b}: {float(out.loss):.7f}, float64 blockwise {exact:.7f}, rel. diff {rel:.1e}, finite: {bool(torch.isfinite(out.loss))}"
            print(check, flush=True)
            rows.append(
                {
                    "B": b,
                    "direction": "check",
                    "contender": check,
                    "seconds": 0,
                    "peak_mib": 0,
                    "peak_x_Bd4": 0,
                }
            )
    write(rows, Path(args.out), "loss_stage_quick" if args.quick else "loss_stage", args.dim, device)


def write(rows: list[dict], out: Path, stem: str, dim: int, device: torch.device | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = [r for r in rows if r["direction"] != "check"]
    checks = [r["contender"] for r in rows if r["direction"] == "check"]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(data[0]))
        writer.writeheader()
        writer.writerows(data)
    allocator = "allocator_peak_mib" in data[0]  # CUDA: the caching allocator's peak too
    lines = [
        f"Loss stage (loss + gradient wrt every embedding), d = {dim}, {describe_device(device or torch.device('cpu'))}, median of repeats.",
        "",
        "| B = C | direction | contender | time (s) | vs matmul bound | peak extra memory (MiB) | x (B·d·4 bytes) |"
        + (" CUDA allocator peak (MiB) |" if allocator else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if allocator else ""),
    ]
    for r in data:
        bound = next(
            x["seconds"]
            for x in data
            if x["B"] == r["B"] and x["direction"] == r["direction"] and x["contender"] == "matmul-bound"
        )
        lines.append(
            f"| {r['B']} | {r['direction']} | {r['contender']} | {r['seconds']:.3f} | {r['seconds'] / bound:.2f}x | "
            f"{r['peak_mib']:.1f} | {r['peak_x_Bd4']:.2f} |"
            + (f" {r['allocator_peak_mib']:.1f} |" if allocator else "")
        )
    targets = []
    for b in sorted({r["B"] for r in data}):
        by = {(r["direction"], r["contender"]): r for r in data if r["B"] == b}
        ours = by.get(("one-direction", "ours-chunked"))
        bound = by.get(("one-direction", "matmul-bound"))
        st = by.get(("one-direction", "st-cached"))
        if ours and bound:
            txt = f"B={b}, one direction: ours-chunked / matmul bound = {ours['seconds'] / bound['seconds']:.2f}"
            if st:
                txt += f"; sentence-transformers / ours = {st['seconds'] / ours['seconds']:.1f}x"
            targets.append(txt)
        tiled = by.get(("symmetric", "ours-tiled"))
        if tiled:
            targets.append(
                f"B={b}, symmetric tiled: peak extra memory = {tiled['peak_x_Bd4']:.2f} x (B·d·4 bytes)"
            )
    lines += ["", *[f"- {t}" for t in targets + checks]]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for col, direction in enumerate(("one-direction", "symmetric")):
        for name in ("dense", "st-cached", "ours-chunked", "ours-tiled", "matmul-bound"):
            pts = sorted((r["B"], r) for r in data if r["direction"] == direction and r["contender"] == name)
            if not pts:
                continue
            axes[0][col].plot([b for b, _ in pts], [r["seconds"] for _, r in pts], marker="o", label=name)
            axes[1][col].plot(
                [b for b, _ in pts], [max(r["peak_mib"], 1e-3) for _, r in pts], marker="o", label=name
            )
        axes[0][col].set_title(f"{direction}: time (s)")
        axes[1][col].set_title(f"{direction}: peak extra memory (MiB)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("B = C")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
