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
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from st_cached_losses.functional._kernels import (
    DuplicateKeys,
    Grads,
    LogSumExp,
    Operand,
    Stats,
    fused_one_direction,
    gradients,
    infonce_from_stats,
    positive_logits,
    raw_grad,
    row_col_stats,
)
from st_cached_losses.functional.checks import check_positive_int, nonfinite_error, scale_value

Similarity = Literal["cosine", "dot"]
LossPath = Literal["auto", "chunked", "tiled"]

#: Bytes of logit blocks the loss stage may hold at once, when neither chunk nor tile size is given.
DEFAULT_MEMORY_BUDGET = 64 * 2**20
#: Largest tile side the tiled path picks on its own.
MAX_TILE = 2048
#: The chunked path is chosen by ``path="auto"`` when the budget allows chunks of at least this many rows.
MIN_AUTO_CHUNK = 64

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
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


@dataclass(frozen=True)
class _Plan:
    path: Literal["chunked", "tiled"]
    row_tile: int
    col_tile: int


@dataclass
class _Problem:
    """One directional sub-problem: ``rows`` against ``cols``; positives at ``cols[0][row_offset + i]``."""

    rows: Operand
    cols: list[Operand]
    row_offset: int
    w_rows: float
    w_cols: float  # > 0: also the direction "positive of column 0 -> every row" (shared tiles)
    plan: _Plan
    keys: DuplicateKeys | None = None


# --------------------------------------------------------------------------- validation


def _columns(candidates: Tensor | Sequence[Tensor]) -> list[Tensor]:
    if isinstance(candidates, Tensor):
        return [candidates]
    cols = list(candidates)
    if not cols:
        raise ValueError("candidates is empty: pass at least the positives, a (N, d) tensor.")
    return cols


def _validate(
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    *,
    similarity: str,
    symmetric: bool,
    row_offset: int,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    path: str,
    check_finite: bool,
) -> None:
    if similarity not in ("cosine", "dot"):
        raise ValueError(f"similarity must be 'cosine' or 'dot', got {similarity!r}.")
    if path not in ("auto", "chunked", "tiled"):
        raise ValueError(f"path must be 'auto', 'chunked' or 'tiled', got {path!r}.")
    check_positive_int("chunk_size", chunk_size)
    check_positive_int("tile_size", tile_size)
    check_positive_int("memory_budget", memory_budget)
    named = [("anchors", anchors)] + [(f"candidates[{k}]", c) for k, c in enumerate(cols)]
    if anchors_all is not None:
        named.append(("anchors_all", anchors_all))
    for name, t in named:
        if not isinstance(t, Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D (rows, dim) tensor of embeddings, got {shape}.")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}.")
        if t.shape[0] == 0:
            raise ValueError(
                f"{name} is empty (0 rows): the loss needs at least one pair; skip empty batches."
            )
        if t.device != anchors.device:
            raise ValueError(
                f"{name} is on {t.device} but anchors are on {anchors.device}; move them to one device."
            )
    dim = anchors.shape[1]
    for name, t in named[1:]:
        if t.shape[1] != dim:
            raise ValueError(
                f"{name} has embedding dim {t.shape[1]} but anchors have {dim}: every column must come from "
                "encoders with the same output dimension."
            )
    n = cols[0].shape[0]
    for k, c in enumerate(cols[1:], start=1):
        if c.shape[0] != n:
            raise ValueError(
                f"candidates[{k}] has {c.shape[0]} rows but the positives have {n}: every candidate column "
                "(positives, then each hard-negative column) needs one row per positive."
            )
    b = anchors.shape[0]
    if (
        isinstance(row_offset, bool)
        or not isinstance(row_offset, int)
        or row_offset < 0
        or row_offset + b > n
    ):
        raise ValueError(
            f"row_offset={row_offset!r} puts the positives of the {b} anchors at candidate rows "
            f"{row_offset}..{row_offset + b - 1 if isinstance(row_offset, int) else '?'}, outside the {n} candidate "
            "rows; pass the index of this process's first row within the gathered columns (0 on one process)."
        )
    if symmetric:
        if anchors_all is None and (n != b or row_offset != 0):
            raise ValueError(
                f"the symmetric loss scores every positive against every anchor, but {n} positives were given "
                f"for {b} anchors (row_offset={row_offset}); pass anchors_all=<the gathered (N, d) anchors>."
            )
        if anchors_all is not None and anchors_all.shape[0] != n:
            raise ValueError(
                f"anchors_all has {anchors_all.shape[0]} rows but there are {n} positives: gather anchors and "
                "positives the same way."
            )
    elif anchors_all is not None:
        raise ValueError("anchors_all is only used by the symmetric loss; pass symmetric=True or drop it.")
    if check_finite:
        for name, t in named:
            if not bool(torch.isfinite(t).all()):
                raise nonfinite_error(name)


def _keys(
    anchor_keys: Tensor | None,
    candidate_keys: Sequence[Tensor] | None,
    anchors_all_keys: Tensor | None,
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    symmetric: bool,
) -> dict[str, Any]:
    """Validate the duplicate keys against the embeddings they describe."""
    if candidate_keys is None:
        if anchor_keys is not None or anchors_all_keys is not None:
            raise ValueError(
                "anchor_keys / anchors_all_keys need candidate_keys (one key vector per column) too."
            )
        return {}
    cand = list(candidate_keys)
    if len(cand) != len(cols):
        raise ValueError(
            f"candidate_keys has {len(cand)} key vectors for {len(cols)} candidate columns; pass one per column."
        )
    named = [(f"candidate_keys[{k}]", key, c.shape[0]) for k, (key, c) in enumerate(zip(cand, cols))]
    n_pos = cols[0].shape[0]
    if symmetric and anchor_keys is None:
        raise ValueError(
            "the symmetric loss masks duplicate anchors too: pass anchor_keys with candidate_keys."
        )
    if anchor_keys is not None:
        named.append(("anchor_keys", anchor_keys, anchors.shape[0]))
        # pairs are compared by their anchors too, so every positive's anchor needs a key
        if anchors_all_keys is None and (anchors_all is not None or n_pos != anchors.shape[0]):
            raise ValueError(
                f"anchor_keys with {n_pos} gathered candidate rows: pass anchors_all_keys, the ({n_pos},) "
                "keys of the anchors of every positive (gathered like the candidates)."
            )
    if anchors_all_keys is not None:
        if anchor_keys is None:
            raise ValueError("anchors_all_keys needs anchor_keys (this process's anchors' keys) too.")
        named.append(("anchors_all_keys", anchors_all_keys, n_pos))
    for name, key, n in named:
        if not isinstance(key, Tensor) or key.dim() != 1 or key.shape[0] != n or key.is_floating_point():
            raise ValueError(
                f"{name} must be a 1-D integer tensor with {n} entries (one key per embedding row)."
            )
    return {"anchor_keys": anchor_keys, "candidate_keys": cand, "anchors_all_keys": anchors_all_keys}


# --------------------------------------------------------------------------- planning


def _plan(
    n_rows: int,
    n_cols: int,
    k: int,
    *,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    buffers: int,
) -> _Plan:
    """Pick the path and block sizes: ``buffers`` fp32 blocks of ``rows x candidates-in-block`` live at once."""
    row_bytes = 4 * buffers * k * n_cols
    if path == "auto":
        if chunk_size is not None:
            path = "chunked"
        elif tile_size is not None:
            path = "tiled"
        else:
            path = "chunked" if memory_budget // row_bytes >= min(n_rows, MIN_AUTO_CHUNK) else "tiled"
    if path == "chunked":
        chunk = chunk_size if chunk_size is not None else max(1, memory_budget // row_bytes)
        return _Plan("chunked", min(chunk, n_rows), n_cols)
    tile = tile_side(tile_size, memory_budget, buffers)
    return _Plan("tiled", min(tile, n_rows), min(tile, n_cols))


def tile_side(tile_size: int | None, memory_budget: int, buffers: int) -> int:
    """The side of a square tile: ``tile_size`` if given, else the largest (up to ``MAX_TILE``) for which
    ``buffers`` fp32 tiles fit in ``memory_budget`` bytes."""
    if tile_size is not None:
        return tile_size
    return min(MAX_TILE, max(1, math.isqrt(memory_budget // (4 * buffers))))


# --------------------------------------------------------------------------- assembly


def _problems(
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    *,
    scale: float,
    cosine: bool,
    symmetric: bool,
    row_offset: int,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    fused: bool,
    need_scale_grad: bool,
    anchor_keys: Tensor | None = None,
    candidate_keys: list[Tensor] | None = None,
    anchors_all_keys: Tensor | None = None,
) -> list[_Problem]:
    b, n, k = anchors.shape[0], cols[0].shape[0], len(cols)
    # blocks alive at once: the fused one-directional pass keeps one (plus a copy for the scale's
    # gradient); the two-pass path keeps the logits, the gradient block and a scratch block.
    one_pass = fused and not (symmetric and anchors_all is None)
    buffers = (2 if need_scale_grad else 1) if one_pass else 3
    sizing = functools.partial(
        _plan,
        path=path,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        buffers=buffers,
    )
    plan = sizing(b, n, k)
    prenorm = plan.path == "chunked"
    rows = Operand(anchors, cosine, scale, prenorm)
    col_ops = [Operand(c, cosine, 1.0, prenorm) for c in cols]
    keys = back_keys = None
    if candidate_keys is not None:
        # pairs sharing an anchor or a positive are duplicates in both directions (see DuplicateKeys)
        all_anchor_keys = anchors_all_keys if anchors_all_keys is not None else anchor_keys
        row_pos = candidate_keys[0][row_offset : row_offset + b]
        keys = DuplicateKeys(row_pos, candidate_keys, anchor_keys, all_anchor_keys)
        if all_anchor_keys is not None and anchor_keys is not None:
            # positives -> anchors: the rows are this rank's positives, their targets the anchors
            back_keys = DuplicateKeys(anchor_keys, [all_anchor_keys], row_pos, candidate_keys[0])
    if not symmetric:
        return [_Problem(rows, col_ops, row_offset, 1.0 / b, 0.0, plan, keys)]
    if anchors_all is None:  # one process: both directions share every logit tile
        return [_Problem(rows, col_ops, 0, 0.5 / b, 0.5 / n, plan, keys)]
    # across ranks: this rank's positives against every rank's anchors is a second one-way problem
    pos_rows = Operand(cols[0][row_offset : row_offset + b], cosine, scale, prenorm)
    plan2 = sizing(b, n, 1)
    back = _Problem(
        pos_rows, [Operand(anchors_all, cosine, 1.0, prenorm)], row_offset, 0.5 / b, 0.0, plan2, back_keys
    )
    return [_Problem(rows, col_ops, row_offset, 0.5 / b, 0.0, plan, keys), back]


def _loss_from_stats(p: _Problem, stats: Stats, pos: Tensor) -> Tensor:
    return infonce_from_stats(stats.lse_rows, stats.lse_cols, pos, p.w_rows, p.w_cols)


def _solve(
    p: _Problem, scale: float, need_grads: bool, need_scale_grad: bool
) -> tuple[Tensor, Grads | None, Stats | None, Tensor]:
    """Loss (fp64) and, if asked, gradients of one problem; also what backward would need."""
    pos = positive_logits(p.rows, p.cols[0], p.row_offset, p.plan.row_tile)
    if need_grads and p.plan.path == "chunked" and p.w_cols == 0.0:
        loss, grads = fused_one_direction(
            p.rows,
            p.cols,
            pos,
            scale=scale,
            weight=p.w_rows,
            row_offset=p.row_offset,
            chunk=p.plan.row_tile,
            need_scale_grad=need_scale_grad,
            keys=p.keys,
        )
        return loss, grads, None, pos
    stats = row_col_stats(
        p.rows,
        p.cols,
        column_direction=p.w_cols > 0,
        row_tile=p.plan.row_tile,
        col_tile=p.plan.col_tile,
        row_offset=p.row_offset,
        keys=p.keys,
    )
    two_pass = _grads(p, stats, pos, scale, 1.0, need_scale_grad) if need_grads else None
    return _loss_from_stats(p, stats, pos), two_pass, stats, pos


def _grads(
    p: _Problem, stats: Stats, pos: Tensor, scale: float, grad_output: float, need_scale_grad: bool
) -> Grads:
    return gradients(
        p.rows,
        p.cols,
        stats,
        pos,
        scale=scale,
        w_rows=p.w_rows * grad_output,
        w_cols=p.w_cols * grad_output,
        row_offset=p.row_offset,
        row_tile=p.plan.row_tile,
        col_tile=p.plan.col_tile,
        need_scale_grad=need_scale_grad,
        keys=p.keys,
    )


def _assemble(
    problems: list[_Problem],
    grads: list[Grads],
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    grad_output: float,
) -> tuple[Tensor, list[Tensor], Tensor | None, Tensor]:
    """Map each problem's gradients back onto the caller's tensors (raw, in their dtypes)."""
    main, g_main = problems[0], grads[0]
    tile = main.plan.row_tile
    g_cols = g_main.cols
    scale_grad = g_main.scale * grad_output
    g_all = None
    if len(problems) == 2:
        back, g_back = problems[1], grads[1]
        # the back problem's rows are this rank's slice of the positives (same normalisation)
        g_cols[0][back.row_offset : back.row_offset + back.rows.n].add_(g_back.rows)
        g_all = raw_grad(back.cols[0], g_back.cols[0].mul_(grad_output), anchors_all.dtype, tile)  # type: ignore[union-attr]
        scale_grad = scale_grad + g_back.scale * grad_output
    g_anchors = raw_grad(main.rows, g_main.rows.mul_(grad_output), anchors.dtype, tile)
    g_candidates = [
        raw_grad(op, g.mul_(grad_output), c.dtype, tile) for op, g, c in zip(main.cols, g_cols, cols)
    ]
    return g_anchors, g_candidates, g_all, scale_grad


# --------------------------------------------------------------------------- public API


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

    Returns:
        :class:`InfoNCEOutput` with the mean loss and gradients of ``grad_output * loss``.
    """
    cols = _columns(candidates)
    _validate(
        anchors,
        cols,
        anchors_all,
        similarity=similarity,
        symmetric=symmetric,
        row_offset=row_offset,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        path=path,
        check_finite=check_finite,
    )
    s = scale_value(scale)
    need_scale_grad = isinstance(scale, Tensor) and scale.requires_grad
    with torch.no_grad():
        problems = _problems(
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
            **_keys(anchor_keys, candidate_keys, anchors_all_keys, anchors, cols, anchors_all, symmetric),
        )
        losses, grads = [], []
        for p in problems:
            loss, g, _, _ = _solve(p, s, True, need_scale_grad)
            assert g is not None  # asked for
            losses.append(loss)
            grads.append(g)
        g_a, g_c, g_all, g_s = _assemble(problems, grads, anchors, cols, anchors_all, float(grad_output))
    return InfoNCEOutput(
        loss=sum(losses).to(problems[0].rows.dtype),  # type: ignore[union-attr]
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
    ) -> list[_Problem]:
        return _problems(
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


def _unflat_stats(problems: list[_Problem], flat: Sequence[Tensor]) -> list[tuple[Stats, Tensor]]:
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
            part, _, stats, pos = _solve(p, s, False, False)
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
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        anchors, anchors_all, *rest = ctx.saved_tensors
        cols, state = rest[: ctx.n_cols], rest[ctx.n_cols :]
        need_scale_grad = ctx.needs_input_grad[1]
        problems = ctx.options.problems(ctx.s, anchors, cols, anchors_all)
        grads = [
            _grads(p, st, pos, ctx.s, 1.0, need_scale_grad)
            for p, (st, pos) in zip(problems, _unflat_stats(problems, state))
        ]
        g_a, g_c, g_all, g_s = _assemble(problems, grads, anchors, cols, anchors_all, float(grad_loss))
        return (None, g_s.to(ctx.scale_dtype) if need_scale_grad else None, g_a, g_all, *g_c)


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
) -> Tensor:
    """Mean InfoNCE loss as an autograd-capable 0-d tensor: fp32 for fp32, bf16 and fp16 anchors
    (the similarities and log-sum-exps are computed in fp32), fp64 for fp64 anchors.

    Same arguments as :func:`infonce_loss_and_grad`. Gradients flow to ``anchors``, every candidate
    column, ``anchors_all`` and a tensor ``scale``, each in its own dtype. Between forward and
    backward the graph holds only references to the inputs and ``O(B + N)`` positive logits and
    log-sum-exp values, nothing when no input requires grad; backward renormalises the inputs and
    recomputes each logit tile once, holding one block of logits at a time.
    """
    cols = _columns(candidates)
    _validate(
        anchors,
        cols,
        anchors_all,
        similarity=similarity,
        symmetric=symmetric,
        row_offset=row_offset,
        chunk_size=chunk_size,
        tile_size=tile_size,
        memory_budget=memory_budget,
        path=path,
        check_finite=check_finite,
    )
    scale_t = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), device=anchors.device)
    scale_value(scale_t)
    keys = _keys(anchor_keys, candidate_keys, anchors_all_keys, anchors, cols, anchors_all, symmetric)
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
