"""The SPLADE loss stage (GradCache's stage 2): time and peak memory of the loss and its gradient wrt every
cached embedding, sentence-transformers' ``CachedSpladeLoss`` against ``CachedSparseLoss``.

Both get the same cached embeddings (``B`` rows per column, anchor / positive / negative, BERT's vocabulary
``V = 30522``, about ``--nnz`` non-zero entries per row, non-negative as SPLADE's) and compute
``SparseMultipleNegativesRankingLoss`` (dot product, scale 1) plus both FLOPS regularisers, through
``calculate_loss(reps, with_backward=True)``: theirs with autograd over the whole batch, ours with the core and
the FLOPS in closed form. Memory: the peak bytes of tensors allocated inside the call and alive at once
(``tests/support/memory.py``, deterministic), beside the bytes of the embeddings themselves. Time: medians of
``--repeats``, interleaved. The loss values are checked to agree (rtol 1e-5).

Run: ``.venv/bin/python benchmarks/sparse_loss_stage.py`` (``--sizes``, ``--nnz``; ``--quick`` for a smoke
run). Writes ``benchmarks/results/sparse_loss_stage.{md,csv}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.support.memory import PeakMemory  # noqa: E402

COLUMNS = 3  # anchor, positive, one hard negative


def splade_like(b: int, v: int, nnz: int, gen: torch.Generator) -> torch.Tensor:
    """``(b, v)`` non-negative rows with about ``nnz`` non-zero entries each (a SPLADE embedding's shape)."""
    out = torch.zeros(b, v)
    cols = torch.randint(0, v, (b, nnz), generator=gen)
    out.scatter_(1, cols, torch.rand(b, nnz, generator=gen) * 2)
    return out


def losses(model):
    from sentence_transformers.sparse_encoder.losses import (
        CachedSpladeLoss,
        SparseMultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedSparseLoss

    kwargs = {"document_regularizer_weight": 3e-5, "query_regularizer_weight": 5e-5, "mini_batch_size": 32}
    return {
        "st-CachedSpladeLoss": CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs),
        "ours-CachedSparseLoss": CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs),
    }


def measure(loss, embeddings: list[torch.Tensor]) -> tuple[float, int, float]:
    """(seconds, peak bytes, loss value) of one stage 2."""
    reps = [[e.clone().requires_grad_()] for e in embeddings]
    gc.collect()
    start = time.perf_counter()
    with PeakMemory() as meter:
        value = loss.calculate_loss(reps, None, with_backward=True)
    seconds = time.perf_counter() - start
    assert all(r[0].grad is not None for r in reps)
    return seconds, meter.peak_bytes, float(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,1024,2048")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--nnz", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.vocab, args.repeats = "64,128", 2000, 1
    torch.manual_seed(0)
    from tests.support.tiny_model import make_tiny_splade

    model = make_tiny_splade(Path(tempfile.mkdtemp()) / "splade")
    contenders = losses(model)
    rows = []
    for b in [int(s) for s in args.sizes.split(",")]:
        gen = torch.Generator().manual_seed(b)
        embeddings = [splade_like(b, args.vocab, args.nnz, gen) for _ in range(COLUMNS)]
        input_bytes = sum(e.numel() * e.element_size() for e in embeddings)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        peaks: dict[str, int] = {}
        values: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, loss in contenders.items():
                seconds, peak, value = measure(loss, embeddings)
                times[name].append(seconds)
                peaks[name], values[name] = peak, value
        ref = values["st-CachedSpladeLoss"]
        for name in contenders:
            assert abs(values[name] - ref) <= 1e-5 * abs(ref) + 1e-7, (name, values[name], ref)
            rows.append(
                {
                    "B": b,
                    "V": args.vocab,
                    "columns": COLUMNS,
                    "loss": name,
                    "seconds": round(statistics.median(times[name]), 4),
                    "peak_MiB": round(peaks[name] / 2**20, 1),
                    "embeddings_MiB": round(input_bytes / 2**20, 1),
                    "peak_over_embeddings": round(peaks[name] / input_bytes, 2),
                }
            )
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "sparse_loss_stage_quick" if args.quick else "sparse_loss_stage"
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"SPLADE loss stage (SparseMNRL + both FLOPS, {COLUMNS} columns, V = {args.vocab}, ~{args.nnz} non-zeros "
        "per row), loss and gradients wrt the embeddings; peak: tensor bytes allocated in the call and alive at once",
        "",
        "| B | loss | seconds | peak MiB | embeddings MiB | peak / embeddings |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['B']} | {r['loss']} | {r['seconds']} | {r['peak_MiB']} | {r['embeddings_MiB']} | "
        f"{r['peak_over_embeddings']} |"
        for r in rows
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
