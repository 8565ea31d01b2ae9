"""What does SameDatasetBatchSampler cost against sentence-transformers' own multi-dataset samplers?

Every process iterates the whole batch stream of the multi-dataset sampler (accelerate keeps every N-th
batch), so a process pays the stream's cost of N batches per step. Measured here:

* the time to iterate one epoch of the stream, per batch, for three datasets of 100,000, 50,000 and 20,000
  rows at batch 32 (the trainer's set-up: one shared generator, ``DefaultBatchSampler`` over a
  ``RandomSampler`` per dataset): ``SameDatasetBatchSampler`` (proportional and round-robin, groups of 8 =
  8 processes) against ``RoundRobinBatchSampler`` and ``ProportionalBatchSampler``; rounds interleave the
  contenders, medians of the rounds;
* one training step on the CPU (the packaged all-MiniLM-L6-v2, CachedMNRLoss, batch 32 of (query, document)
  pairs, mini-batch 8, 64 tokens; forward + backward), median of a few steps;
* the step time with each sampler's share added (8 stream batches per step): the ratio of ours to
  sentence-transformers' sampler of the same order.

Run: ``.venv/bin/python benchmarks/sampler_overhead.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/sampler_overhead.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import time
from pathlib import Path

import _common  # noqa: F401  (the repository root first on sys.path)
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 8  # processes: batches of the stream per step and per process


def build(kind: str, sizes: tuple[int, ...], batch: int):
    """A multi-dataset sampler as the trainer builds it."""
    from sentence_transformers.base.sampler import (
        DefaultBatchSampler,
        ProportionalBatchSampler,
        RoundRobinBatchSampler,
    )
    from torch.utils.data import ConcatDataset, RandomSampler

    from st_cached_losses import SameDatasetBatchSampler

    datasets = [range(n) for n in sizes]
    generator = torch.Generator().manual_seed(0)
    samplers = [
        DefaultBatchSampler(RandomSampler(ds, generator=generator), batch_size=batch, drop_last=False, seed=0)
        for ds in datasets
    ]
    cls = {
        "round_robin (ST)": RoundRobinBatchSampler,
        "proportional (ST)": ProportionalBatchSampler,
        "same_dataset round_robin": functools.partial(
            SameDatasetBatchSampler, order="round_robin", world_size=WORLD
        ),
        "same_dataset proportional": functools.partial(
            SameDatasetBatchSampler, order="proportional", world_size=WORLD
        ),
    }[kind]
    return cls(ConcatDataset(datasets), samplers, generator=generator, seed=0)


def stream_time(kind: str, sizes: tuple[int, ...], batch: int) -> tuple[float, int]:
    """Seconds to iterate one epoch of the stream, and its number of batches."""
    sampler = build(kind, sizes, batch)
    start = time.perf_counter()
    n = sum(1 for _ in sampler)
    return time.perf_counter() - start, n


def step_time(steps: int, batch: int) -> float:
    """Median seconds of one forward + backward of CachedMNRLoss on the packaged MiniLM."""
    from _common import minilm

    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.data import stdlib_pairs

    model = minilm(64)
    loss = CachedMNRLoss(model, mini_batch_size=8)
    pairs = stdlib_pairs(limit=batch * (steps + 1))
    times = []
    for s in range(steps + 1):
        rows = pairs[s * batch : (s + 1) * batch]
        features = [model.preprocess([q for q, _ in rows]), model.preprocess([d for _, d in rows])]
        start = time.perf_counter()
        loss(features, None).backward()
        model.zero_grad(set_to_none=True)
        if s:  # the first step warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small datasets, two rounds, two steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = (10_000, 5_000, 2_000) if args.quick else (100_000, 50_000, 20_000)
    batch, rounds, steps = 32, (2 if args.quick else 7), (2 if args.quick else 5)
    kinds = ["round_robin (ST)", "same_dataset round_robin", "proportional (ST)", "same_dataset proportional"]
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    batches: dict[str, int] = {}
    for kind in kinds:  # warm-up: imports, first allocations
        stream_time(kind, sizes, batch)
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            t, n = stream_time(kind, sizes, batch)
            seconds[kind].append(t)
            batches[kind] = n
    step = step_time(steps, batch)
    rows = []
    for kind in kinds:
        per_batch = statistics.median(seconds[kind]) / batches[kind]
        rows.append({"sampler": kind, "batches": batches[kind], "per_batch_us": per_batch * 1e6})
    by_kind = {row["sampler"]: row for row in rows}
    for row in rows:
        base = by_kind[("round_robin" if "round_robin" in row["sampler"] else "proportional") + " (ST)"]
        per_step = row["per_batch_us"] * 1e-6 * WORLD
        row["vs_st_stream"] = row["per_batch_us"] / base["per_batch_us"]
        row["share_of_step"] = per_step / step
        row["step_ratio_vs_st"] = (step + per_step) / (step + base["per_batch_us"] * 1e-6 * WORLD)
        # the step time below which ours would add more than 2% to a step against ST's sampler
        extra = max(0.0, (row["per_batch_us"] - base["per_batch_us"]) * 1e-6 * WORLD)
        row["step_for_2pct_ms"] = extra / 0.02 * 1e3
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "sampler_overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "step_s"])
        writer.writeheader()
        writer.writerows({**row, "step_s": step} for row in rows)
    lines = [
        f"Datasets of {', '.join(f'{n:,}' for n in sizes)} rows, batch {batch}, groups of {WORLD} (8 processes: "
        f"a process iterates {WORLD} stream batches per step); medians of {rounds} interleaved epochs. "
        f"Step: CachedMNRLoss on all-MiniLM-L6-v2, batch {batch}, mini-batch 8, 64 tokens, CPU, one thread: "
        f"median {step:.3f} s of {steps}.",
        "",
        "| sampler | batches / epoch | per stream batch (us) | vs ST's same order | per step / step time "
        "| step time vs ST's same order | a step shorter than this would see +2% (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['sampler']} | {row['batches']:,} | {row['per_batch_us']:.2f} | {row['vs_st_stream']:.2f} | "
            f"{row['share_of_step']:.1e} | {row['step_ratio_vs_st']:.5f} | {row['step_for_2pct_ms']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / "sampler_overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
