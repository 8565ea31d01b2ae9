"""What does keeping a forward's autograd graph cost on this host, against a forward whose graph is
back-propagated right away (a GradCache replay)?

``graph_memory_budget`` swaps a mini-batch's replay (a forward with a graph, then its backward) for a
first-stage forward whose graph is kept until the backward. That saves the first stage's no-grad forward
only if a kept forward costs what a replayed one does. This measures the three forwards on the packaged
all-MiniLM-L6-v2 in training mode, ``--count`` mini-batches of ``--rows`` documents (stdlib source texts,
``--max-seq-length`` tokens), per round:

* ``no-grad``: each forward without a graph (GradCache's first stage);
* ``replayed``: each forward with a graph, back-propagated before the next one (the replay);
* ``kept``: every forward with its graph kept, then every backward (the kept graphs of a budget).

Per forward: the median time over the rounds after the first (warm-up), the minor page faults
(``getrusage``), and the bytes its graph holds (the engine's meter). Run from the repository root:
``.venv/bin/python -m benchmarks.investigations.kept_forward``; prefix glibc tunables (e.g.
``MALLOC_TRIM_THRESHOLD_=...``) to see how the host's allocator moves the ``kept`` row. Writes
``benchmarks/investigations/results/kept_forward.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks._common import ROOT, minilm


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_round(encode, batches: list[dict]) -> dict[str, tuple[float, float]]:
    """Seconds and minor faults per forward for each way of running it."""
    out = {}
    faults, start = minor_faults(), time.perf_counter()
    with torch.no_grad():
        for features in batches:
            encode(features)
    out["no-grad"] = (time.perf_counter() - start, minor_faults() - faults)

    seconds, faults = 0.0, minor_faults()
    for features in batches:
        t0 = time.perf_counter()
        emb = encode(features)
        seconds += time.perf_counter() - t0
        emb.backward(torch.ones_like(emb))
    out["replayed"] = (seconds, minor_faults() - faults)

    kept, faults, start = [], minor_faults(), time.perf_counter()
    for features in batches:
        kept.append(encode(features))
    out["kept"] = (time.perf_counter() - start, minor_faults() - faults)
    for emb in kept:
        emb.backward(torch.ones_like(emb))
    n = len(batches)
    return {name: (s / n, f / n) for name, (s, f) in out.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--count", type=int, default=40, help="mini-batches per round")
    parser.add_argument("--rounds", type=int, default=3, help="the first is a warm-up")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "investigations" / "results")
    args = parser.parse_args(argv)

    from st_cached_losses.data import stdlib_pairs
    from st_cached_losses.engine.graph_budget import GraphMeter

    model = minilm(args.max_seq_length)
    model.train()
    docs = [d for _, d in stdlib_pairs()][: args.rows * args.count]
    batches = [model.preprocess(docs[i : i + args.rows]) for i in range(0, len(docs), args.rows)]

    def encode(features: dict) -> torch.Tensor:
        return model(dict(features))["sentence_embedding"]

    graph: list[int] = []
    with GraphMeter(model).measure(torch.device("cpu"), graph):
        emb = encode(batches[0])
    del emb

    rounds = [one_round(encode, batches) for _ in range(args.rounds)]
    timed = rounds[1:] or rounds
    rows = []
    for name in ("no-grad", "replayed", "kept"):
        ms = statistics.median(r[name][0] for r in timed) * 1e3
        faults = statistics.median(r[name][1] for r in timed)
        rows.append({"forward": name, "ms": round(ms, 1), "minor_faults": int(faults)})
    replayed = rows[1]["ms"]
    for row in rows:
        row["vs_replayed"] = round(row["ms"] / replayed, 2)

    settings = " ".join(
        f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("MALLOC_", "THP_"))
    )
    title = (
        f"Forward of {args.rows} x {args.max_seq_length} tokens, all-MiniLM-L6-v2, training mode, "
        f"{torch.get_num_threads()} CPU threads; graph {graph[0] / 2**20:.0f} MiB; {args.count} mini-batches a "
        f"round, median of {len(timed)} rounds; allocator settings: {settings or 'defaults'}."
    )
    lines = [title, "", "| forward | ms | vs replayed | minor faults |", "|---|---|---|---|"]
    lines += [f"| {r['forward']} | {r['ms']} | {r['vs_replayed']} | {r['minor_faults']} |" for r in rows]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kept_forward.md").write_text("\n".join(lines) + "\n")
    with open(args.out / "kept_forward.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
