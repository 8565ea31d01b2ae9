"""Drivers of the general InfoNCE (:mod:`.terms`): on one process or against gathered columns
(:func:`terms_solve`), and by ring exchange (:func:`ring_terms_solve`). Both return
``(loss, grad_anchors, grad_candidates, grad_anchors_all, grad_scale)``, the gradients of
``grad_output * loss`` in the inputs' dtypes, without building a graph.

Planning: the chunked path holds, for a chunk of rows, the logits of every term against every column
at once (one pass: loss and gradients, nothing recomputed); the tiled path makes a statistics pass and
a gradient pass over square tiles, ``O((B + N) d)`` memory plus a few tiles.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.distributed import all_gather_rows, all_reduce_sum, rank, ring_exchange
from st_cached_losses.functional._kernels import LogSumExp, Operand, init_stats, positive_logits
from st_cached_losses.functional.checks import scale_value
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.problems import plan_blocks, raw_grad, tile_side
from st_cached_losses.functional.terms import (
    Bound,
    TermSet,
    fused_chunk,
    guide_thresholds,
    term_grads,
    term_stats,
)

__all__ = [
    "GeneralFunction",
    "Guide",
    "Solution",
    "check_general",
    "gathered_guide",
    "reads_anchors_all",
    "ring_terms_solve",
    "terms_solve",
]

Solution = tuple[Tensor, Tensor | None, list[Tensor], Tensor | None, Tensor | None]


@dataclass
class Guide:
    """A guide model's embeddings of the same batch (GIST): ``anchors`` ``(B, g)`` of this process,
    ``candidates`` one ``(N, g)`` per column, laid out like the loss's candidates (gathered)."""

    anchors: Tensor
    candidates: list[Tensor]


class _Sources:
    """Operands and fp32 gradient buffers of one call: the rows ``q`` (anchors) and ``d`` (this
    process's positives), and the column sources ``c<k>``, ``q_all`` and ``q_local``; ``used`` names the
    sources the terms read (the others are neither normalised nor given a buffer; ``q`` and the
    candidate columns always are)."""

    def __init__(
        self,
        anchors: Tensor,
        cols: list[Tensor],
        anchors_all: Tensor | None,
        *,
        scale: float,
        cosine: bool,
        row_offset: int,
        prenorm: bool,
        with_grad: bool,
        used: set[str] | None = None,
    ) -> None:
        b = anchors.shape[0]
        need = {"q", "d", "q_local", "q_all"} if used is None else used
        self.b, self.row_offset = b, row_offset
        self.q = Operand(anchors, cosine, scale, prenorm)
        self.d = (
            Operand(cols[0][row_offset : row_offset + b], cosine, scale, prenorm) if "d" in need else None
        )
        self.cols = {f"c{k}": Operand(c, cosine, 1.0, prenorm) for k, c in enumerate(cols)}
        if "q_local" in need or ("q_all" in need and anchors_all is None):
            self.cols["q_local"] = Operand(anchors, cosine, 1.0, prenorm)
        if "q_all" in need:
            self.cols["q_all"] = (
                Operand(anchors_all, cosine, 1.0, prenorm)
                if anchors_all is not None
                else self.cols["q_local"]
            )
        self.grads: dict[str, Tensor] = {}
        if with_grad:
            dt, dev, dim = self.q.dtype, anchors.device, anchors.shape[1]
            for name in ("q", "d", *self.cols):
                if name == "d" and self.d is None:
                    continue
                n = b if name in ("q", "d", "q_local") else self.cols[name].n
                self.grads[name] = torch.zeros(n, dim, dtype=dt, device=dev)
            if anchors_all is None and "q_all" in self.cols:
                self.grads["q_all"] = self.grads["q_local"]  # one process: the same rows, one buffer

    def with_columns(self, cols: dict[str, Operand], grads: dict[str, Tensor]) -> _Sources:
        """The same rows against other columns (a block visiting in the ring), with these gradient buffers."""
        other = copy.copy(self)
        other.cols, other.grads = cols, grads
        return other


def _thresholds(gsrc: _Sources | None, terms: TermSet, tile: int) -> Tensor | None:
    if gsrc is None:
        return None
    assert gsrc.d is not None  # guide sources have every row source
    return guide_thresholds(gsrc.q, gsrc.d, terms.margin_strategy or "absolute", terms.margin, tile)


def _used(terms: TermSet) -> set[str]:
    return {t.rows for t in terms.terms} | {t.cols for t in terms.terms}


def _bind(
    terms: TermSet, src: _Sources, diag_offset: int | None, guide: _Sources | None, thresholds: Tensor | None
) -> list[Bound]:
    out = []
    for t in terms.terms:
        diag = 0 if t.cols == "q_local" else diag_offset
        rows = src.q if t.rows == "q" else src.d
        assert rows is not None  # built for every row source a term reads
        out.append(
            Bound(
                t,
                rows,
                src.cols[t.cols],
                diag,
                src.grads.get(t.rows),
                src.grads.get(t.cols),
                (guide.q if t.rows == "q" else guide.d) if guide is not None and t.guided else None,
                guide.cols[t.cols] if guide is not None and t.guided else None,
                thresholds,
            )
        )
    return out


def reads_anchors_all(terms: TermSet | None) -> bool:
    """Whether a term scores against every process's anchors (they must be gathered)."""
    return terms is not None and terms.uses_anchors_all


def gathered_guide(guide: Guide | None, sizes: list[int]) -> Guide | None:
    """The guide's candidates from every process (its anchors stay: rows are this process's)."""
    if guide is None:
        return None
    return Guide(guide.anchors, [all_gather_rows(c, sizes) for c in guide.candidates])


def _guide_sources(guide: Guide | None, row_offset: int, prenorm: bool) -> _Sources | None:
    if guide is None:
        return None
    return _Sources(
        guide.anchors,
        guide.candidates,
        None,
        scale=1.0,
        cosine=True,
        row_offset=row_offset,
        prenorm=prenorm,
        with_grad=False,
    )


def _finish(
    src: _Sources,
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    s: float,
    factor: float,
    tile: int,
) -> tuple[Tensor, list[Tensor], Tensor | None]:
    """Map the buffers onto the caller's tensors: ``d`` is a slice of column 0, ``q_local`` (and on one
    process ``q_all``) the anchors; rows carry the scale, columns do not."""
    g = src.grads
    g["q"].mul_(s)
    if "q_local" in g:  # on one process also q_all's (the same buffer)
        g["q"].add_(g["q_local"])
    if "d" in g:
        g["c0"][src.row_offset : src.row_offset + src.b].add_(g["d"].mul_(s))
    g_all = None
    if anchors_all is not None and "q_all" in g:
        g_all = raw_grad(src.cols["q_all"], g["q_all"].mul_(factor), anchors_all.dtype, tile)
    g_a = raw_grad(src.q, g["q"].mul_(factor), anchors.dtype, tile)
    g_c = [raw_grad(src.cols[f"c{k}"], g[f"c{k}"].mul_(factor), c.dtype, tile) for k, c in enumerate(cols)]
    return g_a, g_c, g_all


def terms_solve(
    anchors: Tensor,
    cols: Sequence[Tensor],
    *,
    terms: TermSet,
    scale: float | Tensor,
    cosine: bool,
    anchors_all: Tensor | None,
    row_offset: int,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    grad_output: float,
    with_grad: bool,
    guide: Guide | None = None,
) -> Solution:
    """The mean loss of this process's rows against the given (possibly gathered) columns."""
    cols = list(cols)
    s = scale_value(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    b = anchors.shape[0]
    width = sum(cols[0].shape[0] if t.cols != "q_local" else b for t in terms.terms)
    fused = with_grad or path != "tiled"
    buffers = (1 + need_scale_grad + terms.guided) if fused else 3 + terms.guided
    plan = plan_blocks(
        b,
        width,
        1,
        path=path,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        buffers=buffers,
    )
    prenorm = plan.path == "chunked"
    src = _Sources(
        anchors,
        cols,
        anchors_all,
        scale=s,
        cosine=cosine,
        row_offset=row_offset,
        prenorm=prenorm,
        with_grad=with_grad,
        used=_used(terms),
    )
    gsrc = _guide_sources(guide, row_offset, prenorm)
    tile = plan.row_tile
    thr = _thresholds(gsrc, terms, tile)
    bound = _bind(terms, src, row_offset, gsrc, thr)
    if plan.path == "chunked":
        total, gs = fused_chunk(
            bound,
            terms.weights,
            n_rows=b,
            scale=s,
            chunk=plan.row_tile,
            need_grads=with_grad,
            need_scale_grad=need_scale_grad,
        )
    else:
        m, ssum = init_stats(len(terms.weights) * b, src.q)
        m, ssum = m.view(-1, b), ssum.view(-1, b)
        term_stats(bound, m, ssum, scale=s, row_tile=plan.row_tile, col_tile=plan.col_tile)
        lse = [LogSumExp(m[g], ssum[g].log()) for g in range(len(terms.weights))]
        total = sum(w * x.total().sum() for w, x in zip(terms.weights, lse))  # type: ignore[assignment]
        if with_grad:
            gs = term_grads(
                bound,
                lse,
                terms.weights,
                scale=s,
                row_tile=plan.row_tile,
                col_tile=plan.col_tile,
                need_scale_grad=need_scale_grad,
            )
    pos = positive_logits(src.q, src.cols["c0"], row_offset, tile)
    loss = (total - pos.double().sum()) / b
    if not with_grad:
        return loss.to(src.q.dtype), None, [], None, None
    factor = float(grad_output) / b
    g_a, g_c, g_all = _finish(src, anchors, cols, anchors_all, s, factor, tile)
    g_s = (gs * factor / s).to(scale.dtype) if need_scale_grad else None  # type: ignore[union-attr]
    return loss.to(src.q.dtype), g_a, g_c, g_all, g_s


def ring_terms_solve(
    anchors: Tensor,
    cols: Sequence[Tensor],
    sizes: list[int],
    *,
    terms: TermSet,
    scale: float | Tensor,
    cosine: bool,
    tile_size: int | None,
    memory_budget: int,
    with_grad: bool,
    guide: Guide | None = None,
) -> Solution:
    """This process's share of the global loss (``W / B_global * sum`` over its rows) by ring exchange:
    every process's columns (its candidates, and its anchors when a term reads ``q_all``; its guide
    embeddings when guided) visit every process once per pass; a visiting block's gradient travels
    with it and is home after the circle. Row statistics never leave their process."""
    me, w = rank(), len(sizes)
    cols = list(cols)
    s = scale_value(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    b, dim = anchors.shape
    k = len(cols)
    tile = tile_side(tile_size, memory_budget, buffers=3 + terms.guided)
    src = _Sources(
        anchors,
        cols,
        None,
        scale=s,
        cosine=cosine,
        row_offset=0,
        prenorm=False,
        with_grad=with_grad,
        used=_used(terms),
    )
    gsrc = _guide_sources(
        Guide(guide.anchors, guide.candidates) if guide is not None else None, 0, prenorm=False
    )
    thr = _thresholds(gsrc, terms, tile)
    names = [f"c{j}" for j in range(k)] + (["q_all"] if terms.uses_anchors_all else [])
    own = [torch.stack([*cols, anchors][: len(names)], dim=1).contiguous()]  # (b, K', d)
    if guide is not None:
        own.append(torch.stack(guide.candidates, dim=1).contiguous())
    local_terms = TermSet(tuple(t for t in terms.terms if t.cols == "q_local"), terms.weights)
    visiting_terms = TermSet(tuple(t for t in terms.terms if t.cols != "q_local"), terms.weights)

    def bind(owner: int, tensors: list[Tensor], g_block: Tensor | None) -> list[Bound]:
        """The terms against a visiting block (and, for this process's own block, the local terms)."""
        blk = tensors[0]
        grads = {}
        if g_block is not None:  # this process's rows keep theirs; the block's travel with it
            grads = {r: g for r, g in src.grads.items() if r in ("q", "d")}
            grads.update({n: g_block[:, j] for j, n in enumerate(names)})
        visit = src.with_columns(
            {n: Operand(blk[:, j], cosine, 1.0, prenormalize=False) for j, n in enumerate(names)}, grads
        )
        gvisit = None
        if gsrc is not None:
            gvisit = gsrc.with_columns(
                {f"c{j}": Operand(tensors[1][:, j], True, 1.0, False) for j in range(k)}, {}
            )
        bound = _bind(visiting_terms, visit, 0 if owner == me else None, gvisit, thr)
        if owner == me and local_terms.terms:
            bound += _bind(local_terms, src, 0, gsrc, thr)
        return bound

    m, ssum = init_stats(len(terms.weights) * b, src.q)
    m, ssum = m.view(-1, b), ssum.view(-1, b)

    def visit_stats(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        term_stats(bind(owner, tensors, None), m, ssum, scale=s, row_tile=tile, col_tile=tile)

    ring_exchange(own, [], sizes, visit_stats)
    lse = [LogSumExp(m[g], ssum[g].log()) for g in range(len(terms.weights))]
    total = sum(wt * x.total().sum() for wt, x in zip(terms.weights, lse))
    factor = w / sum(sizes)
    pos = positive_logits(src.q, src.cols["c0"], 0, tile)
    loss = ((total - pos.double().sum()) * factor).to(src.q.dtype)
    if not with_grad:
        return loss, None, [], None, None
    gs_total = torch.zeros((), dtype=torch.float64, device=anchors.device)

    def visit_grads(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        nonlocal gs_total
        bound = bind(owner, tensors, carried[0])
        gs_total += term_grads(
            bound, lse, terms.weights, scale=s, row_tile=tile, col_tile=tile, need_scale_grad=need_scale_grad
        )

    g_block = torch.zeros(b, len(names), dim, dtype=src.q.dtype, device=anchors.device)
    (g_block,) = ring_exchange(own, [g_block], sizes, visit_grads)
    for j, n in enumerate(names):
        src.grads[n if n != "q_all" else "q_local"].add_(g_block[:, j])
    g_a, g_c, _ = _finish(src, anchors, cols, None, s, factor, tile)
    g_s = None
    if need_scale_grad:
        # every process holds part of d(sum_r L_r)/ds = W dL/ds; the average is the true gradient
        gs = all_reduce_sum((gs_total * factor).reshape(1), "all_reduce_scale")[0] / w
        g_s = (gs / s).to(scale.dtype)  # type: ignore[union-attr]
    return loss, g_a, g_c, None, g_s


# --------------------------------------------------------------------------- checks and autograd


def check_general(
    terms: TermSet,
    guide: Guide | None,
    symmetric: bool,
    anchor_keys: Tensor | None,
    candidate_keys: Sequence[Tensor] | None,
    anchors: Tensor,
    cols: list[Tensor],
) -> None:
    if symmetric:
        raise ValueError("pass either terms or symmetric=True, not both: terms say every direction.")
    if anchor_keys is not None or candidate_keys is not None:
        raise ValueError(
            "duplicate keys (mask_duplicates) only work with the one-directional and the symmetric loss, not "
            "with terms (other directions, hardness or a guide)."
        )
    if terms.guided != (guide is not None):
        raise ValueError(
            "guided terms (GIST) need guide=Guide(...) embeddings, and a guide needs guided terms."
        )
    if guide is not None:
        b = anchors.shape[0]
        if guide.anchors.shape[0] != b or [c.shape[0] for c in guide.candidates] != [
            c.shape[0] for c in cols
        ]:
            raise ValueError(
                f"the guide's embeddings must have the loss's rows: anchors {b}, columns {[c.shape[0] for c in cols]}; "
                f"got {guide.anchors.shape[0]} and {[c.shape[0] for c in guide.candidates]}."
            )


class GeneralFunction(torch.autograd.Function):
    """Autograd for the general loss: forward computes the loss and, when an input needs one, its
    gradients in the same pass (the fused path), and keeps them (``O((B + N) d)``, the inputs' size)
    until backward, which scales them by the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any, solve: Any, scale: Tensor, anchors: Tensor, anchors_all: Tensor | None, *cols: Tensor
    ) -> Tensor:
        with_grad = any(ctx.needs_input_grad[1:])
        loss, g_a, g_c, g_all, g_s = solve(
            anchors.detach(),
            [c.detach() for c in cols],
            scale=scale if ctx.needs_input_grad[1] else float(scale),
            anchors_all=anchors_all.detach() if anchors_all is not None else None,
            grad_output=1.0,
            with_grad=with_grad,
        )
        if with_grad:
            ctx.grads = (g_s, g_a, g_all, *g_c)
        return loss

    @staticmethod
    @fp32_loss_stage
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grads = [g * grad_loss.to(g.dtype) if g is not None else None for g in ctx.grads]
        del ctx.grads
        return (None, *grads)
