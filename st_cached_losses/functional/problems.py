"""How one InfoNCE call decomposes into one-directional problems (rows against candidate columns, with
their block sizes), and how each is solved with the kernels: statistics, loss, gradients, and the
gradients mapped back onto the caller's tensors. Used by ``infonce`` (both entry points)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from st_cached_losses.functional._kernels import (
    DuplicateKeys,
    Grads,
    LogSumExp,
    Operand,
    Stats,
    fused_one_direction,
    gradients,
    positive_logits,
    row_col_stats,
    spans,
)

#: Largest tile side the tiled path picks on its own.
MAX_TILE = 2048
#: The chunked path is chosen by ``path="auto"`` when the budget allows chunks of at least this many rows.
MIN_AUTO_CHUNK = 64

__all__ = [
    "MAX_TILE",
    "MIN_AUTO_CHUNK",
    "Plan",
    "Problem",
    "assemble",
    "build_problems",
    "infonce_from_stats",
    "loss_from_stats",
    "plan_blocks",
    "problem_grads",
    "raw_grad",
    "solve",
    "tile_side",
]


@dataclass(frozen=True)
class Plan:
    path: Literal["chunked", "tiled"]
    row_tile: int
    col_tile: int


@dataclass
class Problem:
    """One directional sub-problem: ``rows`` against ``cols``; positives at ``cols[0][row_offset + i]``."""

    rows: Operand
    cols: list[Operand]
    row_offset: int
    w_rows: float
    w_cols: float  # > 0: also the direction "positive of column 0 -> every row" (shared tiles)
    plan: Plan
    keys: DuplicateKeys | None = None


# --------------------------------------------------------------------------- planning


def plan_blocks(
    n_rows: int,
    n_cols: int,
    k: int,
    *,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    buffers: int,
) -> Plan:
    """Pick the path and block sizes: ``buffers`` fp32 blocks of ``rows x candidates-in-block`` live at once."""
    row_bytes = 4 * buffers * k * n_cols
    if path == "auto":
        if chunk_size is not None:
            path = "chunked"
        elif tile_size is not None:
            path = "tiled"
        else:
            path = "chunked" if memory_budget // row_bytes >= min(n_rows, MIN_AUTO_CHUNK) else "tiled"
    if path == "chunked":
        chunk = chunk_size if chunk_size is not None else max(1, memory_budget // row_bytes)
        return Plan("chunked", min(chunk, n_rows), n_cols)
    tile = tile_side(tile_size, memory_budget, buffers)
    return Plan("tiled", min(tile, n_rows), min(tile, n_cols))


def tile_side(tile_size: int | None, memory_budget: int, buffers: int) -> int:
    """The side of a square tile: ``tile_size`` if given, else the largest (up to ``MAX_TILE``) for which
    ``buffers`` fp32 tiles fit in ``memory_budget`` bytes."""
    if tile_size is not None:
        return tile_size
    return min(MAX_TILE, max(1, math.isqrt(memory_budget // (4 * buffers))))


# --------------------------------------------------------------------------- assembly


def build_problems(
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    *,
    scale: float,
    cosine: bool,
    symmetric: bool,
    row_offset: int,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    fused: bool,
    need_scale_grad: bool,
    anchor_keys: Tensor | None = None,
    candidate_keys: list[Tensor] | None = None,
    anchors_all_keys: Tensor | None = None,
) -> list[Problem]:
    b, n, k = anchors.shape[0], cols[0].shape[0], len(cols)
    # blocks alive at once: the fused one-directional pass keeps one (plus a copy for the scale's
    # gradient); the two-pass path keeps the logits, the gradient block and a scratch block.
    one_pass = fused and not (symmetric and anchors_all is None)
    buffers = (2 if need_scale_grad else 1) if one_pass else 3
    sizing = functools.partial(
        plan_blocks,
        path=path,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        buffers=buffers,
    )
    plan = sizing(b, n, k)
    prenorm = plan.path == "chunked"
    rows = Operand(anchors, cosine, scale, prenorm)
    col_ops = [Operand(c, cosine, 1.0, prenorm) for c in cols]
    keys = back_keys = None
    if candidate_keys is not None:
        # pairs sharing an anchor or a positive are duplicates in both directions (see DuplicateKeys)
        all_anchor_keys = anchors_all_keys if anchors_all_keys is not None else anchor_keys
        row_pos = candidate_keys[0][row_offset : row_offset + b]
        keys = DuplicateKeys(row_pos, candidate_keys, anchor_keys, all_anchor_keys)
        if all_anchor_keys is not None and anchor_keys is not None:
            # positives -> anchors: the rows are this rank's positives, their targets the anchors
            back_keys = DuplicateKeys(anchor_keys, [all_anchor_keys], row_pos, candidate_keys[0])
    if not symmetric:
        return [Problem(rows, col_ops, row_offset, 1.0 / b, 0.0, plan, keys)]
    if anchors_all is None:  # one process: both directions share every logit tile
        return [Problem(rows, col_ops, 0, 0.5 / b, 0.5 / n, plan, keys)]
    # across ranks: this rank's positives against every rank's anchors is a second one-way problem
    pos_rows = Operand(cols[0][row_offset : row_offset + b], cosine, scale, prenorm)
    plan2 = sizing(b, n, 1)
    back = Problem(
        pos_rows, [Operand(anchors_all, cosine, 1.0, prenorm)], row_offset, 0.5 / b, 0.0, plan2, back_keys
    )
    return [Problem(rows, col_ops, row_offset, 0.5 / b, 0.0, plan, keys), back]


def loss_from_stats(p: Problem, stats: Stats, pos: Tensor) -> Tensor:
    return infonce_from_stats(stats.lse_rows, stats.lse_cols, pos, p.w_rows, p.w_cols)


def solve(
    p: Problem, scale: float, need_grads: bool, need_scale_grad: bool
) -> tuple[Tensor, Grads | None, Stats | None, Tensor]:
    """Loss (fp64) and, if asked, gradients of one problem; also what backward would need."""
    pos = positive_logits(p.rows, p.cols[0], p.row_offset, p.plan.row_tile)
    if need_grads and p.plan.path == "chunked" and p.w_cols == 0.0:
        loss, grads = fused_one_direction(
            p.rows,
            p.cols,
            pos,
            scale=scale,
            weight=p.w_rows,
            row_offset=p.row_offset,
            chunk=p.plan.row_tile,
            need_scale_grad=need_scale_grad,
            keys=p.keys,
        )
        return loss, grads, None, pos
    stats = row_col_stats(
        p.rows,
        p.cols,
        column_direction=p.w_cols > 0,
        row_tile=p.plan.row_tile,
        col_tile=p.plan.col_tile,
        row_offset=p.row_offset,
        keys=p.keys,
    )
    two_pass = problem_grads(p, stats, pos, scale, 1.0, need_scale_grad) if need_grads else None
    return loss_from_stats(p, stats, pos), two_pass, stats, pos


def problem_grads(
    p: Problem, stats: Stats, pos: Tensor, scale: float, grad_output: float, need_scale_grad: bool
) -> Grads:
    return gradients(
        p.rows,
        p.cols,
        stats,
        pos,
        scale=scale,
        w_rows=p.w_rows * grad_output,
        w_cols=p.w_cols * grad_output,
        row_offset=p.row_offset,
        row_tile=p.plan.row_tile,
        col_tile=p.plan.col_tile,
        need_scale_grad=need_scale_grad,
        keys=p.keys,
    )


def assemble(
    problems: list[Problem],
    grads: list[Grads],
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    grad_output: float,
) -> tuple[Tensor, list[Tensor], Tensor | None, Tensor]:
    """Map each problem's gradients back onto the caller's tensors (raw, in their dtypes)."""
    main, g_main = problems[0], grads[0]
    tile = main.plan.row_tile
    g_cols = g_main.cols
    scale_grad = g_main.scale * grad_output
    g_all = None
    if len(problems) == 2:
        back, g_back = problems[1], grads[1]
        # the back problem's rows are this rank's slice of the positives (same normalisation)
        g_cols[0][back.row_offset : back.row_offset + back.rows.n].add_(g_back.rows)
        g_all = raw_grad(back.cols[0], g_back.cols[0].mul_(grad_output), anchors_all.dtype, tile)  # type: ignore[union-attr]
        scale_grad = scale_grad + g_back.scale * grad_output
    g_anchors = raw_grad(main.rows, g_main.rows.mul_(grad_output), anchors.dtype, tile)
    g_candidates = [
        raw_grad(op, g.mul_(grad_output), c.dtype, tile) for op, g, c in zip(main.cols, g_cols, cols)
    ]
    return g_anchors, g_candidates, g_all, scale_grad


def raw_grad(op: Operand, g: Tensor, out_dtype: torch.dtype, tile: int) -> Tensor:
    """Gradient wrt the raw embedding from the one wrt its normalised version, in place:
    ``dL/dx = (g - x_hat <g, x_hat>) / ||x||``."""
    if op.inv_norm is not None:
        for r0, r1 in spans(op.n, tile):
            inv = op.inv_norm[r0:r1, None]
            x_hat = op.x[r0:r1].to(op.dtype) * inv  # (b, d)
            gr = g[r0:r1]
            gr.sub_(x_hat * (gr * x_hat).sum(1, keepdim=True)).mul_(inv)
    return g.to(out_dtype)


def infonce_from_stats(
    lse_rows: LogSumExp, lse_cols: LogSumExp | None, pos: Tensor, w_rows: float, w_cols: float
) -> Tensor:
    """The (weighted, summed) InfoNCE of finished statistics: each row's log-sum-exp minus its positive
    logit, and for the symmetric loss each positive's column log-sum-exp minus the same logit. fp64."""
    loss = w_rows * (lse_rows.total().sum() - pos.double().sum())
    if lse_cols is not None:
        loss = loss + w_cols * (lse_cols.total().sum() - pos.double().sum())
    return loss
