"""InfoNCE with several positives per row: each positive of row ``i`` is scored against itself and every
candidate that is not a positive of row ``i`` (the row's other positives are not its negatives), its losses
averaged over the row's positives, then the mean over the rows. The symmetric direction scores each positive
against every anchor, its row's anchor the target, averaged the same way.

No new kernel: the rows are the ``(anchor, positive)`` pairs, and the core is called once per number of
positives ``m`` (the pairs of the rows with ``m`` positives, sorted so that their positives are one span of the
positive column: the core's ``row_offset``), each call's loss and gradients weighed by ``1 / (B m)`` per pair;
the row's other positives are masked by duplicate keys (pairs of one anchor share its key). The symmetric
direction is called once per ``(m, k)``: the ``k``-th positives of the rows with ``m``, against the anchors
sorted so that those rows' anchors are one span. The hard-negative columns are lists (``listed_negatives``:
every entry a candidate of every pair).

Across processes ([`gathered_several_positives_loss_and_grad`][st_cached_losses.functional.softmax.positives.gathered_several_positives_loss_and_grad])
every process's per-row counts, columns (each at its own length), anchors (for the symmetric direction) and
keys are all-gathered; each process scores its own rows' pairs against them, its pairs the first of every span
of the sorted columns, and the gradients wrt the gathered rows are summed over processes.

On the ring ([`ring_several_positives_loss_and_grad`][st_cached_losses.functional.softmax.positives.ring_several_positives_loss_and_grad])
nothing of ``d`` per row is gathered: only the per-row counts, so that every process walks the same rings. Each
process sorts its own positives by their row's number of positives; one ring per number ``m`` (of any process)
passes every process's sorted positives, lists and keys around, this process's pairs with ``m`` positives the
rows, their positives one span of its own block; the symmetric direction one ring per ``(m, k)``, every
process's anchors (sorted by their count) travelling. A process with no row of some ``m`` scores no row in that
ring, and passes its blocks on all the same. Memory ``O(local B x d)`` per process, as the ring's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from st_cached_losses.functional.distributed import all_gather_rows, all_reduce_sum, own_rows, rank
from st_cached_losses.functional.placement import column_sizes, mean_scale_grad
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.softmax.loss import InfoNCEOutput, infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import InfoNCEOptions
from st_cached_losses.functional.softmax.ring import ring_terms_solve
from st_cached_losses.functional.softmax.terms import Term, TermSet, mnrl_terms

__all__ = [
    "gathered_several_positives_loss_and_grad",
    "ring_several_positives_loss_and_grad",
    "several_positives_loss_and_grad",
]


def _split_terms(terms: TermSet) -> tuple[TermSet, float, TermSet | None, float]:
    """The anchor -> candidates terms (one softmax) and the positive -> anchors term, each as a one-softmax
    term set of its own, with the weight of its group; refuses terms that have no meaning with several
    positives."""
    fwd = [t for t in terms.terms if t.rows == "q" and t.cols.startswith("c")]
    back = [t for t in terms.terms if t.rows == "d" and t.cols == "q_all"]
    if len(fwd) + len(back) != len(terms.terms) or terms.guided or not fwd or len(back) > 1:
        raise ValueError(
            "several positives per row take the anchor -> candidates terms (query_to_doc) and the positive -> "
            "anchors term (doc_to_query) only: query_to_query and doc_to_doc, and guided terms, are not "
            "defined for them."
        )
    groups = {t.group for t in fwd}
    if len(groups) != 1 or (back and back[0].group in groups):
        raise ValueError(
            "several positives per row: query_to_doc and doc_to_query must be separate softmaxes "
            "(partition_mode='per_direction'); in one joint softmax a positive's row would hold its anchor's "
            "candidates and its own anchors at once, which has no single target."
        )
    g = groups.pop()
    fwd_set = TermSet(tuple(replace(t, group=0) for t in fwd), (1.0,))
    if not back:
        return fwd_set, terms.weights[g], None, 0.0
    b = back[0]
    back_set = TermSet((Term("q", "c0", 0, "positive", b.pen_off, b.pen_diag),), (1.0,))
    return fwd_set, terms.weights[g], back_set, terms.weights[b.group]


def _directions(options: InfoNCEOptions, n_columns: int) -> tuple[TermSet, float, TermSet | None, float]:
    """``_split_terms`` of the options' terms (the one-directional or symmetric loss's when None); refuses
    duplicate keys with the positive -> anchors term."""
    terms = options.terms
    if terms is None:
        directions = ("query_to_doc", "doc_to_query") if options.symmetric else ("query_to_doc",)
        terms = mnrl_terms(directions, "per_direction", None, 0.0, n_columns)
    split = _split_terms(terms)
    if split[2] is not None and options.candidate_keys is not None:
        raise ValueError(
            "several positives per row with duplicate keys (mask_duplicates) take the anchor -> candidates "
            "direction only; drop doc_to_query or mask_duplicates."
        )
    return split


def _check_counts(counts: Tensor, n_rows: int, n_positives: int, last: int) -> None:
    """``counts`` (the rows' numbers of positives, the first ``last`` of them up to this process's) give each of
    the ``n_rows`` rows one or more and sum to ``n_positives``."""
    bad = counts.dim() != 1 or counts.numel() != n_rows or last > n_rows
    if bad or bool((counts < 1).any()) or int(counts.sum()) != n_positives:
        raise ValueError(
            f"several positives: counts must give each of the {n_rows} anchors at least one positive and sum to "
            f"the {n_positives} positives; got {counts.tolist()}."
        )


def _call(
    anchors: Tensor, cols: list[Tensor], opts: InfoNCEOptions, weight: float, with_grad: bool
) -> InfoNCEOutput:
    if with_grad:
        out = infonce_loss_and_grad(anchors, cols, opts, grad_output=weight)
        out.loss = out.loss * weight
        return out
    with torch.no_grad():
        return InfoNCEOutput(infonce(anchors, cols, opts) * weight, None, [], None, None)


def several_positives_loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    counts: Tensor,
    options: InfoNCEOptions,
    *,
    with_grad: bool = True,
) -> InfoNCEOutput:
    """The loss with several positives per row, and its gradients (see the module's notes).

    Args:
        anchors: ``(B, d)`` this process's anchors.
        candidates: the positives ``(M, d)``, row after row (``counts[i]`` of row ``i``), then the hard-negative
            columns, each ``(n_k, d)`` of any length (every entry a candidate of every pair).
        counts: ``(B,)`` each row's number of positives, at least 1, summing to ``M``.
        options: the loss's options: its terms (``query_to_doc``, and ``doc_to_query`` per direction), score,
            scale, plan; duplicate keys (``anchor_keys`` ``(B,)``, ``candidate_keys`` one per column) mask
            duplicates as they do for one positive, in the anchor -> candidates direction. No bank, no
            ``anchors_all``: one process.
        with_grad: also the gradients (else the loss only).

    Returns:
        [`InfoNCEOutput`][st_cached_losses.functional.softmax.loss.InfoNCEOutput]: the loss, the gradients wrt the
        anchors and every column (and a tensor scale's)."""
    _check_own_layout(options, "on one process")
    anchors = anchors.detach()
    counts = counts.to(device=anchors.device, dtype=torch.long)
    out, _ = _pairs_loss_and_grad(
        anchors, [c.detach() for c in candidates], counts, 0, anchors.shape[0], options, None, with_grad
    )
    return out


def gathered_several_positives_loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    counts: Tensor,
    sizes: list[int],
    options: InfoNCEOptions,
    *,
    with_grad: bool = True,
) -> InfoNCEOutput:
    """This process's share of the loss with several positives per row across processes, against every
    process's candidates (all-gathered), and its gradients wrt this process's rows: the arguments of
    [`several_positives_loss_and_grad`][st_cached_losses.functional.softmax.positives.several_positives_loss_and_grad]
    (this process's rows, counts and columns, each at its own length) and ``sizes``, every process's row count
    in rank order. Every process's per-row counts are gathered (so each knows where every row's positives are),
    the columns at their own lengths, the anchors when the positive -> anchors term reads them, and the
    duplicate keys. Weighting as the gathered strategy's: process ``r`` returns ``W / B_global`` times the sum
    of its rows' losses, so the mean over processes is the global loss; the gradients wrt the gathered rows are
    summed over processes (each keeps its own), a tensor scale's averaged."""
    _check_own_layout(options, "across processes, which places every process's rows itself")
    w, me = len(sizes), rank()
    anchors = anchors.detach()
    device = anchors.device
    counts = counts.to(device=device, dtype=torch.long)
    counts_all = all_gather_rows(counts, sizes)
    row_sizes = [int(c.sum()) for c in counts_all.split(sizes)]
    per_column = [row_sizes, *column_sizes(candidates, sizes, True)[1:]]
    cols = [
        all_gather_rows(c.detach(), n) if max(n) > 0 else c.detach() for c, n in zip(candidates, per_column)
    ]
    layout: dict = {"check_finite": False}
    if options.candidate_keys is not None:
        layout["candidate_keys"] = [
            all_gather_rows(k, n) if max(n) > 0 else k for k, n in zip(options.candidate_keys, per_column)
        ]
        if options.anchor_keys is not None:
            layout["anchor_keys"] = all_gather_rows(options.anchor_keys, sizes)
    first, total = sum(sizes[:me]), sum(sizes)
    anchors_all = all_gather_rows(anchors, sizes) if options.uses_anchors_all else None
    out, g_all = _pairs_loss_and_grad(
        anchors, cols, counts_all, first, total / w, replace(options, **layout), anchors_all, with_grad
    )
    if not with_grad:
        return out
    assert out.grad_anchors is not None  # asked for
    g_cols = [
        own_rows(all_reduce_sum(g.contiguous(), "all_reduce_grad"), n) if max(n) > 0 else g
        for g, n in zip(out.grad_candidates, per_column)
    ]
    g_anchors = out.grad_anchors
    if g_all is not None:  # the positive -> anchors term's, wrt every process's anchors
        g_own = own_rows(all_reduce_sum(g_all, "all_reduce_grad"), sizes)
        g_anchors = (g_anchors.to(g_own.dtype) + g_own).to(anchors.dtype)
    return InfoNCEOutput(out.loss, g_anchors, g_cols, None, mean_scale_grad(out.grad_scale, w))


def _check_own_layout(options: InfoNCEOptions, where: str) -> None:
    if options.bank is not None or options.anchors_all is not None or options.row_offset:
        raise ValueError(
            f"several positives per row are scored {where} without a negative bank: pass bank=None, no "
            "anchors_all and row_offset=0."
        )


def _pairs_loss_and_grad(
    anchors: Tensor,
    cols: list[Tensor],
    counts: Tensor,
    first: int,
    divisor: float,
    options: InfoNCEOptions,
    anchors_all: Tensor | None,
    with_grad: bool,
) -> tuple[InfoNCEOutput, Tensor | None]:
    """The pairs of this process's rows (``anchors``, the rows ``first ... first + b`` of every row) against
    ``cols`` (every row's positives, row after row as ``counts`` ``(N,)`` says, then the negative columns),
    each pair weighed ``1 / (divisor m)``; the positive -> anchors term scores this process's positives against
    ``anchors_all`` ``(N, d)`` (None: ``anchors``, every row being this process's). Keys (``options``) are every
    row's and every column's. Returns the output (the gradients wrt this process's anchors and every column) and
    the gradient wrt ``anchors_all`` (None without that term, or without ``anchors_all``)."""
    b, device = anchors.shape[0], anchors.device
    n_rows, m_total = counts.shape[0], int(counts.sum())
    mine_rows = counts[first : first + b]
    _check_counts(counts, n_rows, cols[0].shape[0], b + first)
    fwd_terms, w_fwd, back_terms, w_back = _directions(options, len(cols))

    owner = torch.repeat_interleave(torch.arange(n_rows, device=device), counts)  # (M,) each positive's row
    per_pair = counts[owner]  # (M,) its row's number of positives
    not_mine = ((owner < first) | (owner >= first + b)).long()
    # duplicate keys: pairs of one anchor share its key, so a row's other positives are masked (its own pair
    # never is); without the loss's keys, keys that make no other duplicate (positives and negatives distinct)
    if options.candidate_keys is not None:
        given = list(options.candidate_keys)
        a_keys = options.anchor_keys[owner] if options.anchor_keys is not None else owner
        pos_keys, neg_keys = given[0], given[1:]
    else:
        a_keys = owner
        pos_keys = torch.arange(m_total, device=device)
        starts = torch.tensor([0, *[len(c) for c in cols[1:]]], device=device).cumsum(0)
        neg_keys = [m_total + starts[k] + torch.arange(len(c), device=device) for k, c in enumerate(cols[1:])]
    # pairs by their row's number of positives, this process's first among those of each number (one span)
    order = torch.argsort(per_pair * 2 + not_mine, stable=True)
    base = replace(options, terms=fwd_terms, symmetric=False, listed_negatives=True, bank=None)
    sorted_cols = [cols[0][order], *cols[1:]]
    sorted_keys = [pos_keys[order], *neg_keys]
    pair_rows, a_sorted = owner[order], a_keys[order]
    sizes, sorted_mine = per_pair[order], not_mine[order] == 0

    loss = torch.zeros((), dtype=torch.float64, device=device)
    acc = torch.float64 if anchors.dtype == torch.float64 else torch.float32  # gradients summed over calls
    g_anchors = torch.zeros(anchors.shape, dtype=acc, device=device)
    # the positive -> anchors term's gradients wrt every row's anchors (this process's own on one process)
    g_all = g_anchors
    if anchors_all is not None and back_terms is not None:
        g_all = torch.zeros(anchors_all.shape, dtype=acc, device=device)
    g_cols = [torch.zeros(c.shape, dtype=acc, device=device) for c in cols]
    g_scale: Tensor | None = None
    for m in torch.unique(mine_rows).tolist():
        span = ((sizes == m) & sorted_mine).nonzero().flatten()
        o, n = int(span[0]), int(span.numel())
        opts = replace(
            base,
            row_offset=o,
            anchor_keys=a_sorted[o : o + n],
            candidate_keys=sorted_keys,
            anchors_all_keys=a_sorted,
        )
        local = pair_rows[o : o + n] - first
        out = _call(anchors[local], sorted_cols, opts, w_fwd * n / (divisor * m), with_grad)
        loss += out.loss.double()
        if with_grad:
            assert out.grad_anchors is not None
            g_anchors.index_add_(0, local, out.grad_anchors.to(acc))
            g_cols[0].index_add_(0, order, out.grad_candidates[0].to(acc))
            for k in range(1, len(cols)):
                g_cols[k] += out.grad_candidates[k].to(acc)
            if out.grad_scale is not None:
                g_scale = out.grad_scale if g_scale is None else g_scale + out.grad_scale

    if back_terms is not None:
        back = replace(options, terms=back_terms, symmetric=False, listed_negatives=False, bank=None)
        back = replace(back, anchor_keys=None, candidate_keys=None, anchors_all_keys=None)
        rows = torch.arange(n_rows, device=device)
        row_not_mine = ((rows < first) | (rows >= first + b)).long()
        # the anchors by their row's number of positives, this process's rows first among those of each number
        by_count = torch.argsort(counts * 2 + row_not_mine, stable=True)
        firsts = counts.cumsum(0) - counts  # each row's first positive in the column
        q_sorted = (anchors_all if anchors_all is not None else anchors)[by_count]
        n_sorted, mine_sorted = counts[by_count], row_not_mine[by_count] == 0
        for m in torch.unique(mine_rows).tolist():
            span = ((n_sorted == m) & mine_sorted).nonzero().flatten()
            o, n = int(span[0]), int(span.numel())
            for k in range(m):
                picked = firsts[by_count[o : o + n]] + k  # the k-th positive of each of these rows
                out = _call(
                    cols[0][picked],
                    [q_sorted],
                    replace(back, row_offset=o),
                    w_back * n / (divisor * m),
                    with_grad,
                )
                loss += out.loss.double()
                if with_grad:
                    assert out.grad_anchors is not None
                    g_cols[0].index_add_(0, picked, out.grad_anchors.to(acc))
                    g_all.index_add_(0, by_count, out.grad_candidates[0].to(acc))
                    if out.grad_scale is not None:
                        g_scale = out.grad_scale if g_scale is None else g_scale + out.grad_scale

    if not with_grad:
        return InfoNCEOutput(loss.to(acc), None, [], None, None), None
    grads = InfoNCEOutput(
        loss.to(acc),
        g_anchors.to(anchors.dtype),
        [g.to(c.dtype) for g, c in zip(g_cols, cols)],
        None,
        g_scale,
    )
    return grads, g_all if anchors_all is not None and back_terms is not None else None


@fp32_loss_stage
def ring_several_positives_loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    counts: Tensor,
    sizes: list[int],
    options: InfoNCEOptions,
    *,
    with_grad: bool = True,
) -> InfoNCEOutput:
    """[`gathered_several_positives_loss_and_grad`][st_cached_losses.functional.softmax.positives.gathered_several_positives_loss_and_grad]
    by ring exchange (same arguments and weighting; ``options.path`` "auto" or "tiled"): nothing of size
    ``B_global x d`` is gathered, every process's sorted positives, lists and keys pass around the ring (see the
    module's notes). Collectives: one all-gather of the per-row counts and one of the lists' lengths, then per
    number of positives ``m`` of any process one ring of two passes (and with the positive -> anchors term ``m``
    more), each averaging a tensor scale's gradient."""
    _check_own_layout(options, "across processes, which places every process's rows itself")
    if options.path not in ("auto", "tiled"):
        raise ValueError(
            f"the ring exchange is tiled by construction: path must be 'auto' or 'tiled', got {options.path!r}."
        )
    w, me = len(sizes), rank()
    anchors, cols = anchors.detach(), [c.detach() for c in candidates]
    b, device = anchors.shape[0], anchors.device
    counts = counts.to(device=device, dtype=torch.long)
    _check_counts(counts, b, cols[0].shape[0], b)
    fwd_terms, w_fwd, back_terms, w_back = _directions(options, len(cols))
    counts_all = all_gather_rows(counts, sizes)  # every process walks the rings of every number of positives
    ms = torch.unique(counts_all).tolist()
    first, total = sum(sizes[:me]), sum(sizes)
    row_sizes = [int(c.sum()) for c in counts_all.split(sizes)]  # every process's positives
    list_sizes = column_sizes(cols, sizes, True)[1:]
    score = Score(options.similarity)

    owner = torch.repeat_interleave(torch.arange(b, device=device), counts)  # (M,) each positive's local row
    per_pair = counts[owner]
    order = torch.argsort(per_pair, stable=True)  # the pairs of each number of positives one span
    # keys: pairs of one anchor share its key, so a row's other positives are masked (its own pair never is);
    # without the loss's keys, keys unique over processes that make no other duplicate (negatives' never equal
    # a positive's)
    if options.candidate_keys is not None:
        given = list(options.candidate_keys)
        a_keys = options.anchor_keys[owner] if options.anchor_keys is not None else first + owner
        pos_keys, neg_keys = given[0], given[1:]
    else:
        a_keys = first + owner
        pos_keys = sum(row_sizes[:me]) + torch.arange(len(owner), device=device)
        neg_keys = [torch.full((len(c),), -1, dtype=torch.long, device=device) for c in cols[1:]]
    sorted_cols = [cols[0][order], *cols[1:]]
    sorted_keys = [pos_keys[order], *neg_keys]
    a_sorted, pair_rows, m_sorted = a_keys[order], owner[order], per_pair[order]
    base = replace(
        options, terms=fwd_terms, symmetric=False, listed_negatives=True, bank=None, check_finite=False
    )

    loss = torch.zeros((), dtype=torch.float64, device=device)
    acc = torch.float64 if anchors.dtype == torch.float64 else torch.float32  # gradients summed over calls
    g_anchors = torch.zeros(anchors.shape, dtype=acc, device=device)
    g_cols = [torch.zeros(c.shape, dtype=acc, device=device) for c in cols]
    g_scale: list[Tensor] = []

    def ring(
        rows: Tensor,
        columns: list[Tensor],
        opts: InfoNCEOptions,
        block_sizes: list[int],
        weight: float,
        lists: list[list[int]] | None,
    ) -> tuple[Tensor | None, list[Tensor]]:
        """One ring of ``rows`` against every process's ``columns``, each row's loss weighed ``weight``."""
        nonlocal loss
        spec = opts.spec(rows, columns, score)
        out, g_rows, g_columns, _, g_s = ring_terms_solve(
            spec, rows, columns, block_sizes, scale=options.scale, with_grad=with_grad, list_sizes=lists,
            factor=weight * w / total,
        )  # fmt: skip
        loss += out.double()
        if g_s is not None:
            g_scale.append(g_s)
        return g_rows, g_columns

    for m in ms:  # the anchor -> candidates term: this process's pairs whose row has m positives
        o, n = int((m_sorted < m).sum()), int((m_sorted == m).sum())
        opts = replace(
            base,
            row_offset=o,
            anchor_keys=a_sorted[o : o + n],
            candidate_keys=sorted_keys,
            anchors_all_keys=a_sorted,
        )
        rows = pair_rows[o : o + n]
        g_rows, g_columns = ring(anchors[rows], sorted_cols, opts, row_sizes, w_fwd / m, list_sizes)
        if with_grad:
            assert g_rows is not None  # asked for
            g_anchors.index_add_(0, rows, g_rows.to(acc))
            g_cols[0].index_add_(0, order, g_columns[0].to(acc))
            for k in range(1, len(cols)):
                g_cols[k] += g_columns[k].to(acc)

    if back_terms is not None:  # each positive against every anchor: every process's anchors travel
        back = replace(
            options, terms=back_terms, symmetric=False, listed_negatives=False, bank=None, anchor_keys=None,
            candidate_keys=None, anchors_all_keys=None, check_finite=False,
        )  # fmt: skip
        by_count = torch.argsort(counts, stable=True)  # this process's anchors, those of each count one span
        firsts = counts.cumsum(0) - counts  # each row's first positive
        q_sorted, n_sorted = anchors[by_count], counts[by_count]
        for m in ms:
            o, n = int((n_sorted < m).sum()), int((n_sorted == m).sum())
            for k in range(m):
                picked = firsts[by_count[o : o + n]] + k  # the k-th positive of each of these rows
                g_rows, g_columns = ring(
                    cols[0][picked], [q_sorted], replace(back, row_offset=o), sizes, w_back / m, None
                )
                if with_grad:
                    assert g_rows is not None  # asked for
                    g_cols[0].index_add_(0, picked, g_rows.to(acc))
                    g_anchors.index_add_(0, by_count, g_columns[0].to(acc))

    if not with_grad:
        return InfoNCEOutput(loss.to(acc), None, [], None, None)
    # each ring averaged its scale gradient over the processes already
    grad_scale = torch.stack(g_scale).sum(0) if g_scale else None
    return InfoNCEOutput(
        loss.to(acc),
        g_anchors.to(anchors.dtype),
        [g.to(c.dtype) for g, c in zip(g_cols, cols)],
        None,
        grad_scale,
    )
