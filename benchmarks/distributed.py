"""What does the loss stage cost per process across W processes: memory, traffic and time?

Each of W gloo processes on this machine holds a fixed local batch of anchor/positive embeddings
(``--local-batch`` rows, d = 384), so the global batch is ``W x local``; the loss stage (loss and
gradients wrt every embedding, with every process's candidates as negatives) runs for:

* ``ours-gather``: CachedMNRLoss(gather_across_devices=True): one all-gather and one gradient
  reduction per gathered tensor per step;
* ``ours-ring``: CachedTiledLoss(gather_across_devices=True): candidate blocks pass around a ring,
  a process never holds more than its own block plus one in flight;
* ``st-cached``: sentence-transformers' CachedMultipleNegativesRankingLoss(gather_across_devices=True,
  mini_batch_size=32) calculate_loss(..., with_backward=True).

Every torch.distributed call is counted (calls and payload bytes sent by the process) by wrapping the
torch.distributed functions in each worker; peak memory is the peak of live tensor bytes allocated
inside the loss stage (``tests.support.memory.PeakMemory``); time is the median over repeats.

Run: ``.venv/bin/python benchmarks/distributed.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/distributed.{csv,md,png}``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONTENDERS = ["ours-gather", "ours-ring", "st-cached"]


def _instrument(counts: dict) -> None:
    """Count calls and bytes of every torch.distributed collective / p2p call in this process."""
    import torch
    import torch.distributed as dist

    def nbytes(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, (list, tuple)):
            return sum(nbytes(o) for o in obj)
        return 0

    # what each call sends: the input tensor (all_gather / all_reduce / send), not the outputs
    send_arg = {
        "all_gather": 1,
        "all_gather_into_tensor": 1,
        "all_reduce": 0,
        "reduce_scatter": 1,
        "reduce_scatter_tensor": 1,
        "broadcast": 0,
        "isend": 0,
        "send": 0,
        "all_to_all": 1,
        "scatter": 1,
        "gather": 0,
        "_all_gather_base": 1,
    }
    for name, idx in send_arg.items():
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_counted", False):
            continue

        def wrapped(*args, _fn=fn, _name=name, _idx=idx, **kwargs):
            counts.setdefault("calls", 0)
            counts["calls"] += 1
            arg = args[_idx] if len(args) > _idx else next(iter(kwargs.values()), None)
            counts["bytes"] = counts.get("bytes", 0) + nbytes(arg)
            return _fn(*args, **kwargs)

        wrapped._counted = True  # type: ignore[attr-defined]
        setattr(dist, name, wrapped)


def _worker(rank: int, world: int, model_dir: str, local: int, dim: int, repeats: int, contenders: list[str]):
    import torch
    import torch.distributed as dist
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMNRLoss, CachedTiledLoss
    from tests.support.memory import PeakMemory

    counts: dict = {}
    _instrument(counts)
    torch.manual_seed(100 + rank)
    anchors = torch.randn(local, dim)
    positives = anchors + 3.0 * torch.randn(local, dim)
    model = SentenceTransformer(model_dir, device="cpu")
    losses = {
        "ours-gather": CachedMNRLoss(model, mini_batch_size=32, gather_across_devices=True),
        "ours-ring": CachedTiledLoss(model, mini_batch_size=32, gather_across_devices=True),
        "st-cached": CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=32, gather_across_devices=True
        ),
    }
    out = {}
    for name in contenders:
        loss = losses[name]

        def reps(name: str = name) -> list[list[torch.Tensor]]:
            if name == "st-cached":  # its format: per column, the mini-batch pieces
                return [
                    [t.detach().clone().requires_grad_() for t in x.split(32)] for x in (anchors, positives)
                ]
            return [[x.detach().clone().requires_grad_()] for x in (anchors, positives)]

        times, value = [], None
        for rep in range(repeats + 1):
            r = reps()
            dist.barrier()
            counts.clear()
            t0 = time.perf_counter()
            value = loss.calculate_loss(r, None, with_backward=True)
            seconds = time.perf_counter() - t0
            if rep > 0 or repeats == 0:
                times.append(seconds)
            step_counts = dict(counts)
        r = reps()
        dist.barrier()
        with PeakMemory() as mem:
            loss.calculate_loss(r, None, with_backward=True)
        grad_norm = float(torch.cat([p.grad for col in r for p in col]).norm())
        out[name] = {
            "seconds": statistics.median(times),
            "peak_bytes": mem.peak_bytes,
            "calls": step_counts.get("calls", 0),
            "bytes": step_counts.get("bytes", 0),
            "loss": float(value),
            "grad_norm": grad_norm,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", default="1,2,4", help="process counts")
    parser.add_argument("--local-batch", type=int, default=4096, help="rows per process (global = W x local)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--st-max-global", type=int, default=16384, help="skip sentence-transformers above this global batch"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.local_batch, args.dim, args.repeats, args.worlds = 256, 64, 1, "1,2"

    from tests.support.dist_utils import run_distributed
    from tests.support.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp())
    make_tiny_model(tmp / "bert").save(str(tmp / "st"))
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        global_batch = world * args.local_batch
        contenders = [c for c in CONTENDERS if c != "st-cached" or global_batch <= args.st_max_global]
        print(
            f"W={world}: global batch {global_batch}, local {args.local_batch}, d={args.dim} ...", flush=True
        )
        per_rank = run_distributed(
            _worker,
            world,
            str(tmp / "st"),
            args.local_batch,
            args.dim,
            args.repeats,
            contenders,
            timeout=3600,
        )
        for name in contenders:
            r0 = per_rank[0][name]
            row = {
                "world": world,
                "global_batch": global_batch,
                "contender": name,
                "seconds": max(r[name]["seconds"] for r in per_rank),
                "peak_mib": max(r[name]["peak_bytes"] for r in per_rank) / 2**20,
                "calls": r0["calls"],
                "mib_sent": r0["bytes"] / 2**20,
                "loss": sum(r[name]["loss"] for r in per_rank) / world,
            }
            rows.append(row)
            print(
                f"  {name:12s} {row['seconds']:8.2f} s  peak {row['peak_mib']:8.1f} MiB  "
                f"{row['calls']:6d} calls  {row['mib_sent']:9.1f} MiB sent  loss {row['loss']:.5f}",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "distributed_quick" if args.quick else "distributed"
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"Loss stage per process, local batch {args.local_batch}, d = {args.dim}, gloo on CPU (median of {args.repeats}).",
        "",
        "| W | global B | contender | time (s) | peak per process (MiB) | collective calls | MiB sent per process |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['global_batch']} | {r['contender']} | {r['seconds']:.2f} | {r['peak_mib']:.1f} | "
            f"{r['calls']} | {r['mib_sent']:.1f} |"
        )
    checks = []
    for world in sorted({r["world"] for r in rows}):
        by = {r["contender"]: r for r in rows if r["world"] == world}
        if "st-cached" in by and world > 1:
            ratio = by["ours-gather"]["mib_sent"] / max(by["st-cached"]["mib_sent"], 1e-9)
            checks.append(f"W={world}: ours-gather bytes / st-cached bytes = {ratio:.4f} (target <= 0.25)")
    # the ring exists from W = 2 on (one process runs the plain tiled path)
    ring = {r["world"]: r["peak_mib"] for r in rows if r["contender"] == "ours-ring" and r["world"] > 1}
    gather = {r["world"]: r["peak_mib"] for r in rows if r["contender"] == "ours-gather"}
    if len(ring) > 1:
        spread = max(ring.values()) / min(ring.values())
        checks.append(
            f"ring peak memory max/min over W >= 2 = {spread:.3f} (target <= 1.10); gather: "
            + ", ".join(f"W={w}: {m:.0f} MiB" for w, m in sorted(gather.items()))
        )
    lines += ["", *[f"- {c}" for c in checks]]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name in CONTENDERS:
        pts = sorted((r["world"], r) for r in rows if r["contender"] == name)
        if not pts:
            continue
        ws = [w for w, _ in pts]
        axes[0].plot(ws, [r["peak_mib"] for _, r in pts], marker="o", label=name)
        axes[1].plot(ws, [max(r["mib_sent"], 1e-3) for _, r in pts], marker="o", label=name)
        axes[2].plot(ws, [r["seconds"] for _, r in pts], marker="o", label=name)
    for ax, title in zip(
        axes, ["peak memory per process (MiB)", "MiB sent per process per step", "loss-stage time (s)"]
    ):
        ax.set_xlabel("processes W (local batch fixed)")
        ax.set_title(title)
        ax.set_xticks(sorted({r["world"] for r in rows}))
        ax.legend()
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
