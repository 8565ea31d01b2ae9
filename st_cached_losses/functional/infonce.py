"""Exact InfoNCE (one- and two-directional) without a ``rows x candidates`` matrix.

Two entry points share one set of kernels (:mod:`._kernels`):

* :func:`infonce` -- an autograd-capable loss (a ``torch.autograd.Function`` that saves only the
  embeddings and the per-row / per-column log-sum-exp vectors and recomputes logit tiles in backward);
* :func:`infonce_loss_and_grad` -- the loss together with its gradient wrt every embedding, for the
  cache stage of GradCache, where the loss is the last node of its own graph. The one-directional
  chunked path does it in one pass, without recomputation.

Inputs, in the notation of the shape comments:

* ``anchors``: ``(B, d)`` -- this process's rows (queries);
* ``candidates``: one ``(N, d)`` tensor or a sequence of them (the positives first, then hard
  negatives). ``N == B`` on one process; ``N == W * B`` when gathered from ``W`` ranks, with
  ``row_offset`` the index of this rank's first positive in the gathered columns;
* ``anchors_all``: ``(N, d)``, the gathered anchors, only for the symmetric loss across ranks.

Row ``i``'s loss is ``logsumexp_c(s * <q_i, c>) - s * <q_i, p_{row_offset + i}>`` over every candidate
of every column. The symmetric loss averages it with each positive's loss against the anchors.
Similarities are computed in fp32 whatever the input dtype; gradients come back in the input dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from st_cached_losses.functional._kernels import (
    LogSumExp,
    Stats,
)
from st_cached_losses.functional.checks import candidate_columns, scale_value, validate_inputs, validate_keys
from st_cached_losses.functional.directions import (
    GeneralFunction,
    Guide,
    check_general,
    reads_anchors_all,
    terms_solve,
)
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.problems import (
    Problem,
    assemble,
    build_problems,
    problem_grads,
    solve,
)
from st_cached_losses.functional.terms import TermSet

Similarity = Literal["cosine", "dot"]
LossPath = Literal["auto", "chunked", "tiled"]

#: Bytes of logit blocks the loss stage may hold at once, when neither chunk nor tile size is given.
DEFAULT_MEMORY_BUDGET = 64 * 2**20
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
        similarity: ``"cosine"`` (embeddings normalised once) or ``"dot"``.
        symmetric: also score each of this process's positives against every anchor, and average.
        anchors_all: ``(N, d)`` gathered anchors, for ``symmetric=True`` across processes.
        row_offset: index of this process's first positive in the (gathered) candidate columns.
        path: ``"chunked"`` (row chunks against all candidates; one pass for one direction),
            ``"tiled"`` (Inf-CL-style tiles in both dimensions, memory ``O((B + N) d)`` plus one tile)
            or ``"auto"`` (chunked when ``memory_budget`` allows chunks of at least 64 rows).
        chunk_size: rows per chunk for the chunked path (default: from ``memory_budget``).
        tile_size: tile side for the tiled path (default: from ``memory_budget``, at most 2048).
        memory_budget: bytes of logit blocks to hold at once when sizes are not given.
        grad_output: multiplies every gradient (the incoming gradient of the loss).
        check_finite: raise ``ValueError`` on NaN / inf embeddings (one cheap pass over the inputs).
        anchor_keys: ``(B,)`` integer keys (e.g. hashes of the token ids) of the anchors, with
            ``candidate_keys`` (one ``(N,)`` per column) and, when ``N != B`` (across processes),
            ``anchors_all_keys`` ``(N,)``, the keys of every positive's anchor; they mask false
            negatives. Pairs ``i != j`` are duplicates when their anchors' keys or their positives' keys
            are equal; then positive ``j`` is masked out of row ``i``'s softmax and, for the symmetric
            loss, anchor ``j`` out of positive ``i``'s softmax. Any candidate (hard negatives included)
            whose key equals row ``i``'s positive's is masked out of row ``i``'s softmax too. Positive
            pairs are never masked. Without ``anchor_keys`` (one-directional loss only) only equal
            positives make duplicates.
        terms: the general loss (:mod:`st_cached_losses.functional.terms`: sentence-transformers'
            ``directions`` / ``partition_mode`` / hardness options, or GIST's terms, built by
            ``mnrl_terms`` / ``gist_terms``); replaces ``symmetric``. Across processes, pass the
            gathered anchors as ``anchors_all`` when a term reads them (``terms.uses_anchors_all``).
        guide: a guide model's embeddings (GIST), for terms that are guided.

    Returns:
        :class:`InfoNCEOutput` with the mean loss and gradients of ``grad_output * loss``.
    """
    cols = _checked_columns(
        anchors, candidates, anchors_all, similarity=similarity, symmetric=symmetric, row_offset=row_offset,
        chunk_size=chunk_size, tile_size=tile_size, memory_budget=memory_budget, path=path,
        check_finite=check_finite, terms=terms, guide=guide, anchor_keys=anchor_keys, candidate_keys=candidate_keys,
    )  # fmt: skip
    if terms is not None:
        general = _general_solver(
            terms, guide, similarity, row_offset, path, chunk_size, tile_size, memory_budget
        )
        solution = general(
            anchors.detach(),
            [c.detach() for c in cols],
            scale=scale,
            anchors_all=anchors_all.detach() if anchors_all is not None else None,
            grad_output=grad_output,
            with_grad=True,
        )
        return InfoNCEOutput(*solution)
    s = scale_value(scale)
    need_scale_grad = isinstance(scale, Tensor) and scale.requires_grad
    with torch.no_grad():
        problems = build_problems(
            anchors.detach(),
            [c.detach() for c in cols],
            anchors_all.detach() if anchors_all is not None else None,
            scale=s,
            cosine=similarity == "cosine",
            symmetric=symmetric,
            row_offset=row_offset,
            path=path,
            chunk_size=chunk_size,
            tile_size=tile_size,
            memory_budget=memory_budget,
            fused=True,
            need_scale_grad=need_scale_grad,
            **validate_keys(
                anchor_keys, candidate_keys, anchors_all_keys, anchors, cols, anchors_all, symmetric
            ),
        )
        losses, grads = [], []
        for p in problems:
            loss, g, _, _ = solve(p, s, True, need_scale_grad)
            assert g is not None  # asked for
            losses.append(loss)
            grads.append(g)
        g_a, g_c, g_all, g_s = assemble(problems, grads, anchors, cols, anchors_all, float(grad_output))
    return InfoNCEOutput(
        loss=torch.stack(losses).sum().to(problems[0].rows.dtype),
        grad_anchors=g_a,
        grad_candidates=g_c,
        grad_anchors_all=g_all,
        grad_scale=g_s.to(scale.dtype) if need_scale_grad else None,  # type: ignore[union-attr]
    )


@dataclass(frozen=True)
class _Options:
    """Everything :class:`_InfoNCEFunction` needs besides the differentiable tensors, fixed at the call.

    The duplicate keys are the caller's integer tensors (references, no copies); the forward and the
    backward build the same problems from them and the saved embeddings.
    """

    cosine: bool
    symmetric: bool
    row_offset: int
    path: LossPath
    chunk_size: int | None
    tile_size: int | None
    memory_budget: int
    need_scale_grad: bool
    anchor_keys: Tensor | None = None
    candidate_keys: tuple[Tensor, ...] | None = None
    anchors_all_keys: Tensor | None = None

    def problems(
        self, scale: float, anchors: Tensor, cols: Sequence[Tensor], anchors_all: Tensor | None
    ) -> list[Problem]:
        return build_problems(
            anchors,
            list(cols),
            anchors_all,
            scale=scale,
            cosine=self.cosine,
            symmetric=self.symmetric,
            row_offset=self.row_offset,
            path=self.path,
            chunk_size=self.chunk_size,
            tile_size=self.tile_size,
            memory_budget=self.memory_budget,
            fused=False,
            need_scale_grad=self.need_scale_grad,
            anchor_keys=self.anchor_keys,
            candidate_keys=list(self.candidate_keys) if self.candidate_keys is not None else None,
            anchors_all_keys=self.anchors_all_keys,
        )


def _flat_stats(stats: Stats, pos: Tensor) -> list[Tensor]:
    """One problem's ``O(B + N)`` backward state as tensors: ``pos``, then the row (and column) LSE."""
    out = [pos, stats.lse_rows.m, stats.lse_rows.log_s]
    if stats.lse_cols is not None:
        out += [stats.lse_cols.m, stats.lse_cols.log_s]
    return out


def _unflat_stats(problems: list[Problem], flat: Sequence[Tensor]) -> list[tuple[Stats, Tensor]]:
    """Inverse of :func:`_flat_stats` over every problem (a problem has column LSE when ``w_cols > 0``)."""
    out, i = [], 0
    for p in problems:
        pos, rows = flat[i], LogSumExp(flat[i + 1], flat[i + 2])
        cols = LogSumExp(flat[i + 3], flat[i + 4]) if p.w_cols > 0 else None
        i += 5 if cols is not None else 3
        out.append((Stats(rows, cols), pos))
    return out


class _InfoNCEFunction(torch.autograd.Function):
    """Forward: one statistics pass. Saves the input embeddings (no copies) and the ``O(B + N)``
    positive logits and LSE vectors, and only when some input needs a gradient. Backward: rebuilds
    the operands from the saved inputs (the normalisation is ``O((B + N) d)``, negligible next to the
    ``O(B N d)`` tiles) and recomputes each logit tile once."""

    @staticmethod
    def forward(
        ctx: Any,
        options: _Options,
        scale: Tensor,
        anchors: Tensor,
        anchors_all: Tensor | None,
        *cols: Tensor,
    ) -> Tensor:
        s = scale_value(scale)
        problems = options.problems(s, anchors, cols, anchors_all)
        loss = torch.zeros((), dtype=torch.float64, device=anchors.device)
        state: list[Tensor] = []
        for p in problems:
            part, _, stats, pos = solve(p, s, False, False)
            loss += part
            state += _flat_stats(stats, pos)  # type: ignore[arg-type]
        if any(ctx.needs_input_grad):
            # nothing derived from the embeddings (a normalised copy in the chunked path) outlives forward
            ctx.options, ctx.s, ctx.scale_dtype = options, s, scale.dtype
            ctx.save_for_backward(anchors, anchors_all, *cols, *state)
            ctx.n_cols = len(cols)
        # fp64 inputs keep fp64 (for gradcheck); everything else is computed and returned in fp32
        return loss.to(problems[0].rows.dtype)

    @staticmethod
    @fp32_loss_stage
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        anchors, anchors_all, *rest = ctx.saved_tensors
        cols, state = rest[: ctx.n_cols], rest[ctx.n_cols :]
        need_scale_grad = ctx.needs_input_grad[1]
        problems = ctx.options.problems(ctx.s, anchors, cols, anchors_all)
        grads = [
            problem_grads(p, st, pos, ctx.s, 1.0, need_scale_grad)
            for p, (st, pos) in zip(problems, _unflat_stats(problems, state))
        ]
        g_a, g_c, g_all, g_s = assemble(problems, grads, anchors, cols, anchors_all, float(grad_loss))
        return (None, g_s.to(ctx.scale_dtype) if need_scale_grad else None, g_a, g_all, *g_c)


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
    column, ``anchors_all`` and a tensor ``scale``, each in its own dtype. Between forward and
    backward the graph holds only references to the inputs and ``O(B + N)`` positive logits and
    log-sum-exp values, nothing when no input requires grad; backward renormalises the inputs and
    recomputes each logit tile once, holding one block of logits at a time.
    """
    cols = _checked_columns(
        anchors, candidates, anchors_all, similarity=similarity, symmetric=symmetric, row_offset=row_offset,
        chunk_size=chunk_size, tile_size=tile_size, memory_budget=memory_budget, path=path,
        check_finite=check_finite, terms=terms, guide=guide, anchor_keys=anchor_keys, candidate_keys=candidate_keys,
    )  # fmt: skip
    scale_t = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), device=anchors.device)
    if terms is not None:
        general = _general_solver(
            terms, guide, similarity, row_offset, path, chunk_size, tile_size, memory_budget
        )
        return GeneralFunction.apply(general, scale_t, anchors, anchors_all, *cols)
    scale_value(scale_t)
    keys = validate_keys(anchor_keys, candidate_keys, anchors_all_keys, anchors, cols, anchors_all, symmetric)
    options = _Options(
        cosine=similarity == "cosine",
        symmetric=symmetric,
        row_offset=row_offset,
        path=path,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        need_scale_grad=scale_t.requires_grad,
        anchor_keys=keys.get("anchor_keys"),
        candidate_keys=tuple(keys["candidate_keys"]) if "candidate_keys" in keys else None,
        anchors_all_keys=keys.get("anchors_all_keys"),
    )
    return _InfoNCEFunction.apply(options, scale_t, anchors, anchors_all, *cols)


def _general_solver(
    terms: TermSet,
    guide: Guide | None,
    similarity: str,
    row_offset: int,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
) -> Any:
    """``terms_solve`` with the call's options bound (both entry points of the general loss)."""
    return functools.partial(
        terms_solve,
        terms=terms,
        cosine=similarity == "cosine",
        row_offset=row_offset,
        path=path,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        guide=guide,
    )


def _checked_columns(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    anchors_all: Tensor | None,
    *,
    terms: TermSet | None,
    guide: Guide | None,
    anchor_keys: Tensor | None,
    candidate_keys: Sequence[Tensor] | None,
    symmetric: bool,
    **options: Any,
) -> list[Tensor]:
    """Both entry points' checks of their arguments (and of the general loss's); the candidate columns."""
    cols = candidate_columns(candidates)
    validate_inputs(anchors, cols, anchors_all, symmetric=symmetric or reads_anchors_all(terms), **options)
    if terms is not None:
        check_general(terms, guide, symmetric, anchor_keys, candidate_keys, anchors, cols)
    return cols
