"""The largest batch each loss stage fits in a fixed memory budget: sentence-transformers' cached sparse and
multi-vector losses against ours, measured, not extrapolated.

The footprint of a loss stage at batch size ``B`` is what it holds at its peak: the cached embeddings as that
loss keeps them between GradCache's stages (dense ``B x V`` rows for theirs, the packed non-zero entries for
our compact sparse cache; token embeddings with their masks for the multi-vector losses) plus the peak of the
tensors allocated inside the loss-and-gradient call and alive at once (``tests/support/memory.py``,
deterministic; the gradients kept for the replay are among them). On a GPU the allocator's peak would be
the measure; on this CPU the tensor-bytes meter is.

For each kind, theirs is searched by bisection on a grid of ``--step`` rows (its footprint grows with ``B``),
then ours is measured at ``--factor`` times theirs (the issue's target is 4x) and, while it fits, at
``--tries - 1`` further doublings (up to ``--max-ours``): ours' column is the largest batch measured to fit, a lower
bound of its largest (ours is not searched to its limit: on a CPU its time, not its memory, is the limit).

Shapes: sparse as ``benchmarks/sparse_loss_stage.py`` (3 columns, V = 30,522, 100-300 non-zeros a row);
multi-vector as ``benchmarks/multi_vector.py`` (32 query and 180 document tokens, d = 128, pairs).

Run: ``.venv/bin/python benchmarks/largest_batch.py`` (``--sparse-budget``, ``--multi-vector-budget`` as
``"2GiB"``; ``--kinds``). Writes ``benchmarks/results/largest_batch.{md,csv}``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from st_cached_losses.engine.checks import memory_bytes
from st_cached_losses.losses.base import StageInput, StepData
from tests.support.memory import PeakMemory

MiB = 2**20


def footprint(held: int, call: Callable[[], object]) -> tuple[int, float]:
    """(held + the call's peak bytes, the call's seconds)."""
    gc.collect()
    start = time.perf_counter()
    with PeakMemory() as meter:
        call()
    return held + meter.peak_bytes, time.perf_counter() - start


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sparse_contenders(vocab: int, nnz: int) -> dict[str, Callable[[int], tuple[int, float]]]:
    from sparse_loss_stage import COLUMNS, losses, splade_like

    from tests.support.tiny_model import make_tiny_splade

    model = make_tiny_splade(Path(tempfile.mkdtemp()) / "splade")
    made = losses(model)

    def rows(b: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(b)
        return [splade_like(b, vocab, nnz, gen) for _ in range(COLUMNS)]

    def theirs(b: int) -> tuple[int, float]:
        embeddings = rows(b)
        reps = [[e.requires_grad_()] for e in embeddings]
        return footprint(
            nbytes(embeddings),
            lambda: made["st-CachedSpladeLoss"].calculate_loss(reps, None, with_backward=True),
        )

    def ours(b: int) -> tuple[int, float]:
        loss = made["ours-compact"]
        form = loss.cache.form
        dense = rows(b)
        cache = [p[0] for p in form.finish([[form.pack(e)] for e in dense])]
        del dense  # the engine keeps the packed rows only
        assert form.compact
        return footprint(
            nbytes(cache), lambda: loss.stage(StageInput(cache, None, StepData()), with_grad=True)
        )

    return {"theirs": theirs, "ours": ours}


def multi_vector_contenders() -> dict[str, Callable[[int], tuple[int, float]]]:
    from multi_vector import inputs, ours_inputs, run_ours, run_st, st_inputs

    def theirs(b: int) -> tuple[int, float]:
        reps, masks = st_inputs(*inputs(b, 1, 32, 180, 128))
        held = nbytes([t for column in reps + masks for t in column])
        return footprint(held, lambda: run_st(reps, masks))

    def ours(b: int) -> tuple[int, float]:
        (packed,) = ours_inputs(*inputs(b, 1, 32, 180, 128))
        return footprint(nbytes(packed), lambda: run_ours(packed))

    return {"theirs": theirs, "ours": ours}


def record(
    rows: list[dict], kind: str, budget: str, who: str, b: int, used: int, seconds: float, fit: bool
) -> None:
    print(f"{kind} {who} B={b}: {used / MiB:.1f} MiB, {seconds:.1f} s, fits={fit}", flush=True)
    rows.append({"kind": kind, "budget": budget, "contender": who, "B": b,
                 "footprint_MiB": round(used / MiB, 1), "seconds": round(seconds, 2), "fits": fit})  # fmt: skip


def largest_fitting(measure: Callable[[int], tuple[int, float]], budget: int, lo: int, step: int, log) -> int:
    """The largest multiple of ``step`` whose footprint fits ``budget`` (``lo`` must fit), by doubling then
    bisection."""
    fits = {}

    def ok(b: int) -> bool:
        if b not in fits:
            used, seconds = measure(b)
            fits[b] = used <= budget
            log(b, used, seconds, fits[b])
        return fits[b]

    if not ok(lo):
        raise SystemExit(f"B = {lo} does not fit the budget: lower --start")
    hi = lo * 2
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="sparse,multi_vector")
    parser.add_argument("--sparse-budget", default="2GiB")
    parser.add_argument("--multi-vector-budget", default="1GiB")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument(
        "--tries", type=int, default=2, help="batches tried for ours: factor x theirs, doubled"
    )
    parser.add_argument("--max-ours", type=int, default=16384, help="the largest batch to try for ours")
    parser.add_argument("--step", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for kind in args.kinds.split(","):
        budget_text = args.sparse_budget if kind == "sparse" else args.multi_vector_budget
        budget = memory_bytes(budget_text, "budget")
        assert budget is not None
        contenders = sparse_contenders(30522, 200) if kind == "sparse" else multi_vector_contenders()

        theirs = largest_fitting(
            contenders["theirs"],
            budget,
            args.step,
            args.step,
            functools.partial(record, rows, kind, budget_text, "theirs"),
        )
        b = theirs * args.factor
        ours = 0
        for _ in range(args.tries):
            if b > args.max_ours:
                break
            used, seconds = contenders["ours"](b)
            record(rows, kind, budget_text, "ours", b, used, seconds, used <= budget)
            if used > budget:
                break
            ours, b = b, b * 2
        print(f"{kind}: theirs {theirs}, ours >= {ours} ({ours / theirs:.1f}x) in {budget_text}", flush=True)
        rows.append({"kind": kind, "budget": budget_text, "contender": "largest", "B": f"{theirs} / >= {ours}",
                     "footprint_MiB": "", "seconds": "", "fits": ""})  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "largest_batch.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# The largest batch each loss stage fits in a fixed budget (footprint: cached embeddings + the call's peak)",
        "",
        "| kind | budget | contender | B | footprint MiB | seconds | fits |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r['kind']} | {r['budget']} | {r['contender']} | {r['B']} | {r['footprint_MiB']} | {r['seconds']} | "
            f"{r['fits']} |"
            for r in rows
        ],
    ]
    (out / "largest_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
