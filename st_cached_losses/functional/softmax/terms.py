"""The general InfoNCE: any set of logit *terms* per row, partitioned into softmaxes, with hardness
penalties and guide-model masks. It covers sentence-transformers' ``MultipleNegativesRankingLoss``
options (``directions``, ``partition_mode``, ``hardness_mode``) and ``GISTEmbedLoss``.

Row ``i`` of this process owns two local vectors: its query ``q_i`` (the anchor) and its document
``d_i`` (its positive, ``candidates[0][row_offset + i]``). A [`Term`][st_cached_losses.functional.softmax.terms.Term] scores one of them against
one source of columns: the gathered candidate columns ``c0 .. c{K-1}``, the gathered anchors
``q_all``, or this process's anchors ``q_local``. Entry ``(i, offset + i)`` of a term is row ``i``'s
*diagonal* (its own document, its own query): the positive, removed, or kept. The loss of row ``i`` is

    ``sum_g w_g * (logsumexp(logits of the terms in group g) - positive logit of group g)``

with one group (joint partition: the positive is ``s <q_i, d_i>``) or one per direction (per-direction
partition, ``w_g = 1 / #groups``; ``doc_to_query``'s positive is ``s <d_i, q_i>``). Its gradient wrt a
logit of group ``g`` is ``w_g * (P_g - Y_g)``.

A hardness penalty adds ``alpha * stop_grad(sim)`` to chosen logits (not temperature-scaled: the logit
``s * sim`` becomes ``(s + alpha) * sim`` in value, while its gradient stays that of ``s * sim``). A
guide mask removes entries whose guide similarity exceeds the row's guide-rated positive similarity
minus a margin (never the positive itself); guide tiles are computed next to logit tiles, never a
``B x C`` matrix.

A false-negative filter ([`FalseNegatives`][st_cached_losses.functional.softmax.terms.FalseNegatives]) is GIST's rule with the
loss's own similarities as the judge: an entry whose logit exceeds the row's threshold (from the row's own
positive logit, [`positive_thresholds`][st_cached_losses.functional.softmax.terms.positive_thresholds]) is removed,
in every term and every column source, never the positive itself; no second matrix is computed, the logit
tile is its own judge.

Duplicate keys (``mask_duplicates``) are a mask on every term: entry ``(i, j)`` is removed when the
column entry belongs to a pair that shares row ``i``'s anchor or positive, or (a hard-negative column)
its text is row ``i``'s positive; a row's own entry never is. The symmetric loss's two directions share
their tiles where the columns of one are the rows of the other (one process, and the ring): a bound
term then also feeds a softmax that runs down its columns.

Kernels here work on bound terms (operands and gradient buffers attached, [`binding`][st_cached_losses.functional.softmax.binding]) one tile at
a time; the drivers bind them on one process or against gathered columns ([`local`][st_cached_losses.functional.softmax.local]), or for each
block visiting in a ring ([`ring`][st_cached_losses.functional.softmax.ring])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from st_cached_losses.functional.kernels.tiles import (
    LogSumExp,
    Operand,
    diagonal_entries,
    exp_flushed_,
    online_lse_update,
    spans,
)
from st_cached_losses.functional.score import Score, TileGraph

__all__ = [
    "TIE_TOLERANCE",
    "Bound",
    "FalseNegatives",
    "PairKeys",
    "Term",
    "TermSet",
    "bank_terms",
    "fused_chunk",
    "gist_terms",
    "guide_thresholds",
    "mnrl_terms",
    "positive_thresholds",
    "term_grads",
    "term_stats",
]

Diagonal = Literal["positive", "exclude", "keep"]


@dataclass(frozen=True)
class Term:
    """One block of logits of every row: ``rows`` ("q" queries or "d" documents of this process)
    against the column source ``cols`` ("c<k>", "q_all" or "q_local")."""

    rows: Literal["q", "d"]
    cols: str
    group: int
    diag: Diagonal
    pen_off: float = 0.0  # hardness penalty on entries off the diagonal
    pen_diag: float = 0.0  # ... on the diagonal entry
    guided: bool = False  # the guide mask applies


@dataclass(frozen=True)
class TermSet:
    """A loss: its terms, each group's weight, and the guide margin (GIST) when guided. ``in_batch=False``:
    each row is scored against its own entries of the candidate columns only (no in-batch negatives), a loss
    of ``B x K`` logits computed by [`own`][st_cached_losses.functional.softmax.own], not by the tile drivers."""

    terms: tuple[Term, ...]
    weights: tuple[float, ...]
    margin_strategy: str | None = None
    margin: float = 0.0
    in_batch: bool = True

    @property
    def uses_anchors_all(self) -> bool:
        return any(t.cols == "q_all" for t in self.terms)

    @property
    def guided(self) -> bool:
        return any(t.guided for t in self.terms)


def mnrl_terms(
    directions: Sequence[str],
    partition_mode: str,
    hardness_mode: str | None,
    hardness_strength: float,
    n_columns: int,
    in_batch_negatives: bool = True,
) -> TermSet:
    """sentence-transformers' ``MultipleNegativesRankingLoss``: ``query_to_doc`` (every column, the
    positive in column 0), ``query_to_query`` (without ``q_i -> q_i``), ``doc_to_query``, ``doc_to_doc``
    (without every document of row ``i``'s own query); the hardness penalty on ``query_to_doc``:
    ``in_batch_negatives`` everywhere but row ``i``'s own documents, ``hard_negatives`` only on its own
    hard negatives, ``all_negatives`` everywhere but its positive. Without ``in_batch_negatives``, the
    ``query_to_doc`` terms of each row's own entries only (the other directions hold no own negative)."""
    alpha = float(hardness_strength) if hardness_mode is not None else 0.0
    order = [d for d in ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc") if d in directions]
    group = {d: (0 if partition_mode == "joint" else i) for i, d in enumerate(order)}
    terms: list[Term] = []
    for k in range(n_columns):
        off = alpha if hardness_mode in ("in_batch_negatives", "all_negatives") else 0.0
        on = alpha if k > 0 and hardness_mode in ("hard_negatives", "all_negatives") else 0.0
        terms.append(Term("q", f"c{k}", group["query_to_doc"], "positive" if k == 0 else "keep", off, on))
    if "query_to_query" in group:
        terms.append(Term("q", "q_all", group["query_to_query"], "exclude"))
    if "doc_to_query" in group:
        # per direction, its own cross-entropy: its positive is the row's own anchor
        back_diag: Diagonal = "keep" if partition_mode == "joint" else "positive"
        terms.append(Term("d", "q_all", group["doc_to_query"], back_diag))
    if "doc_to_doc" in group:
        terms += [Term("d", f"c{k}", group["doc_to_doc"], "exclude") for k in range(n_columns)]
    n_groups = 1 if partition_mode == "joint" else len(order)
    if not in_batch_negatives:
        return TermSet(
            tuple(t for t in terms if t.rows == "q" and t.cols.startswith("c")), (1.0,), in_batch=False
        )
    return TermSet(tuple(terms), (1.0 / n_groups,) * n_groups)


def gist_terms(
    contrast_anchors: bool, contrast_positives: bool, n_columns: int, margin_strategy: str, margin: float,
    in_batch_negatives: bool = True,
) -> TermSet:  # fmt: skip
    """sentence-transformers' ``GISTEmbedLoss``: one softmax over anchor-positive (gathered), anchor-anchor
    (this process's anchors only), positive-positive (this process's positives against the gathered
    ones) and anchor-negative blocks, every entry rated above the positive by the guide removed. A row is
    never its own negative: its entry of the anchor-anchor and positive-positive blocks is removed whatever
    the guide says (sentence-transformers 6.3's fix; 6.2 kept it unless the guide's mask removed it). Without
    ``in_batch_negatives``: each anchor against its own positive and its own hard negatives, those the guide
    rates above the positive removed (the anchor-anchor and positive-positive blocks contrast other rows)."""
    if not in_batch_negatives:
        own = [Term("q", f"c{k}", 0, "positive" if k == 0 else "keep", guided=True) for k in range(n_columns)]
        return TermSet(tuple(own), (1.0,), margin_strategy, float(margin), in_batch=False)
    terms = [Term("q", "c0", 0, "positive", guided=True)]
    if contrast_anchors:
        terms.append(Term("q", "q_local", 0, "exclude", guided=True))
    if contrast_positives:
        terms.append(Term("d", "c0", 0, "exclude", guided=True))
    terms += [Term("q", f"c{k}", 0, "keep", guided=True) for k in range(1, n_columns)]
    return TermSet(tuple(terms), (1.0,), margin_strategy, float(margin))


def bank_terms(terms: TermSet, candidates: bool, anchors: bool) -> TermSet:
    """``terms`` with a negative bank's columns ([`Bank`][st_cached_losses.functional.softmax.options.Bank]) scored
    as extra negatives: each group that scores rows against the candidate columns (``c<k>``) also scores them
    against the bank's candidates (``bank_c``), and each group that scores them against the anchors
    (``q_all`` / ``q_local``) also against the bank's anchors (``bank_q``). A bank entry is never a row's
    positive nor its own entry (no diagonal); it takes the off-diagonal hardness penalty of the term it
    extends. Nothing is added where the bank has none of those entries (``candidates`` / ``anchors``
    False), so an empty bank leaves the loss as it is."""
    if not terms.in_batch:
        raise ValueError(
            "a negative bank adds other steps' rows as negatives: it has no place in a loss without in-batch "
            "negatives (in_batch_negatives=False). Use one or the other."
        )
    extra: list[Term] = []
    seen: set[tuple[str, str, int]] = set()
    for t in terms.terms:
        if t.guided:
            raise ValueError(
                "a negative bank cannot extend guided terms (GIST): the guide's embeddings of the banked rows "
                "are not kept. Use a negative bank with CachedMNRLoss, CachedCLIPLoss or CachedTiledLoss."
            )
        source = "bank_c" if t.cols.startswith("c") else "bank_q"
        if not (candidates if source == "bank_c" else anchors):
            continue
        key = (t.rows, source, t.group)
        if key not in seen:
            seen.add(key)
            extra.append(Term(t.rows, source, t.group, "keep", t.pen_off))
    if not extra:
        return terms
    return replace(terms, terms=(*terms.terms, *extra))


#: Guide similarities within this of a row's threshold count as equal to it (so not above it): the
#: threshold and the tiles are summed in different orders, and a duplicate of the positive, which ties
#: the threshold exactly in GISTEmbedLoss (and stays), must not be removed by a rounding difference.
TIE_TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def positive_thresholds(positive: Tensor, strategy: str | None, margin: float) -> Tensor:
    """GISTEmbedLoss's rule, written once for every loss that filters false negatives: per row, the
    similarity above which (``>``) an entry is removed, from the row's positive similarity ``g`` ``(B,)``:
    ``g - margin`` (``"absolute"``, also None) or ``g - |g| * margin`` (``"relative"``), with ties within
    [`TIE_TOLERANCE`][st_cached_losses.functional.softmax.terms.TIE_TOLERANCE] counted as equal (not above)."""
    thr = positive - margin if strategy in (None, "absolute") else positive - positive.abs() * margin
    return thr + TIE_TOLERANCE[positive.dtype]


def guide_thresholds(guide_q: Operand, guide_d: Operand, strategy: str, margin: float, tile: int) -> Tensor:
    """Per row: entries the guide rates above this are removed
    ([`positive_thresholds`][st_cached_losses.functional.softmax.terms.positive_thresholds] of the guide-rated positive)."""
    g = torch.empty(guide_q.n, dtype=guide_q.dtype, device=guide_q.x.device)
    for r0, r1 in spans(guide_q.n, tile):
        g[r0:r1] = (guide_q.tile(r0, r1) * guide_d.tile(r0, r1)).sum(1)
    return positive_thresholds(g, strategy, margin)


@dataclass
class FalseNegatives:
    """A call's false-negative filter, bound: ``thresholds`` ``(B,)`` in logit units (``scale`` times
    [`positive_thresholds`][st_cached_losses.functional.softmax.terms.positive_thresholds] of each row's own positive
    similarity, GIST's margin form); an entry whose logit (before any hardness penalty) exceeds its row's is
    removed, except the row's positive. ``tally`` ``(2,)`` int64, if given, counts the statistics pass's
    removed entries and the negatives they were drawn from (every entry still in a softmax after the other
    masks, the positives excepted)."""

    thresholds: Tensor
    tally: Tensor | None = None


@dataclass
class PairKeys:
    """Duplicate keys of a source's entries (integer hashes of their inputs): ``pos`` the key of each
    entry's pair's positive (a hard-negative column: of the entry itself), ``anchor`` of its pair's anchor
    (None when unknown, and for hard-negative columns, whose entries belong to no pair)."""

    pos: Tensor
    anchor: Tensor | None = None
    pairs: bool = True  #: entry ``j`` is pair ``j`` (not a hard-negative column)


def duplicates(rows: PairKeys, r0: int, r1: int, cols: PairKeys, c0: int, c1: int) -> Tensor:
    """``(b, t)``: True where column entry ``j`` duplicates row ``i``'s pair (not a negative of row ``i``)."""
    mask = rows.pos[r0:r1, None] == cols.pos[None, c0:c1]
    if rows.anchor is not None and cols.anchor is not None:
        mask |= rows.anchor[r0:r1, None] == cols.anchor[None, c0:c1]
    return mask


@dataclass
class Bound:
    """A term with its operands (``rows`` carry the scale of a GEMM score) and the buffers its gradients
    go to.

    ``diag``: where row ``i``'s diagonal entry is in ``cols`` (``diag + i``), None when these columns do
    not hold it (another process's block in the ring). ``col_group``: the tile's columns are also rows
    of this group, whose softmax runs down the tile's columns (the symmetric loss's positives against the
    anchors): ``col_stats`` accumulates its running ``(m, s)`` in the first pass, ``col_lse`` and
    ``col_weight`` give its probabilities in the second."""

    term: Term
    score: Score
    rows: Operand
    cols: Operand
    diag: int | None
    g_rows: Tensor | None = None  # (B, d) wrt the normalised rows, before the final * scale
    g_cols: Tensor | None = None  # (n, d) wrt the normalised columns
    guide_rows: Operand | None = None
    guide_cols: Operand | None = None
    thresholds: Tensor | None = None  # (B,)
    row_keys: PairKeys | None = None
    col_keys: PairKeys | None = None
    col_group: int | None = None
    col_stats: tuple[Tensor, Tensor] | None = None
    col_lse: LogSumExp | None = None
    col_weight: float = 0.0
    col_positive: bool = False  # the column softmax has its positive on the diagonal too
    false_negatives: FalseNegatives | None = None


def _logits(
    b: Bound, q: Tensor, r0: int, r1: int, c0: int, c1: int, scale: float, keep_raw: bool, grads: bool = False,
    count: bool = False,
):  # fmt: skip
    """One tile's final logits (penalties added, removed entries at -inf), if asked the raw ``s * sim``
    (for the scale's gradient), the diagonal's entries, and with ``grads`` a function score's tile graph
    ([`logits_with_graph`][st_cached_losses.functional.score.Score.logits_with_graph]; None for GEMM scores).
    ``count``: add the false-negative filter's removals to its tally (the statistics pass)."""
    t = b.term
    graph = None
    if grads and not b.score.gemm:
        block, graph = b.score.logits_with_graph(
            q, b.cols.tile(c0, c1), scale, b.g_rows is not None, b.g_cols is not None
        )
    else:
        block = b.score.logits(q, b.cols.tile(c0, c1), scale)  # (rows, cols)
    raw = block.clone() if keep_raw else None
    ij = diagonal_entries(r0, r1, c0, c1, b.diag, block.device)
    filtered = None
    if b.false_negatives is not None:  # judged on the plain logits, before any hardness penalty
        with torch.no_grad():
            filtered = block > b.false_negatives.thresholds[r0:r1, None]
        if t.diag == "positive" and ij is not None:
            filtered[ij] = False
    if t.pen_off or t.pen_diag:
        on_diag = block[ij] if ij is not None and t.pen_diag != t.pen_off else None
        if t.pen_off:
            block.mul_(1.0 + t.pen_off / scale)
        if on_diag is not None:
            block[ij] = on_diag * (1.0 + t.pen_diag / scale)
    if t.guided:
        assert b.guide_rows is not None and b.guide_cols is not None and b.thresholds is not None
        rated = b.guide_rows.tile(r0, r1) @ b.guide_cols.tile(c0, c1).T
        mask = rated > b.thresholds[r0:r1, None]
        if t.diag == "positive" and ij is not None:
            mask[ij] = False
        block.masked_fill_(mask, -torch.inf)
    if b.row_keys is not None and b.col_keys is not None:
        mask = duplicates(b.row_keys, r0, r1, b.col_keys, c0, c1)
        if ij is not None and b.col_keys.pairs:
            mask[ij] = False  # a row's own pair is never its duplicate (its own hard negative may be)
        block.masked_fill_(mask, -torch.inf)
    if t.diag == "exclude" and ij is not None:
        block[ij] = -torch.inf
    if filtered is not None:
        assert b.false_negatives is not None
        tally = b.false_negatives.tally
        if count and tally is not None:
            with torch.no_grad():
                live = block > -torch.inf  # the negatives the other masks left
                if t.diag == "positive" and ij is not None:
                    live[ij] = False
                tally[0] += (filtered & live).sum()
                tally[1] += live.sum()
        block.masked_fill_(filtered, -torch.inf)
    return block, raw, ij, graph


def _tiles(bound: Sequence[Bound], row_tile: int, col_tile: int):
    """Every tile of every bound term: ``(term, its rows' tile, r0, r1, c0, c1)``."""
    for b in bound:
        for r0, r1 in spans(b.rows.n, row_tile):
            q = b.rows.tile(r0, r1)
            for c0, c1 in spans(b.cols.n, col_tile):
                yield b, q, r0, r1, c0, c1


def term_stats(
    bound: Sequence[Bound], m: Tensor, s: Tensor, *, scale: float, row_tile: int, col_tile: int
) -> None:
    """Fold every bound term's logits into the running per-group ``(m, s)``, each ``(groups, B)``, and
    into the running column statistics of a term with a column softmax."""
    scratch: Tensor | None = None
    for b, q, r0, r1, c0, c1 in _tiles(bound, row_tile, col_tile):
        block, _, _, _ = _logits(b, q, r0, r1, c0, c1, scale, False, count=True)
        if b.col_stats is not None:
            if scratch is None or scratch.shape != block.shape:
                scratch = torch.empty_like(block)
            online_lse_update(b.col_stats[0][c0:c1], b.col_stats[1][c0:c1], block, 0, scratch)
        g = b.term.group
        online_lse_update(m[g, r0:r1], s[g, r0:r1], block, 1, None)


def _logit_grad(b: Bound, block: Tensor, lse: LogSumExp, weight: float, ij, c0: int, c1: int) -> Tensor:
    """``w_g * P_g (+ w_c * P_c) - Y`` of one tile, in place of the logits."""
    p_col = None
    if b.col_lse is not None:  # the softmax down the columns, before the block is overwritten
        p_col = exp_flushed_(b.col_lse[c0:c1].log_softmax(block)).mul_(b.col_weight)
    g = block.sub_(lse.m[:, None]).sub_(lse.log_s[:, None])  # in place: the block is not needed after
    exp_flushed_(g).mul_(weight)
    if p_col is not None:
        g.add_(p_col)
    if ij is not None:  # - w_g * Y of each softmax whose positive is on the diagonal
        g[ij] -= (weight if b.term.diag == "positive" else 0.0) + (b.col_weight if b.col_positive else 0.0)
    return g


def _apply(
    b: Bound, g: Tensor, raw: Tensor | None, q: Tensor, c0: int, c1: int, r0: int, r1: int, scale: float,
    graph: TileGraph | None = None,
) -> Tensor:  # fmt: skip
    """Accumulate one tile's logit gradient ``g`` into the bound buffers; returns its part of
    ``sum(G * s * sim)`` (0 when ``raw``, the tile's unpenalised logits, was not kept)."""
    g_rows = b.g_rows[r0:r1] if b.g_rows is not None else None
    g_cols = b.g_cols[c0:c1] if b.g_cols is not None else None
    b.score.accumulate(g, q, b.cols.tile(c0, c1), g_rows, g_cols, scale, graph)
    if raw is None:
        return torch.zeros((), dtype=torch.float64, device=g.device)
    return torch.vdot(g.reshape(-1), raw.reshape(-1)).double()


def term_grads(
    bound: Sequence[Bound], lse: Sequence[LogSumExp], weights: Sequence[float], *, scale: float, row_tile: int,
    col_tile: int, need_scale_grad: bool,
) -> Tensor:  # fmt: skip
    """Second pass: recompute each tile and accumulate its gradients into the bound buffers. Returns
    ``sum(G * s * sim)`` (for the scale's gradient; 0 when not needed)."""
    gs = torch.zeros((), dtype=torch.float64, device=bound[0].rows.x.device)
    for b, q, r0, r1, c0, c1 in _tiles(bound, row_tile, col_tile):
        grp = b.term.group
        block, raw, ij, graph = _logits(b, q, r0, r1, c0, c1, scale, need_scale_grad, grads=True)
        g = _logit_grad(b, block, lse[grp][r0:r1], weights[grp], ij, c0, c1)
        gs += _apply(b, g, raw, q, c0, c1, r0, r1, scale, graph)
    return gs


def fused_chunk(
    bound: Sequence[Bound], weights: Sequence[float], *, n_rows: int, scale: float, chunk: int, need_grads: bool,
    need_scale_grad: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Loss (fp64, summed over rows, without the positive logits) and the gradients into the bound
    buffers in one pass over row chunks: each chunk holds its logits of every term against every
    column, so each softmax is exact there and then and nothing is recomputed (three GEMMs per logit
    block, the exponentials computed once, in place). No term may have a column softmax. Returns every
    group's log-sum-exp per row, ``(G, n_rows)`` fp64, and ``sum(G * s * sim)``."""
    dev = bound[0].rows.x.device
    lse = torch.zeros(len(weights), n_rows, dtype=torch.float64, device=dev)
    gs = torch.zeros((), dtype=torch.float64, device=dev)
    for r0, r1 in spans(n_rows, chunk):
        qs = [b.rows.tile(r0, r1) for b in bound]
        tiles = [
            _logits(b, q, r0, r1, 0, b.cols.n, scale, need_scale_grad, grads=need_grads, count=True)
            for b, q in zip(bound, qs)
        ]
        inv_z: dict[int, Tensor] = {}
        for grp, w in enumerate(weights):
            blocks = [t[0] for b, t in zip(bound, tiles) if b.term.group == grp]
            m = torch.stack([x.amax(1) for x in blocks]).amax(0)
            m.masked_fill_(m == -torch.inf, 0.0)
            z = torch.zeros_like(m)
            for x in blocks:  # in place: the block becomes exp(logits - m)
                z += exp_flushed_(x.sub_(m[:, None])).sum(1)
            lse[grp, r0:r1] = m.double() + z.double().log()
            inv_z[grp] = z.reciprocal_().mul_(w)
        if not need_grads:
            continue
        for b, q, (e, raw, ij, graph) in zip(bound, qs, tiles):
            g = e.mul_(inv_z[b.term.group][:, None])  # w_g * P_g
            if b.term.diag == "positive" and ij is not None:
                g[ij] -= weights[b.term.group]
            gs += _apply(b, g, raw, q, 0, b.cols.n, r0, r1, scale, graph)
    return lse, gs
