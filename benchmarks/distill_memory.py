"""What does a distillation step with many hard negatives cost, cached and not? (issue 44)

One training step (forward and backward) of a distillation loss at B queries with K hard negatives each, so
B x (K + 2) texts: sentence-transformers' non-cached ``DistillKLDivLoss`` (every text's graph at once) against
our ``CachedDistillKLDivLoss`` (the encoder in mini-batches without graphs, then replayed), and ours with the
in-batch InfoNCE term on. Texts: docstring summaries (queries) and function sources (positive: its own, hard
negatives: other rows' sources) from the standard library; teacher scores random (neither memory nor time
depends on their values).

* Memory: peak live tensor bytes of one step (``tests.support.memory.PeakMemory``, deterministic, as
  ``benchmarks/train_step.py``), against the peak of one encoder mini-batch (the forward and backward of
  ``--mini-batch`` texts with their graph, the parameter gradients included): ours should stay within 1.2x of
  it, whatever B and K.
* Time: the median of ``--steps`` steps of each (after one warm-up step), side by side in one run.

The model is the packaged all-MiniLM-L6-v2, truncated to its first ``--layers`` layers (default 2: the student
of ``examples/train_cached_distill.py``; 6 is the whole model) at ``--max-seq-length`` tokens: on this 2-core
CPU a step of the whole model on 2112 texts takes minutes.

Run: ``.venv/bin/python benchmarks/distill_memory.py`` (``--quick``: B=8, K=7, one step). Writes
``benchmarks/results/distill_memory.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import random
import statistics
import time

import torch
from _common import ROOT, minilm, truncate

RESULTS = ROOT / "benchmarks" / "results"


def distill_batch(model, b: int, k: int, seed: int = 0) -> tuple[list[dict], torch.Tensor]:
    """B queries, their positives and K hard negatives each (other rows' positives), tokenised; random
    teacher scores ``(B, K + 1)``."""
    from st_cached_losses.data import stdlib_pairs

    pairs = stdlib_pairs(limit=max(b * 4, 64), seed=seed)
    rng = random.Random(seed)
    queries = [q for q, _ in pairs[:b]]
    sources = [d for _, d in pairs]
    columns = [queries, sources[:b]]
    for _ in range(k):
        columns.append([sources[(i + 1 + rng.randrange(len(sources) - 1)) % len(sources)] for i in range(b)])
    labels = torch.randn(b, k + 1, generator=torch.Generator().manual_seed(seed)) * 3
    return [model.preprocess(c) for c in columns], labels


def one_step(model, loss, features: list[dict], labels: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss([dict(f) for f in features], labels).backward()


def mini_batch_peak(model, features: list[dict], m: int) -> int:
    """Peak bytes of one encoder mini-batch: the forward of ``m`` rows of the widest column with its graph
    and the backward into the parameters."""
    from st_cached_losses.engine.features import slice_features
    from tests.support.memory import PeakMemory

    widest = max(features, key=lambda f: f["input_ids"].shape[1])
    rows = slice_features(widest, torch.arange(m), widest["input_ids"].shape[0])
    model.zero_grad(set_to_none=True)
    gc.collect()
    with PeakMemory() as mem:
        model(dict(rows))["sentence_embedding"].sum().backward()
    return mem.peak_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="queries per step (B)")
    parser.add_argument("--negatives", type=int, default=31, help="hard negatives per query (K)")
    parser.add_argument(
        "--mini-batch",
        type=int,
        default=16,
        help="our encoder mini-batch (rows; caching is off only at >= all the batch's texts, every column together)",
    )
    parser.add_argument("--with-infonce", action="store_true", help="also ours with the InfoNCE term (w=0.1)")
    parser.add_argument("--layers", type=int, default=2, help="MiniLM layers kept (6: the whole model)")
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender (the median)")
    parser.add_argument("--quick", action="store_true", help="B=8, K=7, one step: a smoke run")
    parser.add_argument("--stem", default="distill_memory")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.negatives, args.steps, args.mini_batch = 8, 7, 1, 4
    from sentence_transformers.sentence_transformer.losses import DistillKLDivLoss

    from st_cached_losses import CachedDistillKLDivLoss
    from tests.support.memory import PeakMemory

    torch.manual_seed(0)
    model = truncate(minilm(args.max_seq_length), args.layers)
    model.train()
    features, labels = distill_batch(model, args.batch, args.negatives)
    texts = args.batch * (args.negatives + 2)
    contenders = {
        "theirs DistillKLDivLoss": DistillKLDivLoss(model),
        "ours CachedDistillKLDivLoss": CachedDistillKLDivLoss(model, mini_batch_size=args.mini_batch),
    }
    if args.with_infonce:
        contenders["ours + InfoNCE (w=0.1)"] = CachedDistillKLDivLoss(
            model, mini_batch_size=args.mini_batch, infonce_weight=0.1
        )
    encoder = mini_batch_peak(model, features, args.mini_batch)
    print(f"one encoder mini-batch ({args.mini_batch} texts): {encoder / 2**20:.1f} MiB", flush=True)
    # one mini-batch's step: theirs on as many texts as one of our mini-batches (2 queries x (K' + 2) texts)
    small_k = max(args.mini_batch // 2 - 2, 1)
    small_features, small_labels = distill_batch(model, 2, small_k, seed=1)
    runs = [
        ("theirs DistillKLDivLoss", contenders["theirs DistillKLDivLoss"], 2, small_k, small_features, small_labels),
        ("ours CachedDistillKLDivLoss", contenders["ours CachedDistillKLDivLoss"], 2, small_k, small_features,
         small_labels),
        *[(name, loss, args.batch, args.negatives, features, labels) for name, loss in contenders.items()],
    ]  # fmt: skip
    rows = []
    base = 0
    for name, loss, b, k, feats, labs in runs:
        gc.collect()
        with PeakMemory() as mem:
            one_step(model, loss, feats, labs)
        base = base or mem.peak_bytes  # the first run: theirs on one mini-batch of texts
        times = []
        for _ in range(args.steps if b == args.batch else 0):
            start = time.perf_counter()
            one_step(model, loss, feats, labs)
            times.append(time.perf_counter() - start)
        row = {
            "contender": name,
            "B": b,
            "K": k,
            "texts": b * (k + 2),
            "mini_batch": args.mini_batch if name.startswith("ours") else "",
            "peak_mib": round(mem.peak_bytes / 2**20, 2),
            "x_mini_batch": round(mem.peak_bytes / base, 3),
            "median_s": round(statistics.median(times), 3) if times else "",
            "steps": len(times),
        }
        rows.append(row)
        print(row, flush=True)
    theirs = next(r for r in rows if r["B"] == args.batch)
    for row in rows:
        same = row["B"] == args.batch
        row["x_theirs_time"] = round(row["median_s"] / theirs["median_s"], 3) if same else ""
        row["x_theirs_memory"] = round(row["peak_mib"] / theirs["peak_mib"], 3) if same else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{args.stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Distillation step: B={args.batch} queries x ({args.negatives} hard negatives + positive + query) = "
        f"{texts} texts",
        "",
        f"all-MiniLM-L6-v2 truncated to {args.layers} layers, max_seq_length {args.max_seq_length}, CPU "
        f"({torch.get_num_threads()} threads); peak live tensor bytes of one step (PeakMemory); time: the median "
        f"of {args.steps} steps after the measured one. 'one mini-batch': the first row, theirs on as many texts as one "
        f"of our mini-batches ({args.mini_batch}); the encoder alone on them (forward and backward with the "
        f"parameter gradients) peaks at {encoder / 2**20:.1f} MiB.",
        "",
        "| contender | B | K | texts | peak (MiB) | x one mini-batch | x theirs (memory) | step median (s) | "
        "x theirs (time) |",
        "|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {r['contender']} | {r['B']} | {r['K']} | {r['texts']} | {r['peak_mib']:.1f} | "
            f"{r['x_mini_batch']:.2f} | {r['x_theirs_memory']} | {r['median_s']} | {r['x_theirs_time']} |"
            for r in rows
        ],
        "",
        f"Command: `.venv/bin/python benchmarks/distill_memory.py --batch {args.batch} --negatives "
        f"{args.negatives} --mini-batch {args.mini_batch} --layers {args.layers} --max-seq-length "
        f"{args.max_seq_length} --steps {args.steps}{' --with-infonce' * args.with_infonce}`",
    ]
    (RESULTS / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
