"""How fast, and in how much memory, is the loss stage of ``CachedEmbedDistillLoss``'s listwise term? (issue 61)

The listwise term: per anchor, the KL divergence of the student's softmax over every candidate of the batch
from the teacher's, logits ``scale * cos`` of the student's rows (d = ``--student-dim``, 384) and of the
teacher's (``--teacher-dim``, 768). Its loss stage is
[`listwise_kl_loss_and_grad`][st_cached_losses.functional.distill.listwise.listwise_kl_loss_and_grad]: the loss and its
gradient wrt the student's anchors and candidates, from the cached embeddings. Random embeddings (neither
memory nor time depends on their values): B anchors and, with ``--negative-columns 0`` (the default), one
positive column, so C = B candidates (each further hard-negative column adds B).

Contenders, side by side in one run:

* ``ours-tiled``: ``listwise_kl_loss_and_grad`` at the tile side the stage takes from the default memory
  budget (``listwise_tile_size(DEFAULT_MEMORY_BUDGET)``: 1,672), float32;
* ``dense``: the reference (``tests/support/reference.py``'s ``reference_listwise_kl``): both ``(B, C)``
  logit matrices, ``log_softmax``, plain autograd, float32; run only where its peak, extrapolated from its
  peak at the smallest size as ``bytes / (4 B C)``, fits ``--dense-limit-gib``; else skipped with the size
  it would need (the two ``(B, C)`` matrices alone and the extrapolated peak).

Peak memory: the peak of live tensor bytes allocated inside the call (``tests.support.memory.PeakMemory``, a
dispatch mode, not RSS; the inputs not counted, the returned gradients counted). Time: one call without the
meter, for B <= ``--plain-max``; above it the time of the metered call (the meter's per-operation overhead
included: compare the two at the sizes where both were taken), column ``timed``.

Run: ``python benchmarks/listwise_loss_stage.py --threads 1``. Writes
``benchmarks/results/listwise_loss_stage.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import shlex
import sys
import time

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.distill.listwise import listwise_kl_loss_and_grad, listwise_tile_size
from tests.support.memory import PeakMemory
from tests.support.reference import reference_listwise_kl

RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ["B", "C", "contender", "seconds", "timed", "peak_mib", "peak_x_4BC", "loss", "note"]
SCALE = 20.0
TILE = listwise_tile_size(DEFAULT_MEMORY_BUDGET)  # the stage's tile side at the default memory budget


def inputs(b: int, c: int, d_s: int, d_t: int, seed: int = 0) -> list[torch.Tensor]:
    """Student anchors ``(B, d_s)`` and candidates ``(C, d_s)``, teacher anchors ``(B, d_t)`` and candidates
    ``(C, d_t)``; each candidate block's first B rows are its anchors plus noise (positives)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in (d_s, d_t):
        a = torch.randn(b, d, generator=g)
        cand = torch.randn(c, d, generator=g) * 2.0
        cand[:b] += a
        out += [a, cand]
    return [out[0], out[1], out[2], out[3]]


def ours(q, c, u, v) -> float:
    out = listwise_kl_loss_and_grad(q, c, u, v, scale=SCALE, teacher_scale=SCALE, tile_size=TILE)
    return float(out.loss)


def dense(q, c, u, v) -> float:
    qq, cc = q.clone().requires_grad_(), c.clone().requires_grad_()
    loss = reference_listwise_kl(qq, cc, u, v, scale=SCALE, teacher_scale=SCALE)
    loss.backward()
    return float(loss.detach())


def measure(name: str, fn, args: list[torch.Tensor], plain: bool) -> dict:
    b, c = args[0].shape[0], args[1].shape[0]
    seconds, timed = None, "plain"
    if plain:
        gc.collect()
        t0 = time.perf_counter()
        fn(*args)
        seconds = time.perf_counter() - t0
    gc.collect()
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        loss = fn(*args)
        metered = time.perf_counter() - t0
    if seconds is None:
        seconds, timed = metered, "metered"
    row = {"B": b, "C": c, "contender": name, "seconds": round(seconds, 2), "timed": timed}
    row |= {
        "peak_mib": round(mem.peak_bytes / 2**20, 1),
        "peak_x_4BC": round(mem.peak_bytes / (4 * b * c), 4),
    }
    row |= {"loss": round(loss, 6), "note": f"metered call {metered:.2f} s" if plain else ""}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="4096,16384,65536", help="B values (the smallest calibrates dense)"
    )
    parser.add_argument(
        "--negative-columns", type=int, default=0, help="hard-negative columns: C = B x (1 + n)"
    )
    parser.add_argument("--student-dim", type=int, default=384)
    parser.add_argument("--teacher-dim", type=int, default=768)
    parser.add_argument("--dense-limit-gib", type=float, default=16.0, help="the largest dense peak to run")
    parser.add_argument("--plain-max", type=int, default=16384, help="largest B timed without the meter")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a busy machine)")
    parser.add_argument("--name", default="listwise_loss_stage")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    sizes = sorted(int(s) for s in ns.sizes.split(","))
    command = shlex.join(["python", "benchmarks/listwise_loss_stage.py", *sys.argv[1:]])
    rows, dense_ratio = [], None
    warm = inputs(64, 64, ns.student_dim, ns.teacher_dim)
    ours(*warm), dense(*warm)  # the first calls' one-off costs out of the timings
    for b in sizes:
        c = b * (1 + ns.negative_columns)
        args = inputs(b, c, ns.student_dim, ns.teacher_dim)
        plain = b <= ns.plain_max
        rows.append(measure("ours-tiled", ours, args, plain))
        two = 2 * 4 * b * c / 2**30
        estimate = dense_ratio * 4 * b * c / 2**30 if dense_ratio is not None else 0.0
        if estimate <= ns.dense_limit_gib and two <= ns.dense_limit_gib:
            rows.append(measure("dense", dense, args, plain))
            dense_ratio = dense_ratio or rows[-1]["peak_x_4BC"]
            rel = abs(rows[-2]["loss"] - rows[-1]["loss"]) / abs(rows[-1]["loss"])
            rows[-2]["note"] += f"; loss vs dense: relative difference {rel:.1e}"
        else:
            note = (
                f"skipped: the two (B, C) fp32 matrices alone {two:.1f} GiB, its peak at "
                f"{dense_ratio} x 4BC bytes (measured at B = {sizes[0]}) {estimate:.1f} GiB > {ns.dense_limit_gib:g} GiB"
            )
            rows.append({"B": b, "C": c, "contender": "dense", "note": note})
            print(rows[-1], flush=True)
        del args
        gc.collect()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{ns.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        # no heading: docs/benchmarks.md includes this file under its own
        f"The listwise term's loss stage, tiled against dense (issue 61); written by `{command}` (its docstring: "
        "the set-up).",
        "",
        f"Student {ns.student_dim}-d, teacher {ns.teacher_dim}-d, random embeddings, {ns.negative_columns} "
        f"hard-negative column(s) (C = {1 + ns.negative_columns} x B), float32, scale {SCALE:g}; ours at tile "
        f"{TILE}; {torch.get_num_threads()} CPU thread(s), {os.cpu_count()} CPUs, 1-minute load average "
        f"{os.getloadavg()[0]:.1f} at the end (other jobs share the machine: the times are noisy).",
        "",
        "| B | C | contender | time (s) | timed | peak (MiB) | peak / (4 B C) | loss | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.get(k, "-") for k in FIELDS]
        lines.append("| " + " | ".join(f"{x:,}" if isinstance(x, int) else str(x) for x in cells) + " |")
    (RESULTS / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
