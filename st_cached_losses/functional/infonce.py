"""Exact InfoNCE (one- and two-directional) without a ``rows x candidates`` matrix.

Every loss is a set of logit terms (:mod:`.terms`): the one-directional loss is ``query_to_doc``, the
symmetric one ``query_to_doc`` and ``doc_to_query`` per direction, sentence-transformers' other options
and GIST are other term sets, and duplicate keys mask every term. Two entry points share one driver
(:mod:`.local`):

* :func:`infonce` -- an autograd-capable loss (one ``torch.autograd.Function`` that computes the
  gradients with the loss and keeps them, the inputs' size, until backward);
* :func:`infonce_loss_and_grad` -- the loss together with its gradient wrt every embedding, for the
  cache stage of GradCache, where the loss is the last node of its own graph.

The inputs are :func:`infonce_loss_and_grad`'s arguments: ``anchors (B, d)``, candidate columns ``(N, d)``
(``N == B`` on one process, ``N == W * B`` gathered from ``W`` ranks).

Row ``i``'s loss is ``logsumexp_c(s * <q_i, c>) - s * <q_i, p_{row_offset + i}>`` over every candidate
of every column. The symmetric loss averages it with each positive's loss against the anchors.
Similarities are computed in fp32 whatever the input dtype; gradients come back in the input dtype.
``similarity`` is ``"cosine"``, ``"dot"`` or any function ``f(a, b) -> (len(a), len(b))`` (:mod:`.score`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from st_cached_losses.functional._kernels import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.autograd import InfoNCEFunction
from st_cached_losses.functional.checks import candidate_columns, validate_inputs, validate_keys
from st_cached_losses.functional.local import terms_solve
from st_cached_losses.functional.options import Guide, Keys, LossSpec
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.score import Score, Similarity
from st_cached_losses.functional.terms import TermSet, mnrl_terms

LossPath = Literal["auto", "chunked", "tiled"]

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Guide",
    "InfoNCEOutput",
    "LossPath",
    "Similarity",
    "infonce",
    "infonce_loss_and_grad",
]


@dataclass
class InfoNCEOutput:
    """What :func:`infonce_loss_and_grad` returns. Gradients are of ``grad_output * loss``."""

    loss: Tensor  #: 0-d, detached; fp32 (fp64 for fp64 inputs)
    grad_anchors: Tensor | None  #: ``(B, d)``, the anchors' dtype (None when only the loss was asked for)
    grad_candidates: list[Tensor]  #: one ``(N, d)`` per candidate column, their dtype (empty: loss only)
    grad_anchors_all: Tensor | None  #: ``(N, d)`` when ``anchors_all`` was given
    grad_scale: Tensor | None  #: 0-d, when ``scale`` is a tensor that requires grad


def loss_terms(terms: TermSet | None, symmetric: bool, n_columns: int) -> TermSet:
    """The call's terms: the given ones, or the one-directional / symmetric loss's."""
    if terms is not None:
        return terms
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    return mnrl_terms(directions, "per_direction", None, 0.0, n_columns)


# --------------------------------------------------------------------------- public API


@fp32_loss_stage
def infonce_loss_and_grad(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    *,
    scale: float | Tensor = 20.0,
    similarity: Similarity = "cosine",
    symmetric: bool = False,
    anchors_all: Tensor | None = None,
    row_offset: int = 0,
    path: LossPath = "auto",
    chunk_size: int | None = None,
    tile_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    grad_output: float = 1.0,
    check_finite: bool = True,
    anchor_keys: Tensor | None = None,
    candidate_keys: Sequence[Tensor] | None = None,
    anchors_all_keys: Tensor | None = None,
    terms: TermSet | None = None,
    guide: Guide | None = None,
) -> InfoNCEOutput:
    """InfoNCE and its gradient wrt every embedding, without building a graph.

    Args:
        anchors: ``(B, d)`` anchor embeddings (this process's rows).
        candidates: ``(N, d)`` or a sequence of ``(N, d)``: positives first, then hard negatives.
            Row ``i``'s positive is ``candidates[0][row_offset + i]``; every row of every column is a
            candidate for every anchor.
        scale: ``1 / temperature``; a float or a 0-d tensor (its gradient is returned if it requires grad).
        similarity: ``"cosine"`` (embeddings normalised once), ``"dot"``, or a function
            ``f(a (b, d), c (t, d)) -> (b, t)`` scored exactly tile by tile through autograd (slower).
        symmetric: also score each of this process's positives against every anchor, and average.
        anchors_all: ``(N, d)`` gathered anchors, for ``symmetric=True`` across processes.
        row_offset: index of this process's first positive in the (gathered) candidate columns.
        path: ``"chunked"`` (row chunks against all candidates; one pass unless a softmax runs down the
            columns), ``"tiled"`` (Inf-CL-style tiles in both dimensions, memory ``O((B + N) d)`` plus a
            few tiles) or ``"auto"`` (chunked when ``memory_budget`` allows chunks of at least 64 rows).
        chunk_size: rows per chunk for the chunked path (default: from ``memory_budget``).
        tile_size: tile side for the tiled path (default: from ``memory_budget``, at most 2048).
        memory_budget: bytes of logit blocks to hold at once when sizes are not given.
        grad_output: multiplies every gradient (the incoming gradient of the loss).
        check_finite: raise ``ValueError`` on NaN / inf embeddings (one cheap pass over the inputs).
        anchor_keys: ``(B,)`` integer keys (e.g. hashes of the token ids) of the anchors, with
            ``candidate_keys`` (one ``(N,)`` per column) and, when ``N != B`` (across processes),
            ``anchors_all_keys`` ``(N,)``, the keys of every positive's anchor; they mask false
            negatives in every term. Pairs ``i != j`` are duplicates when their anchors' keys or their
            positives' keys are equal; then pair ``j``'s entries (its positive, its anchor) are masked
            out of row ``i``'s softmaxes, and any hard negative whose key equals row ``i``'s positive's
            too. A row's own pair is never masked. Without ``anchor_keys`` only equal positives make
            duplicates.
        terms: the loss as logit terms (:mod:`st_cached_losses.functional.terms`: sentence-transformers'
            ``directions`` / ``partition_mode`` / hardness options, or GIST's terms, built by
            ``mnrl_terms`` / ``gist_terms``); replaces ``symmetric``. Across processes, pass the
            gathered anchors as ``anchors_all`` when a term reads them (``terms.uses_anchors_all``).
        guide: a guide model's embeddings (GIST), for terms that are guided.

    Returns:
        :class:`InfoNCEOutput` with the mean loss and gradients of ``grad_output * loss``.
    """
    with torch.no_grad():
        rows, cols, spec = _prepared(**locals())  # first: the arguments only
        solution = terms_solve(
            spec,
            rows.detach(),
            [c.detach() for c in cols],
            scale=scale,
            anchors_all=anchors_all.detach() if anchors_all is not None else None,
            grad_output=grad_output,
            with_grad=True,
        )
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
    *,
    scale: float | Tensor = 20.0,
    similarity: Similarity = "cosine",
    symmetric: bool = False,
    anchors_all: Tensor | None = None,
    row_offset: int = 0,
    path: LossPath = "auto",
    chunk_size: int | None = None,
    tile_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    check_finite: bool = True,
    anchor_keys: Tensor | None = None,
    candidate_keys: Sequence[Tensor] | None = None,
    anchors_all_keys: Tensor | None = None,
    terms: TermSet | None = None,
    guide: Guide | None = None,
) -> Tensor:
    """Mean InfoNCE loss as an autograd-capable 0-d tensor: fp32 for fp32, bf16 and fp16 anchors
    (the similarities and log-sum-exps are computed in fp32), fp64 for fp64 anchors.

    Same arguments as :func:`infonce_loss_and_grad`. Gradients flow to ``anchors``, every candidate
    column, ``anchors_all`` and a tensor ``scale``, each in its own dtype. When an input requires grad,
    the forward computes the gradients with the loss (nothing is recomputed) and the graph keeps them,
    the inputs' size, until backward; without one, only the loss is computed.
    """
    rows, cols, spec = _prepared(**locals())  # first: the arguments only
    scale_t = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), device=anchors.device)
    return InfoNCEFunction.apply(spec, scale_t, rows, anchors_all, *cols)


def _prepared(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    anchors_all: Tensor | None,
    *,
    similarity: Similarity,
    symmetric: bool,
    row_offset: int,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    check_finite: bool,
    terms: TermSet | None,
    guide: Guide | None,
    anchor_keys: Tensor | None,
    candidate_keys: Sequence[Tensor] | None,
    anchors_all_keys: Tensor | None,
    **_: object,  # the entry point's other arguments (scale, grad_output)
) -> tuple[Tensor, list[Tensor], LossSpec]:
    """Both entry points' checks of their arguments (all of them, by name); the rows as the score reads
    them (the anchors, or for a score whose rows carry data computed from every column, XTR's retrieved
    tokens, the anchors with that data: built here, where every column, gathered across processes or not,
    is at hand), the candidate columns as the score reads them (XTR's carry their documents' ids) and the
    call's options."""
    cols = candidate_columns(candidates)
    score = Score(similarity)
    check_terms(terms, symmetric, guide, anchors, cols)
    validate_inputs(
        anchors, cols, anchors_all, symmetric=symmetric or (terms is not None and terms.uses_anchors_all),
        row_offset=row_offset, chunk_size=chunk_size, tile_size=tile_size, memory_budget=memory_budget,
        path=path, check_finite=check_finite, tokens=score.packed,
    )  # fmt: skip
    validate_keys(anchor_keys, candidate_keys, anchors_all_keys, anchors, cols, anchors_all, symmetric)
    keys = Keys(anchor_keys, list(candidate_keys), anchors_all_keys) if candidate_keys is not None else None
    term_set = loss_terms(terms, symmetric, len(cols))
    rows = anchors
    with_row_data = getattr(score.fn, "with_row_data", None)
    if with_row_data is not None:
        check_row_data_terms(score, term_set)
        # the columns are every process's here (gathered): their rows are numbered from 0
        cols = score.fn.with_column_data(cols)  # type: ignore[union-attr]
        rows = with_row_data(anchors, cols, memory_budget)
    spec = LossSpec(
        terms=term_set, score=score, row_offset=row_offset, path=path, chunk_size=chunk_size,
        tile_size=tile_size, memory_budget=memory_budget, guide=guide, keys=keys,
    )  # fmt: skip
    return rows, cols, spec


def check_row_data_terms(score: Score, terms: TermSet) -> None:
    """A score whose rows carry data computed from every column (XTR's retrieved tokens) scores the anchors
    against the candidate columns only."""
    if any(t.rows != "q" or not t.cols.startswith("c") for t in terms.terms):
        raise ValueError(
            f"{score.fn!r} scores queries against documents only (its top-k runs over the document "
            "columns' tokens): the loss's terms may score only the anchors against the candidate columns "
            "(query_to_doc), not documents against anchors."
        )


def check_terms(
    terms: TermSet | None, symmetric: bool, guide: Guide | None, anchors: Tensor, cols: list[Tensor]
) -> None:
    """Terms replace ``symmetric``; a guide (GIST) comes with guided terms, and has the loss's rows."""
    if terms is not None and symmetric:
        raise ValueError("pass either terms or symmetric=True, not both: terms say every direction.")
    if (terms is not None and terms.guided) != (guide is not None):
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
