"""Does keeping first-stage graphs within a memory budget (``graph_memory_budget``) save time, and does
the step's peak memory stay within the budget?

The packaged all-MiniLM-L6-v2, max_seq_length 128, real text pairs of varied length (a docstring summary
and the function's source, from the Python standard library), mini-batch 16, training mode. Per batch
size B, one run, each contender's batches back to back on its own heap (the same batches for all; a
warm-up batch first; medians; the freed memory handed back to the system between contenders):

* ``ours``: CachedMNRLoss, no budget (every mini-batch but the last replayed);
* ``ours-budget-all``: CachedMNRLoss with a budget that holds every graph of the batch (no replay);
* ``ours-budget-half``: CachedMNRLoss with a budget of half the non-cached loss's peak;
* ``st-cached``: sentence-transformers' CachedMultipleNegativesRankingLoss, mini-batch 16;
* ``mnrl``: sentence-transformers' non-cached MultipleNegativesRankingLoss.

Peak memory: live tensor bytes of one step (``tests.support.memory.PeakMemory``, a dispatch mode,
deterministic), measured on a separate, untimed step.

Run: ``.venv/bin/python benchmarks/graph_budget.py --batch-sizes 64 --steps 3``. Writes
``benchmarks/results/graph_budget.{csv,md}``; a run replaces the rows of the (B, max_seq_length) it
measures and keeps the others. On a 2-core CPU the large batches need a shorter ``--max-seq-length``
(B = 256 at 64, B = 1,024 at 32 keep the plain loss's peak under 16 GiB), ``--contenders`` a subset
(a subset replaces its (B, L) rows too: write it elsewhere with ``--out``, a directory holding a copy of the
CSV when ``--reuse-peaks``) and ``--no-warmup``; ``--peaks-only`` measures the (deterministic) peaks without timing.

``--alternate`` runs the contenders batch by batch in one process instead. On glibc's heap that favours the
budget: a contender inherits the heap the previous one left (``ours`` the plain loss's freed gigabytes,
``ours-budget-half`` the heap ``ours-budget-all`` grew), and at B = 256 half the peak took 0.67x
``ours`` alternating against 0.94x back to back, while a training run holds one loss only.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import os
import statistics
import time
from pathlib import Path

import torch
from _common import ROOT, minilm, read_rows

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


CONTENDERS = ("ours", "ours-budget-all", "ours-budget-half", "st-cached", "mnrl")


def peak_of(loss, feats) -> int:
    from tests.support.memory import PeakMemory

    loss.model.zero_grad(set_to_none=True)
    gc.collect()
    with PeakMemory() as mem:
        loss([dict(f) for f in feats], None).backward()
    return mem.peak_bytes


def _trim_heap() -> None:
    """Hand glibc's freed heap memory back to the system (Linux; elsewhere nothing)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run(
    batch_sizes: list[int],
    steps: int,
    mini_batch: int,
    max_seq_length: int,
    contenders: list[str],
    warmup: bool,
    timed: bool = True,
    known_peaks: dict[tuple[int, int, str], float] | None = None,
    by_contender: bool = True,
) -> list[dict]:
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.data import stdlib_pairs

    model = minilm(max_seq_length)
    model.train()
    pairs = stdlib_pairs()
    rows = []
    for b in batch_sizes:
        batches = [pairs[i * b : (i + 1) * b] for i in range(steps + int(warmup))]
        feats0 = [model.preprocess([q for q, _ in batches[0]]), model.preprocess([d for _, d in batches[0]])]
        known = {
            c: mib * 2**20
            for (kb, kl, c), mib in (known_peaks or {}).items()
            if (kb, kl) == (b, max_seq_length)
        }
        plain_peak = (
            int(known["mnrl"]) if "mnrl" in known else peak_of(MultipleNegativesRankingLoss(model), feats0)
        )
        losses = {
            "ours": CachedMNRLoss(model, mini_batch_size=mini_batch),
            "ours-budget-all": CachedMNRLoss(
                model, mini_batch_size=mini_batch, graph_memory_budget=10 * plain_peak
            ),
            "ours-budget-half": CachedMNRLoss(
                model, mini_batch_size=mini_batch, graph_memory_budget=plain_peak // 2
            ),
            "st-cached": CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch),
            "mnrl": MultipleNegativesRankingLoss(model),
        }
        losses = {name: loss for name, loss in losses.items() if name in contenders}
        # the plain loss's peak is the one measured for the budget above
        peaks = {
            name: plain_peak if name == "mnrl" else known.get(name) or peak_of(loss, feats0)
            for name, loss in losses.items()
        }
        if not timed:  # --peaks-only
            batches = []
        times: dict[str, list[float]] = {name: [] for name in losses}
        feats_of = [
            [model.preprocess([q for q, _ in bt]), model.preprocess([d for _, d in bt])] for bt in batches
        ]

        def one_step(name: str, step: int, losses=losses, feats_of=feats_of, times=times) -> None:
            model.zero_grad(set_to_none=True)
            gc.collect()
            t0 = time.perf_counter()
            losses[name]([dict(f) for f in feats_of[step]], None).backward()
            seconds = time.perf_counter() - t0
            if step > 0 or not warmup:  # the first batch warms the contender up
                times[name].append(seconds)

        if by_contender:
            # each contender's batches back to back on its own warm heap, the freed memory handed back to the
            # system between contenders (untimed): one process alternating a 12 GB plain loss with the others
            # grows past 24 GiB on glibc's heap at B = 1,024, while a training run holds one loss only
            for name in losses:
                _trim_heap()
                for step in range(len(batches)):
                    one_step(name, step)
                print(f"B={b} {name}: " + ", ".join(f"{t:.2f}s" for t in times[name]), flush=True)
        else:
            for step in range(len(batches)):
                for name in losses:
                    one_step(name, step)
                print(
                    f"B={b} step {step}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items() if t),
                    flush=True,
                )
        for name, loss in losses.items():
            budget = getattr(loss, "graph_memory_budget", None)
            rows.append(
                {
                    "B": b,
                    "L": max_seq_length,
                    "contender": name,
                    "median_s": statistics.median(times[name]) if times[name] else float("nan"),
                    "peak_mib": peaks[name] / 2**20,
                    "budget_mib": budget / 2**20 if budget else "",
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--steps", type=int, default=3, help="timed batches per B")
    parser.add_argument(
        "--no-warmup", action="store_true", help="time the first batch too (no untimed warm-up batch)"
    )
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--max-seq-length", type=int, default=128)
    order = parser.add_mutually_exclusive_group()
    order.add_argument(
        "--by-contender",
        action="store_true",
        help="time each contender's batches back to back, each on its own heap (the default)",
    )
    order.add_argument(
        "--alternate",
        action="store_true",
        help="alternate the contenders batch by batch in one heap (biased by what the previous contender left)",
    )
    parser.add_argument(
        "--reuse-peaks",
        action="store_true",
        help="take the peaks (and the plain loss's, for the budgets) from the CSV's rows of the same B and L",
    )
    parser.add_argument(
        "--peaks-only",
        action="store_true",
        help="measure the peaks only (deterministic; the times are 'nan')",
    )
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="comma-separated subset of " + ", ".join(CONTENDERS),
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the CSV")
    args = parser.parse_args(argv)
    out = Path(args.out)
    csv_path = out / "graph_budget.csv"
    old = read_rows(csv_path)
    if args.table_only:
        rows = old
    else:
        contenders = [c for c in args.contenders.split(",") if c]
        unknown = sorted(set(contenders) - set(CONTENDERS))
        if unknown:
            parser.error(f"--contenders: unknown {unknown}")
        new = run(
            [int(x) for x in args.batch_sizes.split(",")], args.steps, args.mini_batch, args.max_seq_length,
            contenders, not args.no_warmup, not args.peaks_only,
            {(r["B"], r["L"], r["contender"]): r["peak_mib"] for r in old} if args.reuse_peaks else None,
            not args.alternate,
        )  # fmt: skip
        # a run replaces the rows of the (B, L) pairs it measured and keeps the others
        measured = {(r["B"], r["L"]) for r in new}
        rows = sorted(
            [r for r in old if (r["B"], r["L"]) not in measured] + new, key=lambda r: (r["B"], r["L"])
        )
        out.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(
                f, fieldnames=["B", "L", "contender", "median_s", "peak_mib", "budget_mib"]
            )
            writer.writeheader()
            writer.writerows(rows)
    lines = [
        f"Training step, all-MiniLM-L6-v2, max_seq_length L, stdlib pairs, mini-batch {args.mini_batch}, "
        f"{torch.get_num_threads()} CPU threads; median of the timed batches; peak = live tensor bytes of one step.",
        "",
        "| B | L | contender | step (s) | vs st-cached | vs mnrl | vs ours | peak (MiB) | budget (MiB) | peak / budget |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = {x["contender"]: x for x in rows if (x["B"], x["L"]) == (r["B"], r["L"])}
        fit = f"{r['peak_mib'] / r['budget_mib']:.2f}" if r["budget_mib"] != "" else ""
        vs = {
            ref: f"{r['median_s'] / by[ref]['median_s']:.2f}" if ref in by else ""
            for ref in ("st-cached", "mnrl", "ours")
        }
        lines.append(
            f"| {r['B']} | {r['L']} | {r['contender']} | {r['median_s']:.2f} | "
            f"{vs['st-cached']} | {vs['mnrl']} | {vs['ours']} | {r['peak_mib']:.0f} | "
            f"{r['budget_mib'] if r['budget_mib'] == '' else format(r['budget_mib'], '.0f')} | {fit} |"
        )
        lines[-1] = lines[-1].replace("nan", "not timed")
    (out / "graph_budget.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
