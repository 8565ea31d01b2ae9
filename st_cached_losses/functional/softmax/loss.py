"""Exact InfoNCE (one- and two-directional) without a ``rows x candidates`` matrix.

Every loss is a set of logit terms ([`terms`][st_cached_losses.functional.softmax.terms]): the one-directional loss is ``query_to_doc``, the
symmetric one ``query_to_doc`` and ``doc_to_query`` per direction, sentence-transformers' other options
and GIST are other term sets, and duplicate keys mask every term. Two entry points share one driver
([`local`][st_cached_losses.functional.softmax.local]) and one set of options ([`InfoNCEOptions`][st_cached_losses.functional.softmax.options.InfoNCEOptions]):

* [`infonce`][st_cached_losses.functional.softmax.loss.infonce] -- an autograd-capable loss (one ``torch.autograd.Function``: the forward computes the
  loss and keeps the inputs and each row's log-sum-exp statistics, the backward recomputes the tiles);
* [`infonce_loss_and_grad`][st_cached_losses.functional.softmax.loss.infonce_loss_and_grad] -- the loss together with its gradient wrt every embedding, for the
  cache stage of GradCache, where the loss is the last node of its own graph.

Row ``i``'s loss is ``logsumexp_c(s * <q_i, c>) - s * <q_i, p_{row_offset + i}>`` over every candidate
of every column (``N == B`` rows on one process, ``N == W * B`` gathered from ``W`` ranks). The symmetric
loss averages it with each positive's loss against the anchors. Similarities are computed in fp32
whatever the input dtype; gradients come back in the input dtype."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.checks import candidate_columns, validate_inputs
from st_cached_losses.functional.kernels.tiles import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.placement import placement
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.score import Score, Similarity
from st_cached_losses.functional.softmax.autograd import InfoNCEFunction
from st_cached_losses.functional.softmax.local import terms_solve
from st_cached_losses.functional.softmax.options import Guide, InfoNCEOptions, LossPath, LossSpec
from st_cached_losses.functional.softmax.own import (
    in_batch_negatives,
    own_candidates_infonce,
    own_candidates_loss_and_grad,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Guide",
    "InfoNCEOptions",
    "InfoNCEOutput",
    "LossPath",
    "Similarity",
    "infonce",
    "infonce_loss_and_grad",
]


@dataclass
class InfoNCEOutput:
    """What [`infonce_loss_and_grad`][st_cached_losses.functional.softmax.loss.infonce_loss_and_grad] returns. Gradients are of ``grad_output * loss``."""

    loss: Tensor  #: 0-d, detached; fp32 (fp64 for fp64 inputs)
    grad_anchors: Tensor | None  #: ``(B, d)``, the anchors' dtype (None when only the loss was asked for)
    grad_candidates: list[Tensor]  #: one ``(N, d)`` per candidate column, their dtype (empty: loss only)
    grad_anchors_all: Tensor | None  #: ``(N, d)`` when ``anchors_all`` was given
    grad_scale: Tensor | None  #: 0-d, when ``scale`` is a tensor that requires grad


@fp32_loss_stage
def infonce_loss_and_grad(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    options: InfoNCEOptions | None = None,
    *,
    grad_output: float = 1.0,
    **keywords: Any,
) -> InfoNCEOutput:
    """InfoNCE and its gradient wrt every embedding, without building a graph.

    Args:
        anchors: ``(B, d)`` anchor embeddings (this process's rows).
        candidates: ``(N, d)`` or a sequence of ``(N, d)``: positives first, then hard negatives.
            Row ``i``'s positive is ``candidates[0][row_offset + i]``; every row of every column is a
            candidate for every anchor.
        options: the loss's options, [`InfoNCEOptions`][st_cached_losses.functional.softmax.options.InfoNCEOptions]; ``keywords``, its fields, replace
            those of ``options`` (``scale=20.0, path="tiled"``).
        grad_output: multiplies every gradient (the incoming gradient of the loss).

    Returns:
        [`InfoNCEOutput`][st_cached_losses.functional.softmax.loss.InfoNCEOutput] with the mean loss and gradients of ``grad_output * loss``."""
    opts = InfoNCEOptions.of(options, keywords)
    if placement(None, in_batch=in_batch_negatives(opts)) == "own":  # each row's own candidates: B x K logits
        own = own_candidates_loss_and_grad(anchors, candidates, opts, grad_output=grad_output)
        return InfoNCEOutput(own.loss, own.grad_anchors, own.grad_candidates, None, own.grad_scale)
    with torch.no_grad():
        rows, cols, spec = _prepared(anchors, candidates, opts)
        anchors_all = opts.anchors_all.detach() if opts.anchors_all is not None else None
        solution = terms_solve(
            spec, rows.detach(), [c.detach() for c in cols], scale=opts.scale, anchors_all=anchors_all,
            grad_output=grad_output, with_grad=True,
        )  # fmt: skip
    out = InfoNCEOutput(*solution)
    if rows is not anchors:  # rows and columns carrying data of their own (XTR), maybe upcast
        if out.grad_anchors is not None:
            out.grad_anchors = spec.score.fn.without_row_data(out.grad_anchors).to(anchors.dtype)  # type: ignore[union-attr]
        given = candidate_columns(candidates)
        out.grad_candidates = [g.to(c.dtype) for g, c in zip(out.grad_candidates, given)]
    return out


@fp32_loss_stage
def infonce(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    options: InfoNCEOptions | None = None,
    **keywords: Any,
) -> Tensor:
    """Mean InfoNCE loss as an autograd-capable 0-d tensor: fp32 for fp32, bf16 and fp16 anchors
    (the similarities and log-sum-exps are computed in fp32), fp64 for fp64 anchors.

    Same arguments as [`infonce_loss_and_grad`][st_cached_losses.functional.softmax.loss.infonce_loss_and_grad], without ``grad_output``. Gradients flow to ``anchors``,
    every candidate column, ``anchors_all`` and a tensor ``scale``, each in its own dtype. When an input
    requires grad, the forward keeps the inputs and each row's ``O(B)`` log-sum-exp statistics, and the
    backward recomputes each logit tile once; without one, only the loss is computed."""
    opts = InfoNCEOptions.of(options, keywords)
    if placement(None, in_batch=in_batch_negatives(opts)) == "own":  # B x K logits, with autograd
        return own_candidates_infonce(anchors, candidates, opts)
    rows, cols, spec = _prepared(anchors, candidates, opts)
    scale = opts.scale
    scale_t = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), device=anchors.device)
    return InfoNCEFunction.apply(spec, scale_t, rows, opts.anchors_all, *cols)


def _prepared(
    anchors: Tensor, candidates: Tensor | Sequence[Tensor], opts: InfoNCEOptions
) -> tuple[Tensor, list[Tensor], LossSpec]:
    """Both entry points' checks of their inputs; the rows as the score reads them (the anchors, or for a
    score whose rows carry data computed from every column, XTR's retrieved tokens, the anchors with that
    data: built here, where every column, gathered across processes or not, is at hand), the candidate
    columns as the score reads them (XTR's carry their documents' ids) and the drivers' spec."""
    cols = candidate_columns(candidates)
    score = Score(opts.similarity)
    validate_inputs(
        anchors, cols, opts.anchors_all, symmetric=opts.uses_anchors_all, row_offset=opts.row_offset,
        check_finite=opts.check_finite, tokens=score.packed, listed=opts.listed_negatives,
    )  # fmt: skip
    spec = opts.spec(anchors, cols, score)
    rows = anchors
    with_row_data = getattr(score.fn, "with_row_data", None)
    if with_row_data is not None:
        # the columns are every process's here (gathered): their rows are numbered from 0
        cols = score.fn.with_column_data(cols)  # type: ignore[union-attr]
        rows = with_row_data(anchors, cols, opts.memory_budget)
    return rows, cols, spec
