"""One call's terms bound to their operands: the sources (the rows ``q`` and ``d``, the column sources
``c<k>``, ``q_all`` and ``q_local``) with their fp32 gradient buffers and duplicate keys, the guide's
sources, the [`Bound`][st_cached_losses.functional.softmax.terms.Bound] terms, and the pieces the local and the ring drivers share (the
statistics, the loss's sum, the gradients mapped back onto the caller's tensors).

Tile sharing: where the documents of a ``doc_to_query`` term are the very columns of the ``query_to_doc``
term's positives and its queries that term's rows (one process; each visiting block in the ring), the
``doc_to_query`` logits are the transpose of the ``query_to_doc`` tiles. The two are then bound as one
term whose tiles feed both softmaxes (4 GEMMs per tile pair instead of 8), for GEMM scores without
penalties or a guide on either."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.kernels.tiles import LogSumExp, Operand, init_stats, raw_grad
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.softmax.options import Bank, Guide, Keys, LossSpec
from st_cached_losses.functional.softmax.terms import (
    Bound,
    FalseNegatives,
    PairKeys,
    Term,
    TermSet,
    guide_thresholds,
    positive_thresholds,
)

__all__ = [
    "Solution",
    "Sources",
    "bind",
    "false_negatives",
    "finish_grads",
    "group_stats",
    "guide_sources",
    "loss_sum",
    "pair_up",
    "row_lse",
    "transposed_pair",
]

#: ``(loss, grad_anchors, grad_candidates, grad_anchors_all, grad_scale)``, what the drivers return
Solution = tuple[Tensor, Tensor | None, list[Tensor], Tensor | None, Tensor | None]


class Sources:
    """Operands and fp32 gradient buffers of one call: the rows ``q`` (anchors) and ``d`` (this
    process's positives), and the column sources ``c<k>``, ``q_all`` and ``q_local``, and a negative
    bank's ``bank_c`` and ``bank_q`` (no gradient buffer: nothing flows to the bank); ``used`` names the
    sources the terms read (the others are neither normalised nor given a buffer; ``q`` and the
    candidate columns always are)."""

    def __init__(
        self, anchors: Tensor, cols: list[Tensor], anchors_all: Tensor | None, *, score: Score, scale: float,
        row_offset: int, prenorm: bool, with_grad: bool, used: set[str] | None = None, keys: Keys | None = None,
        bank: Bank | None = None,
    ) -> None:  # fmt: skip
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
            ops = {"q": self.q, "d": self.d, **self.cols}
            for name, op in ops.items():
                if op is not None:  # (n, d), or a token score's (n, tokens, d + 1): each its own tokens
                    self.grads[name] = torch.zeros(op.x.shape, dtype=self.q.dtype, device=anchors.device)
            if anchors_all is None and "q_all" in self.cols:
                self.grads["q_all"] = self.grads["q_local"]  # one process: the same rows, one buffer
        if bank is not None:  # after the buffers: the bank's entries get none
            if "bank_c" in need:
                self.cols["bank_c"] = score.operand(bank.candidates, 1.0, prenorm)
            if "bank_q" in need and bank.anchors is not None:
                self.cols["bank_q"] = score.operand(bank.anchors, 1.0, prenorm)

    @classmethod
    def of(
        cls, spec: LossSpec, anchors: Tensor, cols: list[Tensor], anchors_all: Tensor | None, scale: float,
        *, prenorm: bool, with_grad: bool,
    ) -> Sources:  # fmt: skip
        """The sources of a call of ``spec``'s loss: its score, row offset and duplicate keys, and the
        sources its terms read."""
        used = {t.rows for t in spec.terms.terms} | {t.cols for t in spec.terms.terms}
        return cls(
            anchors, cols, anchors_all, score=spec.score, scale=scale, row_offset=spec.options.row_offset,
            prenorm=prenorm, with_grad=with_grad, used=used, keys=spec.keys, bank=spec.options.bank,
        )  # fmt: skip

    def with_columns(
        self, cols: dict[str, Operand], grads: dict[str, Tensor], keys: dict[str, PairKeys] | None
    ) -> Sources:
        """The same rows against other columns (a block visiting in the ring), with these gradient buffers."""
        other = copy.copy(self)
        other.cols, other.grads = cols, grads
        if self.keys is not None and keys is not None:
            other.keys = {**keys, **{r: self.keys[r] for r in ("q", "d")}}  # the rows stay this process's
        return other


def guide_sources(
    guide: Guide | None, terms: TermSet, row_offset: int, prenorm: bool, tile: int
) -> tuple[Sources | None, Tensor | None]:
    """The guide's sources (cosine, no gradient) and each row's threshold ([`guide_thresholds`][st_cached_losses.functional.softmax.terms.guide_thresholds])."""
    if guide is None:
        return None, None
    gsrc = Sources(
        guide.anchors, guide.candidates, None, score=Score("cosine"), scale=1.0, row_offset=row_offset,
        prenorm=prenorm, with_grad=False,
    )  # fmt: skip
    assert gsrc.d is not None  # guide sources have every row source
    return gsrc, guide_thresholds(gsrc.q, gsrc.d, terms.margin_strategy or "absolute", terms.margin, tile)


def false_negatives(
    spec: LossSpec, src: Sources, row_offset: int, scale: float, tile: int
) -> FalseNegatives | None:
    """The call's false-negative filter bound to its rows (None without one): each row's threshold in logit units,
    from its own positive's logit (``q_i`` against ``c0[row_offset + i]``; the positive -> anchors direction's
    rows, the same pairs, share it), and the filter's tally."""
    rule = spec.options.false_negatives
    if rule is None:
        return None
    with torch.no_grad():
        positive = spec.score.positives(src.q, src.cols["c0"], row_offset, tile, scale) / scale
        thresholds = positive_thresholds(positive, rule.strategy, rule.gist_margin) * scale
    return FalseNegatives(thresholds, rule.tally)


def transposed_pair(terms: TermSet, score: Score, filtered: bool = False) -> tuple[Term, Term] | None:
    """The ``query_to_doc`` positives' term and the ``doc_to_query`` term whose tiles are its transposes
    (both plain: no penalty, no guide; a GEMM score), if the loss has both. Not with a false-negative filter
    (``filtered``): a shared tile's entry would be judged against its row's threshold in one softmax and its
    column's in the other."""
    if not score.gemm or filtered:
        return None
    plain = [t for t in terms.terms if not (t.pen_off or t.pen_diag or t.guided)]
    fwd = [t for t in plain if (t.rows, t.cols, t.diag) == ("q", "c0", "positive")]
    back = [t for t in plain if (t.rows, t.cols) == ("d", "q_all")]
    return (fwd[0], back[0]) if fwd and back else None


def bind(
    terms: Sequence[Term],
    src: Sources,
    diag_offset: int | None,
    guide: Sources | None,
    thresholds: Tensor | None,
    filtered: FalseNegatives | None = None,
) -> list[Bound]:
    """``terms`` bound to ``src``'s operands, buffers and keys (and the guide's operands, when guided; the
    false-negative filter, ``filtered``, on every term)."""
    out = []
    for t in terms:
        rows = src.q if t.rows == "q" else src.d
        assert rows is not None  # built for every row source a term reads
        guided = guide is not None and t.guided
        diag = None if t.cols.startswith("bank") else 0 if t.cols == "q_local" else diag_offset
        out.append(
            Bound(
                t, src.score, rows, src.cols[t.cols], diag,
                src.grads.get(t.rows), src.grads.get(t.cols),
                (guide.q if t.rows == "q" else guide.d) if guided else None,  # type: ignore[union-attr]
                guide.cols[t.cols] if guided else None,  # type: ignore[union-attr]
                thresholds,
                src.keys[t.rows] if src.keys is not None else None,
                src.keys.get(t.cols) if src.keys is not None else None,
                false_negatives=filtered,
            )
        )  # fmt: skip
    return out


def pair_up(
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


def finish_grads(
    src: Sources,
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


def group_stats(n_groups: int, b: int, like: Operand) -> tuple[Tensor, Tensor]:
    """Every group's running ``(m, s)`` statistics, each ``(groups, b)``."""
    m, ssum = init_stats(n_groups * b, like)
    return m.view(n_groups, b), ssum.view(n_groups, b)  # b may be 0 (a process with no row of a call)


def row_lse(m: Tensor, ssum: Tensor) -> tuple[Tensor, list[LogSumExp]]:
    """Every group's log-sum-exp per row, ``(G, b)`` fp64, and the finished statistics."""
    lse = [LogSumExp(m[g], ssum[g].log()) for g in range(m.shape[0])]
    rows = torch.stack([x.total() for x in lse]) if lse else m.double()
    return rows, lse


def loss_sum(terms: TermSet, lse: Tensor, src: Sources, row_offset: int, tile: int, scale: float) -> Tensor:
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
