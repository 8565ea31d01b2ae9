"""Drivers of the term-based InfoNCE (:mod:`.terms`): on one process or against gathered columns
(:func:`terms_solve`), and by ring exchange (:func:`ring_terms_solve`). Both return
``(loss, grad_anchors, grad_candidates, grad_anchors_all, grad_scale)``, the gradients of
``grad_output * loss`` in the inputs' dtypes, without building a graph. :class:`InfoNCEFunction` is the
one autograd Function of the loss stage.

Planning: the chunked path holds, for a chunk of rows, the logits of every term against every column
at once (one pass: loss and gradients, nothing recomputed); the tiled path, and the chunked one when a
softmax runs down the columns (the symmetric loss sharing its tiles), makes a statistics pass and a
gradient pass, ``O((B + N) d)`` memory plus a few blocks.

Tile sharing: where the documents of a ``doc_to_query`` term are the very columns of the ``query_to_doc``
term's positives and its queries that term's rows (one process; each visiting block in the ring), the
``doc_to_query`` logits are the transpose of the ``query_to_doc`` tiles. The two are then bound as one
term whose tiles feed both softmaxes (4 GEMMs per tile pair instead of 8), for GEMM scores without
penalties or a guide on either.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional._kernels import (
    DEFAULT_MEMORY_BUDGET,
    LogSumExp,
    Operand,
    init_stats,
    merge_stats,
    plan_blocks,
    raw_grad,
    tile_side,
)
from st_cached_losses.functional.checks import scale_value
from st_cached_losses.functional.distributed import all_gather_rows, all_reduce_sum, rank, ring_exchange
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.terms import (
    Bound,
    PairKeys,
    Term,
    TermSet,
    fused_chunk,
    guide_thresholds,
    term_grads,
    term_stats,
)

__all__ = [
    "Guide",
    "InfoNCEFunction",
    "Keys",
    "LossSpec",
    "Solution",
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


@dataclass
class Keys:
    """Duplicate keys of a call (``mask_duplicates``): ``anchors`` ``(B,)`` this process's anchors' (or
    None: pairs are then compared by their positives only), ``candidates`` one ``(N,)`` per column, and
    ``anchors_all`` ``(N,)`` every positive's anchor's (across processes; None on one process)."""

    anchors: Tensor | None
    candidates: list[Tensor]
    anchors_all: Tensor | None = None

    def sources(self, row_offset: int, b: int) -> dict[str, PairKeys]:
        """The keys of every row and column source (see :class:`~.terms.PairKeys`)."""
        pos = self.candidates[0]
        pair_anchor = self.anchors_all if self.anchors_all is not None else self.anchors
        rows = PairKeys(pos[row_offset : row_offset + b], self.anchors)
        out = {"q": rows, "d": rows, "q_local": rows, "q_all": PairKeys(pos, pair_anchor)}
        out["c0"] = out["q_all"]
        out.update({f"c{k}": PairKeys(c, pairs=False) for k, c in enumerate(self.candidates) if k > 0})
        return out


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
        score: Score,
        scale: float,
        row_offset: int,
        prenorm: bool,
        with_grad: bool,
        used: set[str] | None = None,
        keys: Keys | None = None,
    ) -> None:
        b = anchors.shape[0]
        need = {"q", "d", "q_local", "q_all"} if used is None else used
        self.b, self.row_offset, self.score = b, row_offset, score
        self.q = score.operand(anchors, scale, prenorm)
        self.d = score.operand(cols[0][row_offset : row_offset + b], scale, prenorm) if "d" in need else None
        self.cols = {f"c{k}": score.operand(c, 1.0, prenorm) for k, c in enumerate(cols)}
        if "q_local" in need or ("q_all" in need and anchors_all is None):
            self.cols["q_local"] = score.operand(anchors, 1.0, prenorm)
        if "q_all" in need:
            self.cols["q_all"] = (
                score.operand(anchors_all, 1.0, prenorm) if anchors_all is not None else self.cols["q_local"]
            )
        self.keys = keys.sources(row_offset, b) if keys is not None else None
        self.grads: dict[str, Tensor] = {}
        if with_grad:
            dt, dev = self.q.dtype, anchors.device
            ops = {"q": self.q, "d": self.d, **self.cols}
            for name in ("q", "d", *self.cols):
                op = ops[name]
                if op is None:
                    continue
                # (n, d), or a token score's (n, tokens, d + 1): each source its own token count
                self.grads[name] = torch.zeros(op.x.shape, dtype=dt, device=dev)
            if anchors_all is None and "q_all" in self.cols:
                self.grads["q_all"] = self.grads["q_local"]  # one process: the same rows, one buffer

    @classmethod
    def of(
        cls, spec: LossSpec, anchors: Tensor, cols: list[Tensor], anchors_all: Tensor | None, scale: float,
        *, prenorm: bool, with_grad: bool,
    ) -> _Sources:  # fmt: skip
        """The sources of a call of ``spec``'s loss: its score, row offset and duplicate keys, and the
        sources its terms read."""
        used = {t.rows for t in spec.terms.terms} | {t.cols for t in spec.terms.terms}
        return cls(
            anchors, cols, anchors_all, score=spec.score, scale=scale, row_offset=spec.row_offset,
            prenorm=prenorm, with_grad=with_grad, used=used, keys=spec.keys,
        )  # fmt: skip

    def with_columns(
        self, cols: dict[str, Operand], grads: dict[str, Tensor], keys: dict[str, PairKeys] | None
    ) -> _Sources:
        """The same rows against other columns (a block visiting in the ring), with these gradient buffers."""
        other = copy.copy(self)
        other.cols, other.grads = cols, grads
        if self.keys is not None and keys is not None:
            other.keys = {**keys, **{r: self.keys[r] for r in ("q", "d")}}  # the rows stay this process's
        return other


def _thresholds(gsrc: _Sources | None, terms: TermSet, tile: int) -> Tensor | None:
    if gsrc is None:
        return None
    assert gsrc.d is not None  # guide sources have every row source
    return guide_thresholds(gsrc.q, gsrc.d, terms.margin_strategy or "absolute", terms.margin, tile)


def transposed_pair(terms: TermSet, score: Score) -> tuple[Term, Term] | None:
    """The ``query_to_doc`` positives' term and the ``doc_to_query`` term whose tiles are its transposes
    (both plain: no penalty, no guide; a GEMM score), if the loss has both."""
    if not score.gemm:
        return None
    plain = [t for t in terms.terms if not (t.pen_off or t.pen_diag or t.guided)]
    fwd = [t for t in plain if (t.rows, t.cols, t.diag) == ("q", "c0", "positive")]
    back = [t for t in plain if (t.rows, t.cols) == ("d", "q_all")]
    return (fwd[0], back[0]) if fwd and back else None


def _bind(
    terms: Sequence[Term],
    src: _Sources,
    diag_offset: int | None,
    guide: _Sources | None,
    thresholds: Tensor | None,
) -> list[Bound]:
    out = []
    for t in terms:
        diag = 0 if t.cols == "q_local" else diag_offset
        rows = src.q if t.rows == "q" else src.d
        assert rows is not None  # built for every row source a term reads
        guided = guide is not None and t.guided
        out.append(
            Bound(
                t,
                src.score,
                rows,
                src.cols[t.cols],
                diag,
                src.grads.get(t.rows),
                src.grads.get(t.cols),
                (guide.q if t.rows == "q" else guide.d) if guided else None,  # type: ignore[union-attr]
                guide.cols[t.cols] if guided else None,  # type: ignore[union-attr]
                thresholds,
                src.keys[t.rows] if src.keys is not None else None,
                src.keys[t.cols] if src.keys is not None else None,
            )
        )
    return out


def _pair_up(
    bound: list[Bound], pair: tuple[Term, Term], weights: Sequence[float], **cols: Any
) -> list[Bound]:
    """Drop the ``doc_to_query`` term and have the ``query_to_doc`` positives' tiles feed its softmax."""
    fwd, back = pair
    out = []
    for b in bound:
        if b.term == back:
            continue
        if b.term == fwd:
            positive = back.diag == "positive"
            b = replace(
                b, col_group=back.group, col_weight=weights[back.group], col_positive=positive, **cols
            )
        out.append(b)
    return out


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
        score=Score("cosine"),
        scale=1.0,
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


def _group_stats(n_groups: int, b: int, like: Operand) -> tuple[Tensor, Tensor]:
    m, ssum = init_stats(n_groups * b, like)
    return m.view(-1, b), ssum.view(-1, b)


def _row_lse(m: Tensor, ssum: Tensor) -> tuple[Tensor, list[LogSumExp]]:
    """Every group's log-sum-exp per row, ``(G, b)`` fp64, and the finished statistics."""
    lse = [LogSumExp(m[g], ssum[g].log()) for g in range(m.shape[0])]
    rows = torch.stack([x.total() for x in lse]) if lse else m.double()
    return rows, lse


def _loss_sum(terms: TermSet, lse: Tensor, src: _Sources, row_offset: int, tile: int, scale: float) -> Tensor:
    """``sum_g w_g sum_i (lse_g[i] - positive logit of row i in group g)``, fp64. A group with one
    positive has a non-negative loss per row (its log-sum-exp runs over that positive too): a row whose
    positive came out a rounding above its log-sum-exp (the positive is a dot product, the log-sum-exp's
    maximum a GEMM entry) counts 0, not a negative loss. Every positive is in this process's own
    columns."""
    pos = torch.zeros_like(lse)
    n_pos = [0] * lse.shape[0]
    for t in terms.terms:
        if t.diag == "positive":
            rows = src.q if t.rows == "q" else src.d
            assert rows is not None  # built for every row source a term reads
            offset = 0 if t.cols == "q_local" else row_offset
            pos[t.group] += src.score.positives(rows, src.cols[t.cols], offset, tile, scale).double()
            n_pos[t.group] += 1
    total = torch.zeros((), dtype=torch.float64, device=lse.device)
    for g, w in enumerate(terms.weights):
        per_row = lse[g] - pos[g]
        total += w * (per_row.clamp_min(0.0) if n_pos[g] == 1 else per_row).sum()
    return total


@dataclass(frozen=True)
class LossSpec:
    """Everything a driver needs besides the embeddings and the scale, fixed for a call: the loss's
    terms and score, where this process's positives are (``row_offset``), the block plan's inputs, and the
    guide's embeddings and duplicate keys when the loss uses them."""

    terms: TermSet
    score: Score
    row_offset: int = 0
    path: str = "auto"
    chunk_size: int | None = None
    tile_size: int | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    guide: Guide | None = None
    keys: Keys | None = None


class _LocalCall:
    """One process's rows against the given (possibly gathered) columns: operands, buffers, the bound
    terms and the per-group running statistics ``(groups, B)``; a statistics pass and a gradient pass, or
    both in one (``one_pass``: the fused chunks, when no softmax runs down the columns)."""

    def __init__(
        self,
        spec: LossSpec,
        anchors: Tensor,
        cols: list[Tensor],
        anchors_all: Tensor | None,
        s: float,
        *,
        with_grad: bool,
        one_pass: bool,
        need_scale_grad: bool,
    ) -> None:
        terms, b = spec.terms, anchors.shape[0]
        self.spec, self.s, self.b = spec, s, b
        self.anchors, self.cols, self.anchors_all = anchors, cols, anchors_all
        # the doc_to_query tiles are the transposes of query_to_doc's on one process (columns = these rows)
        pair = transposed_pair(terms, spec.score) if anchors_all is None and cols[0].shape[0] == b else None
        # sharing tiles needs two passes, 4 GEMMs per shared tile and per other term; the fused chunks
        # take 3 per term in one pass: with four terms or more, those are cheaper
        if (
            pair is not None
            and one_pass
            and spec.path != "tiled"
            and 4 * (len(terms.terms) - 1) >= 3 * len(terms.terms)
        ):
            pair = None
        width = sum(
            cols[0].shape[0] if t.cols != "q_local" else b
            for t in terms.terms
            if pair is None or t != pair[1]
        )
        one_pass = one_pass and pair is None
        buffers = (1 + need_scale_grad + terms.guided) if one_pass else 3 + terms.guided
        self.plan = plan_blocks(
            b,
            width,
            path=spec.path,
            chunk_size=spec.chunk_size,
            tile_size=spec.tile_size,
            memory_budget=spec.memory_budget,
            # a token score's chunks are as thin as the others': each chunk reads every column's tokens
            # again (MaxSim, B = 512, 180 document tokens: 1-row chunks 19 s, tiles 5.5 s)
            buffers=buffers * spec.score.entry_cost(anchors, cols),
        )
        self.fused = one_pass and self.plan.path == "chunked"
        prenorm = self.plan.path == "chunked"
        self.src = _Sources.of(spec, anchors, cols, anchors_all, s, prenorm=prenorm, with_grad=with_grad)
        gsrc = _guide_sources(spec.guide, spec.row_offset, prenorm)
        thr = _thresholds(gsrc, terms, self.plan.row_tile)
        self.m, self.ssum = _group_stats(len(terms.weights), b, self.src.q)
        self.bound = _bind(terms.terms, self.src, spec.row_offset, gsrc, thr)
        self.pair = pair
        if pair is not None:
            g_back = pair[1].group  # the columns are these rows: their statistics are the group's own
            self.bound = _pair_up(
                self.bound, pair, terms.weights, col_stats=(self.m[g_back], self.ssum[g_back])
            )

    def stats(self) -> tuple[Tensor, list[LogSumExp]]:
        """First pass: every group's statistics; their log-sum-exp per row, ``(G, b)`` fp64, and them."""
        p = self.plan
        term_stats(self.bound, self.m, self.ssum, scale=self.s, row_tile=p.row_tile, col_tile=p.col_tile)
        return _row_lse(self.m, self.ssum)

    def grads(self, lse: list[LogSumExp], need_scale_grad: bool) -> Tensor:
        """Second pass: the gradients into the buffers; returns ``sum(G * s * sim)``."""
        bound = self.bound
        if self.pair is not None:
            col_lse = lse[self.pair[1].group]
            bound = [replace(x, col_lse=col_lse) if x.col_group is not None else x for x in bound]
        p = self.plan
        return term_grads(
            bound,
            lse,
            self.spec.terms.weights,
            scale=self.s,
            row_tile=p.row_tile,
            col_tile=p.col_tile,
            need_scale_grad=need_scale_grad,
        )

    def fused_pass(self, with_grad: bool, need_scale_grad: bool) -> tuple[Tensor, Tensor]:
        return fused_chunk(
            self.bound,
            self.spec.terms.weights,
            n_rows=self.b,
            scale=self.s,
            chunk=self.plan.row_tile,
            need_grads=with_grad,
            need_scale_grad=need_scale_grad,
        )

    def loss(self, lse: Tensor) -> Tensor:
        """The mean loss over this process's rows, in the compute dtype, from the ``(G, b)`` log-sum-exps."""
        total = _loss_sum(self.spec.terms, lse, self.src, self.spec.row_offset, self.plan.row_tile, self.s)
        return (total / self.b).to(self.src.q.dtype)

    def finish(
        self, grad_output: float, gs: Tensor, scale_dtype: torch.dtype | None
    ) -> tuple[Tensor, list[Tensor], Tensor | None, Tensor | None]:
        """The gradients of ``grad_output * loss`` wrt the caller's tensors (and the scale)."""
        factor = float(grad_output) / self.b
        tile = self.plan.row_tile
        g_a, g_c, g_all = _finish(self.src, self.anchors, self.cols, self.anchors_all, self.s, factor, tile)
        g_s = (gs * factor / self.s).to(scale_dtype) if scale_dtype is not None else None
        return g_a, g_c, g_all, g_s


def terms_solve(
    spec: LossSpec,
    anchors: Tensor,
    cols: Sequence[Tensor],
    *,
    scale: float | Tensor,
    anchors_all: Tensor | None,
    grad_output: float,
    with_grad: bool,
) -> Solution:
    """The mean loss of this process's rows against the given (possibly gathered) columns, and its
    gradients when asked for: one pass over row chunks where it can, else a statistics and a gradient
    pass."""
    s = scale_value(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    one_pass = with_grad or spec.path != "tiled"
    call = _LocalCall(
        spec,
        anchors,
        list(cols),
        anchors_all,
        s,
        with_grad=with_grad,
        one_pass=one_pass,
        need_scale_grad=need_scale_grad,
    )
    if call.fused:
        rows_lse, gs = call.fused_pass(with_grad, need_scale_grad)
    else:
        rows_lse, lse = call.stats()
        gs = call.grads(lse, need_scale_grad) if with_grad else torch.zeros(())
    loss = call.loss(rows_lse)
    if not with_grad:
        return loss, None, [], None, None
    scale_dtype = scale.dtype if need_scale_grad else None  # type: ignore[union-attr]
    return (loss, *call.finish(grad_output, gs, scale_dtype))


def ring_terms_solve(
    spec: LossSpec,
    anchors: Tensor,
    cols: Sequence[Tensor],
    sizes: list[int],
    *,
    scale: float | Tensor,
    with_grad: bool,
) -> Solution:
    """This process's share of the global loss (``W / B_global * sum`` over its rows) by ring exchange:
    every process's columns (its candidates, its anchors when a term reads ``q_all``, its guide
    embeddings when guided, its keys when masking) visit every process once per pass, the next block in
    flight while the current one is scored; a visiting block's gradient travels with it and is home after
    the circle. Row statistics never leave their process; the statistics of a softmax down the columns
    (the symmetric loss's positives against every anchor) travel with their block.

    Rows are ``(b, *row_shape)``: embeddings ``(b, d)``, or packed rows (token rows ``(b, t, d + 1)``,
    sparse rows ``(b, k, 2)``). Every travelling tensor (the candidate columns, and the anchors when a term
    reads them) must have the same row shape on every process (the caller pads packed rows to a common
    width: :func:`~.parallel.ring_loss_and_grad`); the rows (anchors) may have a shape of their own."""
    terms, score, guide, keys = spec.terms, spec.score, spec.guide, spec.keys
    me, w = rank(), len(sizes)
    cols = list(cols)
    s = scale_value(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    b = anchors.shape[0]
    k = len(cols)
    pair = transposed_pair(terms, score)
    # a token score's logit costs q_tokens x d_tokens elements (the block plan's entry cost)
    cost = score.entry_cost(anchors, cols)
    tile = tile_side(spec.tile_size, spec.memory_budget, buffers=(3 + terms.guided) * cost)
    src = _Sources.of(spec, anchors, cols, None, s, prenorm=False, with_grad=with_grad)
    gsrc = _guide_sources(guide, 0, prenorm=False)
    thr = _thresholds(gsrc, terms, tile)
    visiting = [t for t in terms.terms if t.cols != "q_local"]
    local = [t for t in terms.terms if t.cols == "q_local"]
    reads_q_all = any(t.cols == "q_all" and (pair is None or t != pair[1]) for t in visiting)
    names = [f"c{j}" for j in range(k)] + (["q_all"] if reads_q_all else [])
    # what travels: the columns side by side (b, K', *row_shape); the guide's (b, K, g); the keys (b, K + 1)
    travelling = [*cols, anchors][: len(names)]
    row_shape = travelling[0].shape[1:]
    if any(t.shape[1:] != row_shape for t in travelling):
        raise ValueError(
            "the ring exchange sends the columns (and the anchors when a term reads them) side by side: their "
            f"rows must have one shape, got {[tuple(t.shape[1:]) for t in travelling]} (pad packed rows to a "
            "common width first)."
        )
    own = [torch.stack(travelling, dim=1).contiguous()]
    if guide is not None:
        own.append(torch.stack(guide.candidates, dim=1).contiguous())
    if keys is not None:
        key_anchor = keys.anchors if keys.anchors is not None else torch.full_like(keys.candidates[0], -1)
        own.append(torch.stack([*keys.candidates, key_anchor], dim=1).contiguous())
    n_groups = len(terms.weights)
    m, ssum = _group_stats(n_groups, b, src.q)
    # a score that keeps per-block data (SparseDot's CSR forms) forgets a visiting block once scored:
    # the blocks of every process would otherwise pile up
    release = getattr(score.fn, "release", None) or (lambda: None)

    def bind(owner: int, tensors: list[Tensor], g_block: Tensor | None, **col_state: Any) -> list[Bound]:
        """The terms against a visiting block (and, for this process's own block, the local terms)."""
        blk, rest = tensors[0], tensors[1:]
        grads = {}
        if g_block is not None:  # this process's rows keep theirs; the block's travel with it
            grads = {r: g for r, g in src.grads.items() if r in ("q", "d")}
            grads.update({n: g_block[:, j] for j, n in enumerate(names)})
        col_keys = None
        if keys is not None:
            kb = rest[-1]
            anchor = kb[:, k] if keys.anchors is not None else None
            col_keys = Keys(anchor, [kb[:, j] for j in range(k)]).sources(0, kb.shape[0])
        visit = src.with_columns(
            {n: score.operand(blk[:, j], 1.0, prenormalize=False) for j, n in enumerate(names)},
            grads,
            col_keys,
        )
        gvisit = None
        if gsrc is not None:
            gblk = rest[0]
            gvisit = gsrc.with_columns(
                {f"c{j}": Operand(gblk[:, j], True, 1.0, False) for j in range(k)}, {}, None
            )
        scored = [t for t in visiting if pair is None or t != pair[1]]  # the pair's back term rides along
        bound = _bind(scored, visit, 0 if owner == me else None, gvisit, thr)
        if pair is not None:
            bound = _pair_up(bound, pair, terms.weights, **col_state)
        if owner == me and local:
            bound += _bind(local, src, 0, gsrc, thr)
        return bound

    def visit_stats(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        col_state = {"col_stats": (carried[0][:, 0], carried[0][:, 1])} if pair is not None else {}
        term_stats(bind(owner, tensors, None, **col_state), m, ssum, scale=s, row_tile=tile, col_tile=tile)
        release()

    # the column softmax's statistics of each block's positives travel with it and come home complete
    col_acc = [torch.stack(init_stats(b, src.q), dim=1)] if pair is not None else []
    col_acc = ring_exchange(own, col_acc, sizes, visit_stats)
    if pair is not None:
        g_back = pair[1].group  # joint with this process's own terms of the group, or alone
        merge_stats(m[g_back], ssum[g_back], col_acc[0][:, 0], col_acc[0][:, 1])
    rows_lse, lse = _row_lse(m, ssum)
    factor = w / sum(sizes)
    loss = (_loss_sum(terms, rows_lse, src, 0, tile, s) * factor).to(src.q.dtype)
    if not with_grad:
        return loss, None, [], None, None
    gs_total = torch.zeros((), dtype=torch.float64, device=anchors.device)
    if pair is not None:  # in pass 2 each block's finished column statistics travel with it
        own.append(lse[pair[1].group].stacked())

    def visit_grads(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        nonlocal gs_total
        col_state = {"col_lse": LogSumExp.unstack(tensors[-1])} if pair is not None else {}
        bound = bind(owner, tensors[:-1] if pair is not None else tensors, carried[0], **col_state)
        gs_total += term_grads(
            bound, lse, terms.weights, scale=s, row_tile=tile, col_tile=tile, need_scale_grad=need_scale_grad
        )
        release()

    g_block = torch.zeros(b, len(names), *row_shape, dtype=src.q.dtype, device=anchors.device)
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


class InfoNCEFunction(torch.autograd.Function):
    """The loss stage's autograd. Forward: the statistics pass; it saves the input embeddings (no copies)
    and each group's ``O(B)`` log-sum-exp statistics, and only when some input needs a gradient.
    Backward: rebuilds the operands from the saved inputs (``O((B + N) d)``, negligible next to the
    ``O(B N d)`` tiles) and recomputes each logit tile once, holding one block of logits at a time."""

    @staticmethod
    def forward(
        ctx: Any, spec: LossSpec, scale: Tensor, anchors: Tensor, anchors_all: Tensor | None, *cols: Tensor
    ) -> Tensor:
        s = scale_value(scale)
        call = _LocalCall(
            spec, anchors, list(cols), anchors_all, s, with_grad=False, one_pass=False, need_scale_grad=False
        )
        rows_lse, _ = call.stats()
        if any(ctx.needs_input_grad):
            # nothing derived from the embeddings (a normalised copy in the chunked path) outlives forward
            ctx.spec, ctx.s, ctx.n_cols, ctx.scale_dtype = spec, s, len(cols), scale.dtype
            ctx.save_for_backward(anchors, anchors_all, *cols, call.m, call.ssum)
        # fp64 inputs keep fp64 (for gradcheck); everything else is computed and returned in fp32
        return call.loss(rows_lse)

    @staticmethod
    @fp32_loss_stage
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        anchors, anchors_all, *rest = ctx.saved_tensors
        cols, (m, ssum) = list(rest[: ctx.n_cols]), rest[ctx.n_cols :]
        need_scale_grad = ctx.needs_input_grad[1]
        call = _LocalCall(
            ctx.spec,
            anchors,
            cols,
            anchors_all,
            ctx.s,
            with_grad=True,
            one_pass=False,
            need_scale_grad=need_scale_grad,
        )
        _, lse = _row_lse(m, ssum)
        gs = call.grads(lse, need_scale_grad)
        g_a, g_c, g_all, g_s = call.finish(float(grad_loss), gs, ctx.scale_dtype if need_scale_grad else None)
        return (None, g_s, g_a, g_all, *g_c)
