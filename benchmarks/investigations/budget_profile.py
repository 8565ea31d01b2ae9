"""Where does a step's time go with ``graph_memory_budget`` and without it? A profile by stage and by
forward, to explain the ``benchmarks/graph_budget.py`` rows.

The packaged all-MiniLM-L6-v2 in training mode, stdlib text pairs, ``CachedMNRLoss`` with mini-batch 16,
``--steps`` batches of ``--batch-size`` pairs (cycled when the texts run out; the first step is a warm-up),
one mode after the other in one process (``none`` first, on a fresh heap): ``none`` (no budget) and
``budget`` (``--budget-mib``; by default half the plain loss's peak for this B and L recorded in
``benchmarks/results/graph_budget.csv``). Per mode: the median step, its first two stages (embed and
loss) and its third (replay and backward), and every encoder forward timed (means over the steps
after the warm-up) and classed as ``no-grad`` (first stage), ``kept`` (first stage, its graph kept for
the backward: the budget's, and the step's last forward), ``graph`` (first stage with a graph that is
replayed anyway: a column's last forward) or ``replay`` (third stage), split into full-length
mini-batches (padded to L) and shorter ones, with the minor page faults (``getrusage``) each took.
CPU only.

Run from the repository root:
``.venv/bin/python -m benchmarks.investigations.budget_profile --batch-size 1024 --max-seq-length 32``.
Writes ``benchmarks/investigations/results/budget_profile.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks._common import ROOT, minilm, read_rows
from benchmarks.investigations.kept_forward import minor_faults


def recorded_half_peak(b: int, length: int) -> int | None:
    """Half the plain loss's peak for (B, L) from graph_budget.csv, in bytes, if recorded."""
    for row in read_rows(ROOT / "benchmarks" / "results" / "graph_budget.csv"):
        if (row["B"], row["L"], row["contender"]) == (b, length, "mnrl"):
            return int(row["peak_mib"] * 2**20) // 2
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--mini-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="the first is a warm-up")
    parser.add_argument("--budget-mib", type=float, default=None)
    parser.add_argument("--modes", default="none,budget")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "investigations" / "results")
    args = parser.parse_args(argv)
    b, length = args.batch_size, args.max_seq_length
    budget = int(args.budget_mib * 2**20) if args.budget_mib else recorded_half_peak(b, length)
    if budget is None:
        parser.error(f"no plain-loss peak recorded for B={b}, L={length}: pass --budget-mib")

    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.data import stdlib_pairs
    from st_cached_losses.engine.gradcache import GradCache

    model = minilm(length)
    model.train()
    pairs = stdlib_pairs()
    batches = [pairs[i * b : (i + 1) * b] for i in range(max(len(pairs) // b, 1))]
    feats = [[model.preprocess([q for q, _ in bt]), model.preprocess([d for _, d in bt])] for bt in batches]

    # every encoder forward of a step: (stage, with a graph, its tokens' hash, padded length, seconds, minor faults)
    log: list[tuple] = []
    stage = ["1"]
    encode = GradCache.encode

    def timed_encode(self, model, features):
        faults, start = minor_faults(), time.perf_counter()
        out = encode(self, model, features)
        seconds, faults = time.perf_counter() - start, minor_faults() - faults
        ids = features["input_ids"]
        key = hash(ids.numpy().tobytes())  # mini-batches are sliced anew at each use: known by their tokens
        log.append((stage[0], torch.is_grad_enabled(), key, ids.shape[1], seconds, faults))
        return out

    GradCache.encode = timed_encode
    lines = [
        f"Step profile, all-MiniLM-L6-v2, B = {b}, L = {length}, mini-batch {args.mini_batch_size}, "
        f"{torch.get_num_threads()} CPU threads, budget {budget / 2**20:.0f} MiB; steps 2-{args.steps}: median step, "
        "forwards per step, their seconds per step, per forward and minor faults per forward (means).",
        "",
        "| mode | step (s) | stages 1-2 (s) | stage 3 (s) | forward | length | count | total (s) | mean ms | mean faults |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in args.modes.split(","):
        loss = CachedMNRLoss(
            model,
            mini_batch_size=args.mini_batch_size,
            graph_memory_budget=budget if mode == "budget" else None,
        )
        steps, forwards = [], {}
        for s in range(args.steps):
            model.zero_grad(set_to_none=True)
            gc.collect()
            log.clear()
            stage[0] = "1"
            t0 = time.perf_counter()
            value = loss([dict(f) for f in feats[s % len(feats)]], None)
            t1 = time.perf_counter()
            stage[0] = "3"
            value.backward()
            t2 = time.perf_counter()
            print(
                f"{mode} step {s}: {t2 - t0:.2f} s (stages 1-2 {t1 - t0:.2f}, stage 3 {t2 - t1:.2f})",
                flush=True,
            )
            if s == 0 and args.steps > 1:
                continue
            steps.append((t2 - t0, t1 - t0, t2 - t1))
            replayed = {key for st, _, key, _, _, _ in log if st == "3"}
            for st, grad, key, width, seconds, faults in log:
                if st == "3":
                    kind = "replay"
                elif not grad:
                    kind = "no-grad"
                else:
                    kind = "graph" if key in replayed else "kept"
                full = "L" if width == length else "< L"
                forwards.setdefault((kind, full), []).append((seconds, faults))
        step = [statistics.median(x[i] for x in steps) for i in range(3)]
        for (kind, full), xs in sorted(forwards.items()):
            n = len(xs) / len(steps)
            seconds = sum(x[0] for x in xs) / len(steps)
            lines.append(
                f"| {mode} | {step[0]:.2f} | {step[1]:.2f} | {step[2]:.2f} | {kind} | {full} | {n:.0f} | "
                f"{seconds:.2f} | {1e3 * seconds / n:.1f} | {sum(x[1] for x in xs) / len(xs):.0f} |"
            )
    GradCache.encode = encode
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "budget_profile.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
