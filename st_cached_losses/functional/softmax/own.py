"""InfoNCE without in-batch negatives: each row scored against its own candidates only, its positive and its
own hard negatives (FlagEmbedding's ``no_in_batch_neg_flag``), on one process and across processes alike.

Row ``i``'s logits are ``(K,)``: ``s * sim(q_i, c_k[row_offset + i])`` for every candidate column ``k``,
with the terms' hardness penalty on each own entry, GIST's guide mask on the own hard negatives (never the
positive), the duplicate keys' mask (a hard negative equal to the row's own positive) and a false-negative
filter ([`FalseNegativeFilter`][st_cached_losses.functional.softmax.options.FalseNegativeFilter]). The loss is the
mean of ``logsumexp_k - logit_0``. Nothing of size ``B x B`` is computed: the logits are ``B x K``, made by
``K`` row-wise products (cosine: each side normalised once), so the loss and its gradients (through autograd
on this small graph) cost ``O(B K d)``. No other process's rows are read: across processes nothing is
gathered, and each process returns its share of the global mean (``W / B_global * sum of its rows``,
[`parallel`][st_cached_losses.functional.softmax.parallel]'s weighting).

A term set says it is of this kind with ``in_batch=False`` ([`TermSet`][st_cached_losses.functional.softmax.terms.TermSet]); the
entry points ([`infonce`][st_cached_losses.functional.softmax.loss.infonce], [`infonce_loss_and_grad`][st_cached_losses.functional.softmax.loss.infonce_loss_and_grad],
[`loss_and_grad`][st_cached_losses.functional.softmax.parallel.loss_and_grad], [`gathered_infonce`][st_cached_losses.functional.softmax.parallel.gathered_infonce]) send it here,
and the tile drivers refuse it. Only the terms of a row's query against the candidate columns (``"q"`` rows,
``"c<k>"`` columns) are read: the others score a row against other rows, which this loss has none of."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.checks import candidate_columns, validate_inputs
from st_cached_losses.functional.kernels.tiles import NORM_EPS
from st_cached_losses.functional.precision import accumulation_dtype, fp32_loss_stage
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.softmax.options import InfoNCEOptions
from st_cached_losses.functional.softmax.terms import Term, TermSet, positive_thresholds

__all__ = ["OwnOutput", "in_batch_negatives", "own_candidates_infonce", "own_candidates_loss_and_grad"]

#: rows per call of a similarity function (its ``(rows, rows)`` tile's diagonal is kept)
_FN_CHUNK = 256


def in_batch_negatives(options: InfoNCEOptions) -> bool:
    """Whether the options' loss has in-batch negatives (the tile drivers'), or only each row's own
    candidates (this module's)."""
    return options.terms is None or options.terms.in_batch


def _own_term(terms: TermSet, k: int) -> Term:
    found = [t for t in terms.terms if t.rows == "q" and t.cols == f"c{k}"]
    if len(found) != 1 or found[0].group != 0:
        raise ValueError(
            f"in_batch_negatives=False scores each row against its own candidates in one softmax: the terms must "
            f"hold one query term of column c{k}, got {found}."
        )
    return found[0]


def _own_logits(anchors: Tensor, cols: Sequence[Tensor], opts: InfoNCEOptions, terms: TermSet) -> Tensor:
    """``(b, K)`` logits of each row against its own candidates, with autograd to the inputs and a tensor
    scale; penalties added, masked entries at ``-inf``."""
    b, off, dtype = anchors.shape[0], opts.row_offset, accumulation_dtype(anchors)
    score = Score(opts.similarity)
    q = anchors.to(dtype)
    own = [c[off : off + b].to(dtype) for c in cols]
    if score.cosine:
        q, own = F.normalize(q, dim=-1, eps=NORM_EPS), [F.normalize(c, dim=-1, eps=NORM_EPS) for c in own]
    if score.fn is None:
        sim = torch.stack([(q * c).sum(-1) for c in own], dim=1)  # (b, K)
    else:
        sim = torch.stack([_pairwise(score, q, c) for c in own], dim=1).to(dtype)
    scale = opts.scale.to(dtype) if isinstance(opts.scale, Tensor) else float(opts.scale)
    penalty = torch.tensor(
        [_own_term(terms, k).pen_diag for k in range(len(cols))], dtype=dtype, device=q.device
    )
    logits = sim * scale + sim.detach() * penalty  # a hardness penalty: its value, without its gradient
    mask = torch.zeros_like(logits, dtype=torch.bool)
    guided = [k for k in range(1, len(cols)) if _own_term(terms, k).guided]
    if guided and opts.guide is not None:
        mask |= _guide_mask(opts, terms, b, len(cols), guided, dtype)
    if opts.candidate_keys is not None:
        keys = torch.stack([k[off : off + b] for k in opts.candidate_keys], dim=1)  # (b, K)
        mask[:, 1:] |= keys[:, 1:] == keys[:, :1]  # a hard negative that is the row's own positive
    rule = opts.false_negatives
    if rule is not None:  # the loss's own similarities judge, as on the tile path (never the positive)
        with torch.no_grad():
            plain = sim.detach()
            filtered = plain > positive_thresholds(plain[:, 0], rule.strategy, rule.gist_margin)[:, None]
            filtered[:, 0] = False
            if rule.tally is not None:
                live = ~mask
                live[:, 0] = False
                rule.tally[0] += (filtered & live).sum()
                rule.tally[1] += live.sum()
        mask = mask | filtered
    return logits.masked_fill(mask, -torch.inf)


def _pairwise(score: Score, q: Tensor, c: Tensor) -> Tensor:
    """``(b,)`` similarities of row ``i`` with row ``i`` for a function ``f(a, b) -> (len(a), len(b))``: the
    diagonals of ``(chunk, chunk)`` tiles (``O(b x chunk)``, not ``b x b``)."""
    assert score.fn is not None
    parts = []
    for r0 in range(0, q.shape[0], _FN_CHUNK):
        qi, ci = q[r0 : r0 + _FN_CHUNK], c[r0 : r0 + _FN_CHUNK]
        parts.append(Score._checked(score.fn(qi, ci), qi, ci).diagonal())
    return torch.cat(parts)


def _guide_mask(
    opts: InfoNCEOptions, terms: TermSet, b: int, k: int, guided: list[int], dtype: torch.dtype
) -> Tensor:
    """GIST's rule on the own hard negatives: removed when the guide rates them above the row's guide-rated
    positive minus the margin (ties within ``TIE_TOLERANCE`` kept, as on the tile path)."""
    assert opts.guide is not None
    off = opts.row_offset
    with torch.no_grad():
        ga = F.normalize(opts.guide.anchors.to(dtype), dim=-1, eps=NORM_EPS)
        gc = [F.normalize(c[off : off + b].to(dtype), dim=-1, eps=NORM_EPS) for c in opts.guide.candidates]
        rated = torch.stack([(ga * c).sum(-1) for c in gc], dim=1)  # (b, K)
        mask = rated > positive_thresholds(rated[:, 0], terms.margin_strategy, terms.margin)[:, None]
        keep = torch.ones(k, dtype=torch.bool, device=mask.device)
        keep[guided] = False
        mask[:, keep] = False  # the positive, and any column whose term is not guided
    return mask


def _own_mean_loss(anchors: Tensor, cols: Sequence[Tensor], opts: InfoNCEOptions) -> Tensor:
    assert opts.terms is not None
    logits = _own_logits(anchors, cols, opts, opts.terms)
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


def _checked(anchors: Tensor, candidates: Tensor | Sequence[Tensor], opts: InfoNCEOptions) -> list[Tensor]:
    cols = candidate_columns(candidates)
    if Score(opts.similarity).packed:
        raise ValueError(
            "in_batch_negatives=False scores embeddings (rows, dim): token or sparse rows are not supported."
        )
    validate_inputs(
        anchors, cols, None, symmetric=False, row_offset=opts.row_offset, check_finite=opts.check_finite
    )
    if opts.guide is not None and opts.guide.anchors.shape[0] != anchors.shape[0]:
        raise ValueError(
            f"the guide's embeddings must have the loss's rows: anchors {anchors.shape[0]}, got "
            f"{opts.guide.anchors.shape[0]}."
        )
    return cols


@fp32_loss_stage
def own_candidates_infonce(
    anchors: Tensor, candidates: Tensor | Sequence[Tensor], options: InfoNCEOptions, factor: float = 1.0
) -> Tensor:
    """The mean loss of each row against its own candidates (times ``factor``), with autograd to the
    embeddings and a tensor scale; ``(B, d)`` anchors, ``(N, d)`` columns whose rows ``row_offset`` onwards
    are the anchors' own."""
    cols = _checked(anchors, candidates, options)
    loss = _own_mean_loss(anchors, cols, options) * factor
    return loss.to(torch.float64 if anchors.dtype == torch.float64 else torch.float32)


class OwnOutput:
    """``(loss, grad_anchors, grad_candidates, grad_scale)`` of [`own_candidates_loss_and_grad`][st_cached_losses.functional.softmax.own.own_candidates_loss_and_grad]:
    the gradients of ``grad_output * loss`` in the inputs' dtypes (a column's rows other than the own ones get
    zeros), the scale's None unless it is a tensor that requires grad."""

    def __init__(
        self,
        loss: Tensor,
        grad_anchors: Tensor | None,
        grad_candidates: list[Tensor],
        grad_scale: Tensor | None,
    ) -> None:
        self.loss, self.grad_anchors, self.grad_candidates = loss, grad_anchors, grad_candidates
        self.grad_scale = grad_scale


@fp32_loss_stage
def own_candidates_loss_and_grad(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    options: InfoNCEOptions,
    *,
    factor: float = 1.0,
    grad_output: float = 1.0,
    with_grad: bool = True,
) -> OwnOutput:
    """The loss (times ``factor``) without a graph and, with ``with_grad``, its gradients wrt the anchors,
    every candidate column and a tensor scale (through autograd on the ``(B, K)`` logits only)."""
    cols = _checked(anchors, candidates, options)
    if not with_grad:
        with torch.no_grad():
            return OwnOutput(_own_mean_loss(anchors, cols, options).detach() * factor, None, [], None)
    leaves = [anchors.detach().requires_grad_(), *(c.detach().requires_grad_() for c in cols)]
    scale = options.scale
    wants_scale = isinstance(scale, Tensor) and scale.requires_grad
    with torch.enable_grad():
        loss = _own_mean_loss(leaves[0], leaves[1:], options) * factor
        inputs = [*leaves, scale] if wants_scale else leaves
        grads = torch.autograd.grad(loss * grad_output, inputs)  # type: ignore[arg-type]
    grad_scale = grads[-1] if wants_scale else None
    dtype = torch.float64 if anchors.dtype == torch.float64 else torch.float32
    return OwnOutput(loss.detach().to(dtype), grads[0], list(grads[1 : 1 + len(cols)]), grad_scale)
