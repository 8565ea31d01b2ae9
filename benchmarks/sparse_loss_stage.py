"""The SPLADE loss stage (GradCache's stage 2): time and peak memory of the loss and its gradient wrt every
cached embedding, sentence-transformers' ``CachedSpladeLoss`` against ``CachedSparseLoss``.

All get the same cached embeddings (``B`` rows per column, anchor / positive / negative, BERT's vocabulary
``V = 30522``, each row with a uniformly drawn ``--nnz / 2`` to ``3 * --nnz / 2`` non-zero entries at random
positions, non-negative as SPLADE's) and compute ``SparseMultipleNegativesRankingLoss`` (dot product, scale 1)
plus both FLOPS regularisers and the gradients wrt every embedding: theirs with autograd over the whole
batch (``calculate_loss(reps, with_backward=True)``), ours on the dense cache (the same call: the core and the
FLOPS in closed form), and ours on the compact cache the engine keeps for sparse rows (``ours-compact``: each
row's non-zero entries packed as ``(B, k, 2)`` index / value pairs, ``k`` the widest row; the loss stage as
the engine's stage 2 calls it, gradients packed the same way). Memory: the peak bytes of tensors allocated
inside the call and alive at once (``tests/support/memory.py``, deterministic), beside the bytes of the cache:
the embeddings (kept from stage 1 to stage 2) and their gradients (kept from stage 2 to the replay), dense
``B x V`` fp32 per column or packed. Time: medians of ``--repeats``, interleaved. The loss values are checked
to agree (rtol 1e-5).

Run: ``.venv/bin/python benchmarks/sparse_loss_stage.py`` (``--sizes``, ``--nnz``, ``--only`` a subset of the
losses; ``--quick`` for a smoke run). Writes ``benchmarks/results/sparse_loss_stage.{md,csv}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.losses.base import StageInput, StepData
from tests.support.memory import PeakMemory

COLUMNS = 3  # anchor, positive, one hard negative


def splade_like(b: int, v: int, nnz: int, gen: torch.Generator) -> torch.Tensor:
    """``(b, v)`` non-negative rows with ``nnz / 2`` to ``3 nnz / 2`` non-zero entries each (uniform; a SPLADE
    embedding's shape: trained SPLADE rows have about 100-300 of 30,522)."""
    out = torch.zeros(b, v)
    hi = 3 * nnz // 2
    cols = torch.randint(0, v, (b, hi), generator=gen)  # (a position drawn twice counts once)
    counts = torch.randint(nnz // 2, hi + 1, (b, 1), generator=gen)
    vals = (torch.rand(b, hi, generator=gen) * 2 + 0.01) * (torch.arange(hi) < counts)
    out.scatter_(1, cols, vals)
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
        "ours-compact": CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs),
    }


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(name: str, loss, embeddings: list[torch.Tensor]) -> tuple[float, int, float, int, int]:
    """(seconds, peak bytes, loss value, cached embeddings' bytes, their gradients' bytes) of one stage 2."""
    if name == "ours-compact":
        # the engine's cache form, as stage 1 keeps each mini-batch (here one per column)
        form = loss.cache.form
        cache = [p[0] for p in form.finish([[form.pack(e)] for e in embeddings])]
        assert form.compact and all(c.dim() == 3 for c in cache)
        gc.collect()
        start = time.perf_counter()
        with PeakMemory() as meter:
            stage = loss.stage(StageInput(cache, None, StepData()), with_grad=True)  # the engine's stage 2
            value, grads = stage.loss, stage.grads
        seconds = time.perf_counter() - start
        return seconds, meter.peak_bytes, float(value), nbytes(cache), nbytes(grads)
    reps = [[e.clone().requires_grad_()] for e in embeddings]
    gc.collect()
    start = time.perf_counter()
    with PeakMemory() as meter:
        value = loss.calculate_loss(reps, None, with_backward=True)
    seconds = time.perf_counter() - start
    assert all(r[0].grad is not None for r in reps)
    return seconds, meter.peak_bytes, float(value), nbytes(embeddings), nbytes([r[0].grad for r in reps])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,1024,2048")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--nnz", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated loss names to run (default: all)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.vocab, args.repeats = "64,128", 2000, 1
    torch.manual_seed(0)
    from tests.support.tiny_model import make_tiny_splade

    model = make_tiny_splade(Path(tempfile.mkdtemp()) / "splade")
    contenders = losses(model)
    if args.only:
        contenders = {k: v for k, v in contenders.items() if k in args.only.split(",")}
    rows = []
    for b in [int(s) for s in args.sizes.split(",")]:
        gen = torch.Generator().manual_seed(b)
        embeddings = [splade_like(b, args.vocab, args.nnz, gen) for _ in range(COLUMNS)]
        input_bytes = sum(e.numel() * e.element_size() for e in embeddings)
        nnz = torch.cat([(e != 0).sum(1) for e in embeddings]).float()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        peaks: dict[str, int] = {}
        values: dict[str, float] = {}
        cache: dict[str, tuple[int, int]] = {}
        for _ in range(args.repeats):
            for name, loss in contenders.items():
                seconds, peak, value, emb_bytes, grad_bytes = measure(name, loss, embeddings)
                times[name].append(seconds)
                peaks[name], values[name], cache[name] = peak, value, (emb_bytes, grad_bytes)
        ref = values[next(iter(contenders))]
        for name in contenders:
            assert abs(values[name] - ref) <= 1e-5 * abs(ref) + 1e-7, (name, values[name], ref)
            rows.append(
                {
                    "B": b,
                    "V": args.vocab,
                    "columns": COLUMNS,
                    "loss": name,
                    "nnz_mean": round(float(nnz.mean()), 1),
                    "nnz_max": int(nnz.max()),
                    "seconds": round(statistics.median(times[name]), 4),
                    "peak_MiB": round(peaks[name] / 2**20, 1),
                    "cached_embeddings_MiB": round(cache[name][0] / 2**20, 1),
                    "cached_gradients_MiB": round(cache[name][1] / 2**20, 1),
                    "dense_embeddings_MiB": round(input_bytes / 2**20, 1),
                    "peak_over_dense_embeddings": round(peaks[name] / input_bytes, 3),
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
        f"SPLADE loss stage (SparseMNRL + both FLOPS, {COLUMNS} columns, V = {args.vocab}, {args.nnz // 2}-"
        f"{3 * args.nnz // 2} non-zeros per row), loss and gradients wrt the embeddings; peak: tensor bytes "
        "allocated in the call and alive at once; cache: the embeddings kept for the loss stage and the "
        "gradients kept for the replay",
        "",
        "| B | loss | nnz mean / max | seconds | peak MiB | cached embeddings MiB | cached gradients MiB | "
        "dense embeddings MiB | peak / dense embeddings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['B']} | {r['loss']} | {r['nnz_mean']} / {r['nnz_max']} | {r['seconds']} | {r['peak_MiB']} | "
        f"{r['cached_embeddings_MiB']} | {r['cached_gradients_MiB']} | {r['dense_embeddings_MiB']} | "
        f"{r['peak_over_dense_embeddings']} |"
        for r in rows
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
