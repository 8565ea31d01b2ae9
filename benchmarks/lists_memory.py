"""Does the loss stage stay O(B d) in memory with lists of hard negatives? (Issue 60.)

Each of B anchors has one positive and its own number of mined hard negatives, drawn uniformly from 0 to
``--max-negatives`` (16): the listed negatives are one flat column of ``sum(counts)`` rows, each a candidate of
every anchor (``InfoNCEOptions.listed_negatives``, what ``CachedMNRLoss`` runs for a ``negative`` column of
lists). Measured, side by side in one run:

* ``ours``: ``st_cached_losses.functional.infonce_loss_and_grad`` (the chunked path, the default 64 MiB logit
  budget), the loss and its gradient wrt every row;
* ``dense``: the full ``B x (B + N)`` logits in float32 with autograd, where three such matrices fit in
  ``--dense-limit`` (else its size is computed and the run left out).

Peak memory is the peak of live tensor bytes allocated inside the call (``tests/support/memory.PeakMemory``),
beyond the inputs; ``inputs`` is the rows themselves (anchors, positives, negatives). Time is the median of
``--repeats`` calls after one warm-up. The two losses are compared (relative difference).

Run: ``.venv/bin/python benchmarks/lists_memory.py`` (``--sizes 1024 4096`` for a quicker run). Writes
``benchmarks/results/lists_memory.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import shlex
import statistics
import sys
import time

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, infonce_loss_and_grad
from tests.support.memory import PeakMemory

RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ["B", "negatives", "candidates", "method", "seconds", "peak_MiB", "inputs_MiB", "loss", "rel_diff"]


def _inputs(b: int, max_negatives: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_negatives + 1, (b,), generator=g)
    q = torch.randn(b, d, generator=g)
    p = q + 3.0 * torch.randn(b, d, generator=g)
    owner = torch.repeat_interleave(torch.arange(b), counts)
    negatives = q[owner] + 4.0 * torch.randn(len(owner), d, generator=g)  # hard: near their own anchor
    return q, p, negatives


def _ours(q: torch.Tensor, p: torch.Tensor, n: torch.Tensor, scale: float) -> torch.Tensor:
    out = infonce_loss_and_grad(q, [p, n], scale=scale, listed_negatives=True)
    return out.loss


def _dense(q: torch.Tensor, p: torch.Tensor, n: torch.Tensor, scale: float) -> torch.Tensor:
    qq = torch.nn.functional.normalize(q.clone().requires_grad_(), dim=-1)
    cc = torch.nn.functional.normalize(torch.cat([p, n]).requires_grad_(), dim=-1)
    logits = scale * qq @ cc.T
    loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(q)))
    loss.backward()
    return loss.detach()


def _measure(fn, args: tuple, repeats: int) -> tuple[float, int, float]:
    fn(*args)  # warm-up
    gc.collect()
    with PeakMemory() as peak:
        value = float(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak.peak_bytes, value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--max-negatives", type=int, default=16)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--scale", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dense-limit", type=float, default=12.0, help="GiB for the dense method's 3 matrices"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="lists_memory")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    for b in args.sizes:
        q, p, n = _inputs(b, args.max_negatives, args.dim, seed=0)
        inputs = sum(t.numel() * t.element_size() for t in (q, p, n))
        candidates = b + len(n)
        found: dict[str, float] = {}
        dense_bytes = 3 * b * candidates * 4
        for method, fn in (("ours", _ours), ("dense", _dense)):
            base = {"B": b, "negatives": len(n), "candidates": candidates, "method": method}
            if method == "dense" and dense_bytes > args.dense_limit * 2**30:
                rows.append({**base, "seconds": "", "peak_MiB": f"> {dense_bytes / 2**20:.0f} (not run)"})
                print(rows[-1], flush=True)
                continue
            seconds, peak, value = _measure(fn, (q, p, n, args.scale), args.repeats)
            found[method] = value
            rows.append(
                {
                    **base,
                    "seconds": round(seconds, 3),
                    "peak_MiB": round(peak / 2**20, 1),
                    "loss": round(value, 6),
                }
            )
            print(rows[-1], flush=True)
        for row in rows:
            row["inputs_MiB"] = row.get("inputs_MiB") or (round(inputs / 2**20, 1) if row["B"] == b else "")
        if "dense" in found:
            rows[-2]["rel_diff"] = f"{abs(found['ours'] - found['dense']) / abs(found['dense']):.1e}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    command = "python benchmarks/lists_memory.py " + shlex.join(sys.argv[1:])
    lines = [
        f"# The loss stage with lists of hard negatives (0-{args.max_negatives} per row), d = {args.dim}, one "
        "positive per row",
        "",
        f"`{command.strip()}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{torch.get_num_threads()} CPU thread(s); ours: the chunked path, a {DEFAULT_MEMORY_BUDGET // 2**20} MiB "
        "logit budget. Peak: live tensor bytes allocated in the call beyond its inputs.",
        "",
        "| B | listed negatives | candidates per anchor | method | s (median) | peak MiB | inputs MiB | loss | rel. diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['negatives']} | {r['candidates']} | {r['method']} | {r.get('seconds', '')} | "
            f"{r['peak_MiB']} | {r.get('inputs_MiB', '')} | {r.get('loss', '')} | {r.get('rel_diff', '')} |"
        )
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
