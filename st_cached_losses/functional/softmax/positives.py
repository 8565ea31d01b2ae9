"""InfoNCE with several positives per row: each positive of row ``i`` is scored against itself and every
candidate that is not a positive of row ``i`` (the row's other positives are not its negatives), its losses
averaged over the row's positives, then the mean over the rows. The symmetric direction scores each positive
against every anchor, its row's anchor the target, averaged the same way.

No new kernel: the rows are the ``(anchor, positive)`` pairs, and the core is called once per number of
positives ``m`` (the pairs of the rows with ``m`` positives, sorted so that their positives are one span of the
positive column: the core's ``row_offset``), each call's loss and gradients weighed by ``1 / (B m)`` per pair;
the row's other positives are masked by duplicate keys (pairs of one anchor share its key). The symmetric
direction is called once per ``(m, k)``: the ``k``-th positives of the rows with ``m``, against the anchors
sorted so that those rows' anchors are one span. One process; the hard-negative columns are lists
(``listed_negatives``: every entry a candidate of every pair)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from st_cached_losses.functional.softmax.loss import InfoNCEOutput, infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import InfoNCEOptions
from st_cached_losses.functional.softmax.terms import Term, TermSet, mnrl_terms

__all__ = ["several_positives_loss_and_grad"]


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
    if options.bank is not None or options.anchors_all is not None or options.row_offset:
        raise ValueError(
            "several positives per row are scored on one process without a negative bank: pass bank=None, no "
            "anchors_all and row_offset=0."
        )
    cols = [c.detach() for c in candidates]
    anchors = anchors.detach()
    b, device = anchors.shape[0], anchors.device
    counts = counts.to(device=device, dtype=torch.long)
    m_total = int(counts.sum())
    if counts.shape != (b,) or bool((counts < 1).any()) or cols[0].shape[0] != m_total:
        raise ValueError(
            f"several positives: counts must give each of the {b} anchors at least one positive and sum to the "
            f"{cols[0].shape[0]} positives; got {counts.tolist()}."
        )
    terms = options.terms
    if terms is None:
        directions = ("query_to_doc", "doc_to_query") if options.symmetric else ("query_to_doc",)
        terms = mnrl_terms(directions, "per_direction", None, 0.0, len(cols))
    fwd_terms, w_fwd, back_terms, w_back = _split_terms(terms)
    if back_terms is not None and options.candidate_keys is not None:
        raise ValueError(
            "several positives per row with duplicate keys (mask_duplicates) take the anchor -> candidates "
            "direction only; drop doc_to_query or mask_duplicates."
        )

    owner = torch.repeat_interleave(torch.arange(b, device=device), counts)  # (M,) each positive's row
    per_pair = counts[owner]  # (M,) its row's number of positives
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
    order = torch.argsort(per_pair, stable=True)  # pairs by their row's number of positives
    base = replace(options, terms=fwd_terms, symmetric=False, listed_negatives=True, bank=None)
    sorted_cols = [cols[0][order], *cols[1:]]
    sorted_keys = [pos_keys[order], *neg_keys]
    q_pairs, a_sorted = anchors[owner[order]], a_keys[order]

    loss = torch.zeros((), dtype=torch.float64, device=device)
    acc = torch.float64 if anchors.dtype == torch.float64 else torch.float32  # gradients summed over calls
    g_anchors = torch.zeros(anchors.shape, dtype=acc, device=device)
    g_cols = [torch.zeros(c.shape, dtype=acc, device=device) for c in cols]
    g_scale: Tensor | None = None
    sizes = per_pair[order]
    for m in torch.unique(counts).tolist():
        span = (sizes == m).nonzero().flatten()
        o, n = int(span[0]), int(span.numel())
        opts = replace(
            base,
            row_offset=o,
            anchor_keys=a_sorted[o : o + n],
            candidate_keys=sorted_keys,
            anchors_all_keys=a_sorted,
        )
        out = _call(q_pairs[o : o + n], sorted_cols, opts, w_fwd * n / (b * m), with_grad)
        loss += out.loss.double()
        if with_grad:
            assert out.grad_anchors is not None
            g_anchors.index_add_(0, owner[order[o : o + n]], out.grad_anchors.to(g_anchors.dtype))
            g_cols[0].index_add_(0, order, out.grad_candidates[0].to(g_anchors.dtype))
            for k in range(1, len(cols)):
                g_cols[k] += out.grad_candidates[k].to(g_anchors.dtype)
            if out.grad_scale is not None:
                g_scale = out.grad_scale if g_scale is None else g_scale + out.grad_scale

    if back_terms is not None:
        back = replace(options, terms=back_terms, symmetric=False, listed_negatives=False, bank=None)
        back = replace(back, anchor_keys=None, candidate_keys=None, anchors_all_keys=None)
        by_count = torch.argsort(counts, stable=True)  # anchors by their number of positives
        firsts = counts.cumsum(0) - counts  # each row's first positive in the column
        q_sorted = anchors[by_count]
        n_sorted = counts[by_count]
        for m in torch.unique(counts).tolist():
            span = (n_sorted == m).nonzero().flatten()
            o, n = int(span[0]), int(span.numel())
            for k in range(m):
                picked = firsts[by_count[o : o + n]] + k  # the k-th positive of each of these rows
                out = _call(
                    cols[0][picked], [q_sorted], replace(back, row_offset=o), w_back * n / (b * m), with_grad
                )
                loss += out.loss.double()
                if with_grad:
                    assert out.grad_anchors is not None
                    g_cols[0].index_add_(0, picked, out.grad_anchors.to(g_anchors.dtype))
                    g_anchors.index_add_(0, by_count, out.grad_candidates[0].to(g_anchors.dtype))
                    if out.grad_scale is not None:
                        g_scale = out.grad_scale if g_scale is None else g_scale + out.grad_scale

    if not with_grad:
        return InfoNCEOutput(loss.to(acc), None, [], None, None)
    return InfoNCEOutput(
        loss.to(acc),
        g_anchors.to(anchors.dtype),
        [g.to(c.dtype) for g, c in zip(g_cols, cols)],
        None,
        g_scale,
    )
