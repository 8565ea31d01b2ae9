"""The multi-vector loss stage: time and peak memory of MaxSim InfoNCE with its gradients wrt every token
embedding, sentence-transformers' cached loss against ours.

Contenders, on the same token embeddings (queries ``(B, tq, d)``, ``N`` document columns ``(B, td, d)``,
ragged masks), each given them as its own stage 1 caches them (theirs: leaves per column; ours: packed with
the mask) before the meter starts, so the peak is the loss stage's alone (the gradients wrt the cache are
in it):

* ``st-cached``: sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss.calculate_loss(...,
  with_backward=True)`` (query chunks of ``score_mini_batch_size`` = 32 rows against every document, a
  ``(32, B*N, tq, td)`` intermediate per chunk, autograd);
* ``ours``: ``infonce_loss_and_grad(..., similarity=MaxSim())`` (tiles sized from the 64 MiB default budget,
  per-tile autograd).

Defaults: the issue's shape (32 query tokens, 180 document tokens, d = 128), pairs (one document column),
B = 256 / 512 / 1,024 (a CPU run; 4,096 and up want a GPU).

Run: ``.venv/bin/python benchmarks/multi_vector.py`` (``--sizes``, ``--repeats``). Writes
``benchmarks/results/multi_vector.{md,csv}``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.functional import infonce_loss_and_grad
from st_cached_losses.functional.representations.multi_vector import MaxSim, pack_tokens
from tests.support.memory import PeakMemory


def inputs(b: int, n_cols: int, tq: int, td: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rows(t: int, min_len: int):
        x = torch.nn.functional.normalize(torch.randn(b, t, d, generator=g), dim=-1)
        lengths = torch.randint(min_len, t + 1, (b,), generator=g)
        return x, torch.arange(t)[None, :] < lengths[:, None]

    return rows(tq, tq // 2), [rows(td, td // 4) for _ in range(n_cols)]


def st_inputs(q, cols) -> tuple[list, list]:
    """Their cache as their stage 1 leaves it: each column's embeddings, a leaf that takes the gradient."""
    reps = [[q[0].clone().requires_grad_()]] + [[c[0].clone().requires_grad_()] for c in cols]
    return reps, [[q[1]]] + [[c[1]] for c in cols]


def run_st(reps, masks) -> float:
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
    )

    loss = CachedMultiVectorMultipleNegativesRankingLoss(torch.nn.Identity(), mini_batch_size=32)  # type: ignore[arg-type]
    return float(loss.calculate_loss(reps, masks, with_backward=True))


def ours_inputs(q, cols) -> tuple[list]:
    """Our cache as our stage 1 leaves it: each column's token embeddings packed with their mask."""
    return ([pack_tokens(*q)] + [pack_tokens(*c) for c in cols],)


def run_ours(packed) -> float:
    out = infonce_loss_and_grad(packed[0], packed[1:], scale=1.0, similarity=MaxSim(), check_finite=False)
    return float(out.loss)


CONTENDERS = {"st-cached": (st_inputs, run_st), "ours": (ours_inputs, run_ours)}


def measure(name: str, q, cols, repeats: int) -> tuple[float, float, float]:
    """(seconds, peak MiB, loss) of one contender's loss stage. Its cache is built before the meter starts
    (a copy of the shared inputs for each), so the peak is the loss stage's own: what the call allocates
    and holds at once, the gradients wrt the cache included."""
    prepare, run = CONTENDERS[name]
    args = prepare(q, cols)
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        value = run(*args)
    if repeats == 0:  # the time of the metered run itself (sizes where one run takes minutes)
        return time.perf_counter() - t0, mem.peak_bytes / 2**20, value
    times = []
    for _ in range(repeats):
        args = prepare(q, cols)
        t0 = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), mem.peak_bytes / 2**20, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs after the metered one; 0: time the metered run"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tq", type=int, default=32)
    parser.add_argument("--td", type=int, default=180)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument(
        "--columns", type=int, default=1, help="document columns (positives + hard negatives)"
    )
    args = parser.parse_args()
    rows = []
    for b in args.sizes:
        q, cols = inputs(b, args.columns, args.tq, args.td, args.dim)
        full = b * b * args.columns * args.tq * args.td * 4 / 2**20
        result = {}
        for name in CONTENDERS:
            result[name] = measure(name, q, cols, args.repeats)
        assert abs(result["st-cached"][2] - result["ours"][2]) <= 1e-4 * abs(result["ours"][2]) + 1e-5
        for name, (t, mib, _) in result.items():
            rows.append({"B": b, "contender": name, "seconds": round(t, 3), "peak_MiB": round(mib, 1),
                         "full_intermediate_MiB": round(full, 1)})  # fmt: skip
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "multi_vector.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Multi-vector loss stage (MaxSim, tq={args.tq}, td={args.td}, d={args.dim}, {args.columns} document "
        f"columns, {torch.get_num_threads()} threads)",
        "",
        "| B | contender | seconds (median) | peak MiB | full (Q, Q*N, tq, td) fp32 MiB |",
        "|---|---|---|---|---|",
        *[
            f"| {r['B']} | {r['contender']} | {r['seconds']} | {r['peak_MiB']} | {r['full_intermediate_MiB']} |"
            for r in rows
        ],
    ]
    (out / "multi_vector.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
