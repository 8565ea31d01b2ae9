"""The sparse loss's compact cache under ``gather_across_devices``, on gloo processes (CPU): bytes of the cache
(embeddings kept for the loss stage, gradients kept for the replay), bytes this process sends in collectives,
and the loss stage's peak, compact (packed non-zero entries, agreed on by every process) against dense
(``B x V`` fp32 per column), gathered and by ring.

Each process holds its own number of rows (``--rows``, one per process), three columns (anchor, positive, hard
negative) of SPLADE-like rows (BERT's vocabulary ``V = 30522``, ``--nnz / 2`` to ``3 --nnz / 2`` non-zero entries
each, as ``benchmarks/sparse_loss_stage.py``), cut into mini-batches of 32 rows as the engine keeps them. The
compact form goes through the cache form's own ``pack`` / ``finish`` (the all-reduce that agrees on it), then the
loss stage as the engine's stage 2 calls it (``SparseMultipleNegativesRankingLoss`` plus both FLOPS
regularisers, with gradients); the dense form is the same step with the form kept dense. The loss values of
both forms are checked to agree (rtol 1e-5). Peak: tensor bytes allocated in the loss stage and alive at once
(``tests/support/memory.py``).

Run: ``.venv/bin/python benchmarks/sparse_compact_gather.py`` (``--rows 384,256``, ``--nnz 200``).
Prints a markdown table (rank 0's bytes, and the largest peak over processes).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import _common  # noqa: F401  (the repository root first on sys.path)
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.sparse_loss_stage import COLUMNS, splade_like
from tests.support.dist_utils import run_distributed
from tests.support.memory import PeakMemory

MINI_BATCH = 32


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, model_dir: str, rows: list[int], vocab: int, nnz: int) -> list[dict]:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss

    from st_cached_losses import CachedSparseLoss
    from st_cached_losses.distributed import STATS
    from st_cached_losses.losses.base import StageInput, StepData

    model = SparseEncoder(model_dir, device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    embeddings = [splade_like(rows[rank], vocab, nnz, gen) for _ in range(COLUMNS)]
    out = []
    for path in ("auto", "tiled"):
        for form_name in ("dense", "compact"):
            base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=True)
            loss = CachedSparseLoss(
                model, base, document_regularizer_weight=3e-5, query_regularizer_weight=5e-5, path=path
            )
            form = loss.cache.form
            if form_name == "dense":
                form.max_density = 0.0  # every mini-batch "too dense": the step keeps the dense rows
            # stage 1's kept mini-batches, then the form's decision for the step (agreed by every process)
            parts = [[form.pack(m) for m in e.split(MINI_BATCH)] for e in embeddings]
            parts = form.finish(parts)
            assert form.compact is (form_name == "compact")
            cache = [torch.cat(p) if p[0].dim() == 2 else _cat_packed(p) for p in parts]
            STATS.reset()
            with PeakMemory() as meter:
                stage = loss.stage(
                    StageInput(cache, None, StepData()), with_grad=True
                )  # the engine's stage 2
                values, grads = stage.parts, stage.grads
            assert grads is not None
            out.append(
                {
                    "path": "ring" if path == "tiled" else "gathered",
                    "form": form_name,
                    "loss": float(torch.stack(list(values.values())).sum()),
                    "cache_embeddings": nbytes(cache),
                    "cache_gradients": nbytes(grads),
                    "sent": STATS.total_bytes,
                    "peak": meter.peak_bytes,
                    "width": int(cache[0].shape[1]),
                }
            )
    return out


def _cat_packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """A column's packed mini-batches at the column's widest (as the engine pads them: zeros)."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1])) for p in parts])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="384,256", help="rows per process (one number per process)")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--nnz", type=int, default=200)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    from tests.support.tiny_model import make_tiny_splade

    model_dir = str(Path(tempfile.mkdtemp()) / "splade")
    make_tiny_splade(Path(model_dir) / "bert").save(model_dir)
    per_rank = run_distributed(_worker, len(rows), model_dir, rows, args.vocab, args.nnz, timeout=900)
    mib = 2**20
    lines = [
        f"{len(rows)} gloo processes, rows {rows}, {COLUMNS} columns, V = {args.vocab}, {args.nnz // 2}-"
        f"{3 * args.nnz // 2} non-zeros per row; rank 0's bytes (MiB), the largest loss-stage peak over processes",
        "",
        "| across processes | cache form | k (rank 0, column 0) | cached embeddings | cached gradients | sent in collectives | loss-stage peak | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(per_rank[0]):
        peak = max(p[i]["peak"] for p in per_rank)
        loss = sum(p[i]["loss"] for p in per_rank) / len(per_rank)
        lines.append(
            f"| {r['path']} | {r['form']} | {r['width'] if r['form'] == 'compact' else '-'} | "
            f"{r['cache_embeddings'] / mib:.1f} | {r['cache_gradients'] / mib:.1f} | {r['sent'] / mib:.1f} | "
            f"{peak / mib:.1f} | {loss:.6f} |"
        )
    for i in range(0, len(per_rank[0]), 2):  # dense, compact of one path: the same loss
        dense, compact = (sum(p[j]["loss"] for p in per_rank) for j in (i, i + 1))
        assert abs(dense - compact) <= 1e-5 * abs(dense), (dense, compact)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
