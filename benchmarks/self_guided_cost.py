"""What does self-guided GIST masking cost? A training step (forward + backward) of

* ``mnr``: ``CachedMNRLoss`` (no mask);
* ``gist-self``: ``CachedGISTLoss(model, guide=None)``: the mask from the step's own first-pass embeddings,
  GIST's terms (anchor-positive, anchor-anchor, positive-positive);
* ``gist-self-qd``: the same with ``contrast_anchors=False, contrast_positives=False``: the anchor ->
  candidates terms of ``mnr`` plus the mask, so the mask's own cost;
* ``st-gist-copy``: sentence-transformers' ``CachedGISTEmbedLoss`` with a frozen copy of the model as guide
  (``copy.deepcopy``): what self-guidance cost before (an extra guide forward per step).

The packaged all-MiniLM-L6-v2 on the CPU, real (docstring summary, function source) pairs of the Python
standard library, the same batches for all, every loss at the same scale and mini-batch size. Contenders
alternate batch by batch (machine noise hits them alike); the medians and the ratios to ``mnr`` are
reported.

Run: ``python benchmarks/self_guided_cost.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/self_guided_cost.{csv,md}``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import shlex
import statistics
import sys
import time

import torch
from _common import ROOT, minilm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=9, help="timed steps of each contender (after one warm-up)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="batch 16, mini-batch 4, 2 rounds")
    parser.add_argument("--name", default="self_guided_cost")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.mini_batch, args.rounds, args.name = 16, 4, 2, f"{args.name}_quick"
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    from st_cached_losses import CachedGISTLoss, CachedMNRLoss
    from st_cached_losses.demo import stdlib_data

    model = minilm(args.max_seq_length)
    model.train()
    guide = copy.deepcopy(model)
    for p in guide.parameters():
        p.requires_grad_(False)
    scale, mb = 20.0, args.mini_batch
    losses = {
        "mnr": CachedMNRLoss(model, scale=scale, mini_batch_size=mb),
        "gist-self": CachedGISTLoss(model, None, 1 / scale, mb),
        "gist-self-qd": CachedGISTLoss(
            model, None, 1 / scale, mb, contrast_anchors=False, contrast_positives=False
        ),
        "st-gist-copy": CachedGISTEmbedLoss(model, guide, 1 / scale, mb),
    }
    data, _ = stdlib_data(args.batch * (args.rounds + 1), 0)
    batches = [
        [
            model.preprocess(data["query"][i : i + args.batch]),
            model.preprocess(data["document"][i : i + args.batch]),
        ]
        for i in range(0, args.batch * (args.rounds + 1), args.batch)
    ]
    times: dict[str, list[float]] = {name: [] for name in losses}
    for r, feats in enumerate(batches):
        order = list(losses) if r % 2 == 0 else list(reversed(losses))  # alternate who goes first
        for name in order:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            losses[name]([dict(f) for f in feats], None).backward()
            if r > 0:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in losses if r > 0), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [
        {"loss": name, "median_s": round(med[name], 4), "vs_mnr": round(med[name] / med["mnr"], 4),
         "min_s": round(min(times[name]), 4), "max_s": round(max(times[name]), 4), "steps": len(times[name])}
        for name in losses
    ]  # fmt: skip
    # the per-round ratio (each round's steps ran back to back): its median is less exposed to load swings
    for row in rows:
        ratios = [t / m for t, m in zip(times[row["loss"]], times["mnr"])]
        row["median_round_ratio"] = round(statistics.median(ratios), 4)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = (
        f"all-MiniLM-L6-v2 on CPU ({torch.get_num_threads()} threads), batch {args.batch} (anchor, positive) pairs, "
        f"mini_batch_size {mb}, max_seq_length {args.max_seq_length}, scale {scale:g}; forward + backward, "
        f"{args.rounds} interleaved steps each after a warm-up"
    )
    lines = [
        header,
        "",
        f"`{shlex.join(['python', *sys.argv])}`",
        "",
        "| loss | median step (s) | vs mnr (medians) | median of per-round ratios | min-max (s) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['loss']} | {r['median_s']:.3f} | {r['vs_mnr']:.3f}x | {r['median_round_ratio']:.3f}x | "
        f"{r['min_s']:.2f}-{r['max_s']:.2f} |"
        for r in rows
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
