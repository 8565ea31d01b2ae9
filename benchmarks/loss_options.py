"""The loss stage with sentence-transformers' options and with GIST: time and memory at d = 384.

The rows ``benchmarks/loss_stage.py`` has for the one-directional and symmetric losses, for
sentence-transformers' options and GIST, measured side by side in one run (medians of ``--repeats``, interleaved):

* ``4-directions-joint``: ``directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")``,
  ``partition_mode="joint"`` (GTE);
* ``hardness``: one direction, ``hardness_mode="in_batch_negatives"``, ``hardness_strength=9``;
* ``gist``: GISTEmbedLoss's terms (anchor-positive, anchor-anchor, positive-positive) with a guide of
  d = 384, margin 0.

Contenders: ``st-cached`` (sentence-transformers' ``CachedMultipleNegativesRankingLoss`` / ``CachedGISTEmbedLoss``
``.calculate_loss(..., with_backward=True)`` with the same options, ``mini_batch_size=32``), ``ours-chunked`` /
``ours-tiled`` (``infonce_loss_and_grad`` with the terms) and ``matmul-bound``: the GEMMs any exact one-pass
method does, three per logit block (logits, ``P @ C``, ``P^T @ Q``) for each term, chunked like ours (for GIST
also the guide's logits).

Run: ``.venv/bin/python benchmarks/loss_options.py`` (``--sizes``, ``--st-max``; ``--quick`` for a smoke run).
Writes ``benchmarks/results/loss_options.{md,json}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import Guide
from st_cached_losses.functional.softmax.terms import gist_terms, mnrl_terms
from tests.support.memory import PeakMemory

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
CASES = {
    "4-directions-joint": {"directions": ALL, "partition_mode": "joint"},
    "hardness": {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
    "gist": {},
}
#: logit blocks (rows x B) per row for the matmul bound: 4 terms, 1 term, 3 terms (+ their guide tiles)
BLOCKS = {"4-directions-joint": 4, "hardness": 1, "gist": 3}


def _st_loss(case: str):
    from sentence_transformers.sentence_transformer.losses import (
        CachedGISTEmbedLoss,
        CachedMultipleNegativesRankingLoss,
    )

    from tests.support.tiny_model import make_tiny_model

    base = Path(tempfile.mkdtemp())
    model = make_tiny_model(base / "bert")
    if case == "gist":
        return CachedGISTEmbedLoss(
            model, make_tiny_model(base / "guide", seed=3), temperature=0.05, mini_batch_size=32
        )
    return CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=32, **CASES[case])


def contenders(
    case: str, q: torch.Tensor, p: torch.Tensor, gq: torch.Tensor, gp: torch.Tensor, st_loss
) -> dict:
    b, d = q.shape
    if case == "gist":
        terms = gist_terms(True, True, 1, "absolute", 0.0)
        extra = {"guide": Guide(gq, [gp])}
    else:
        opts = {
            "directions": ("query_to_doc",),
            "partition_mode": "joint",
            "hardness_mode": None,
            **CASES[case],
        }
        terms = mnrl_terms(opts["directions"], opts["partition_mode"], opts["hardness_mode"], 9.0, 1)
        extra = {}

    def st():
        reps = [[t.clone().requires_grad_() for t in x.split(32)] for x in (q, p)]
        if case == "gist":
            st_loss.calculate_loss(reps, [list(gq.split(32)), list(gp.split(32))], with_backward=True)
        else:
            st_loss.calculate_loss(reps, None, with_backward=True)

    def ours(path):
        return lambda: infonce_loss_and_grad(q, p, scale=20.0, terms=terms, path=path, **extra)

    def matmul_bound():
        blocks = BLOCKS[case]
        chunk = max(1, DEFAULT_MEMORY_BUDGET // (4 * b * blocks))
        g_rows = torch.empty(b, d, device=q.device)
        g_cols = torch.zeros(b, d, device=q.device)
        for r0 in range(0, b, chunk):
            qs = q[r0 : r0 + chunk]
            for _ in range(blocks):
                s = qs @ p.T
                if case == "gist":
                    qs @ p.T  # the guide's tile
                torch.mm(s, p, out=g_rows[r0 : r0 + chunk])
                g_cols.addmm_(s.T, qs)

    out = {}
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
    parser.add_argument("--sizes", default="4096,16384")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--st-max", type=int, default=4096, help="largest B for sentence-transformers' losses"
    )
    parser.add_argument(
        "--st-max-gist", type=int, default=512, help="largest B for CachedGISTEmbedLoss (29 s at B=512 here)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.dim, args.repeats, args.st_max, args.st_max_gist = "256,512", 64, 1, 512, 256
    rows = []
    gen = torch.Generator().manual_seed(0)
    for b in [int(x) for x in args.sizes.split(",")]:
        q, p, gq, gp = (torch.randn(b, args.dim, generator=gen) for _ in range(4))
        p = q + 0.5 * p  # positives near their anchors, as after some training
        gp = gq + 0.5 * gp
        for case in args.cases.split(","):
            st_max = args.st_max_gist if case == "gist" else args.st_max
            st_loss = _st_loss(case) if b <= st_max else None
            fns = contenders(case, q, p, gq, gp, st_loss)
            times: dict[str, list[float]] = {n: [] for n in fns}
            peaks: dict[str, float] = {}
            small = b <= 4096
            if small:
                for fn in fns.values():
                    fn()  # warm-up
            for _ in range(args.repeats if small else 1):
                for name, fn in fns.items():  # interleaved, so noise hits every contender alike
                    gc.collect()
                    with PeakMemory(torch.device("cpu")) as mem:
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
                    peaks[name] = max(peaks.get(name, 0.0), mem.peak_bytes / 2**20)
            for name in fns:
                row = {"B": b, "case": case, "contender": name, "seconds": statistics.median(times[name])}
                row["peak_mib"] = peaks[name]
                rows.append(row)
                print(
                    f"B={b:6d} {case:19s} {name:13s} {row['seconds']:9.3f} s  peak {row['peak_mib']:8.1f} MiB",
                    flush=True,
                )
    write(rows, Path(args.out), "loss_options_quick" if args.quick else "loss_options", args)


def write(rows: list[dict], out: Path, stem: str, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"# Loss stage with options (d = {args.dim}, {torch.get_num_threads()} CPU threads, torch {torch.__version__})",
        "",
        f"Command: `.venv/bin/python benchmarks/loss_options.py --sizes {args.sizes} --repeats {args.repeats} "
        f"--st-max {args.st_max} --st-max-gist {args.st_max_gist}`. Medians of {args.repeats} runs after a warm-up "
        "(B > 4096: one run, no warm-up); contenders interleaved in one run. Peak: live tensor bytes allocated "
        "inside the call (a dispatch mode), the inputs excluded.",
        "",
        "| B | case | contender | time (s) | vs matmul bound | vs ours-chunked | peak extra memory (MiB) |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        same = [x for x in rows if x["B"] == r["B"] and x["case"] == r["case"]]
        bound = next(x["seconds"] for x in same if x["contender"] == "matmul-bound")
        ours = next(x["seconds"] for x in same if x["contender"] == "ours-chunked")
        lines.append(
            f"| {r['B']} | {r['case']} | {r['contender']} | {r['seconds']:.3f} | {r['seconds'] / bound:.2f}x | "
            f"{r['seconds'] / ours:.2f}x | {r['peak_mib']:.1f} |"
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / stem}.md")


if __name__ == "__main__":
    main()
