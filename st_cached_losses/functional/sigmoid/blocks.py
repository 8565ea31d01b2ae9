"""The pairwise sigmoid loss (SigLIP) block by block: its value and its gradients in one pass, without a
``rows x candidates`` matrix and without an autograd graph.

Row ``i`` (an anchor) and column entry ``j`` (a candidate) make the logit ``u_ij = t * sim_ij + b`` and
the term ``softplus(-z_ij * u_ij) = -log sigmoid(z_ij * u_ij)``, ``z_ij = +1`` for the row's own positive and
-1 otherwise. Every pair's term is independent of the others: a block of pairs gives its loss and its
logit gradient ``G = sigmoid(u) - [positive]`` there and then (no softmax statistics to wait for), and
``G`` meets the operands in two more GEMMs, as the InfoNCE core's tiles do
([`Score.accumulate`][st_cached_losses.functional.score.Score.accumulate]). The scale's gradient is
``sum(G * sim)``, the bias's ``sum(G)``.

Numerics: every logit is computed in fp32 (fp64 for fp64 inputs); a positive's term and gradient are
taken from ``-u`` (``softplus(-u)``, ``-sigmoid(-u)``), never as a difference of nearly equal numbers;
sigmoids below ``e^-64`` are flushed to 0 (denormals would slow the CPU's GEMMs tenfold, see
``_kernels.FLUSH_BELOW``). Where every logit is known to be below
`EXP_SAFE` (cosine scores: ``u <= t + b``), ``softplus(u)`` is ``log1p(exp(u))``, two passes of vectorised
ops, 2.5x faster on a CPU than ``F.softplus`` and the same to fp32 rounding; otherwise ``F.softplus``.
Shapes: ``b`` rows in a row block, ``t`` columns in a column block."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.kernels.tiles import (
    FLUSH_BELOW,
    Operand,
    Plan,
    diagonal_entries,
    raw_grad,
    spans,
)
from st_cached_losses.functional.score import Score

__all__ = ["PairBlocks", "PairSums", "Wanted", "solve_local"]

#: sigmoids below this are flushed to exactly 0 (fp32 only; see the module's notes)
_FLUSH_SIGMOID = math.exp(FLUSH_BELOW)
#: logits below which ``exp`` cannot overflow (fp32 overflows above 88.7, fp64 above 709.8)
EXP_SAFE = {torch.float32: 80.0, torch.float64: 700.0}


@dataclass(frozen=True)
class Wanted:
    """Which gradients a call computes: wrt the embeddings, the scale, the bias."""

    embeddings: bool = True
    scale: bool = False
    bias: bool = False

    @property
    def any(self) -> bool:
        return self.embeddings or self.scale or self.bias


@dataclass
class PairSums:
    """A driver's result: the loss summed over its pairs (fp64, unweighted) and the gradients of
    ``factor * sum`` (the rows' and each column's wrt the raw embeddings, in the compute dtype; the
    scale's and the bias's, fp64), None where not wanted."""

    loss_sum: Tensor
    grad_rows: Tensor | None
    grad_cols: list[Tensor]
    grad_scale: Tensor | None
    grad_bias: Tensor | None


class PairBlocks:
    """This process's rows and the running sums of the sigmoid loss over the column blocks that visit them:
    the loss, the gradient wrt the rows (the normalised rows, before its final ``* t``), and the two sums
    the scale's and the bias's gradients are made of. The rows operand carries the scale (GEMM scores)."""

    def __init__(
        self, anchors: Tensor, score: Score, scale: float, bias: float, *, row_tile: int, col_tile: int,
        prenormalize: bool, want: Wanted,
    ) -> None:  # fmt: skip
        self.score, self.scale, self.bias, self.want = score, scale, bias, want
        self.row_tile, self.col_tile = row_tile, col_tile
        self.rows = score.operand(anchors, scale, prenormalize)
        dev, dt = anchors.device, self.rows.dtype
        self.g_rows = torch.zeros(anchors.shape, dtype=dt, device=dev) if want.embeddings else None
        self.loss = torch.zeros((), dtype=torch.float64, device=dev)
        self.g_logits = torch.zeros((), dtype=torch.float64, device=dev)  # sum(G * t * sim)
        self.g_sum = torch.zeros((), dtype=torch.float64, device=dev)  # sum(G)
        # a cosine logit is within b -/+ t (up to rounding): no sigmoid small enough to flush, no exp overflow
        self.flush = dt == torch.float32 and not (score.cosine and bias - 1.001 * scale > FLUSH_BELOW)
        self.exp_safe = score.cosine and bias + 1.001 * scale < EXP_SAFE[dt]

    def visit(self, cols: Operand, g_cols: Tensor | None, diag: int | None) -> None:
        """Score the rows against the column entries ``cols`` (``(n, d)``): add their terms to the loss and,
        as wanted, their gradients to the rows' buffer and to ``g_cols`` (``(n, d)``, wrt the normalised
        columns; None: no gradient to these columns). ``diag``: row ``i``'s positive is entry ``diag + i``;
        None when these columns hold no positive (hard negatives, a bank, another process's block)."""
        for r0, r1 in spans(self.rows.n, self.row_tile):
            q = self.rows.tile(r0, r1)  # (b, d)
            g_rows = self.g_rows[r0:r1] if self.g_rows is not None else None
            for c0, c1 in spans(cols.n, self.col_tile):
                c = cols.tile(c0, c1)  # (t, d)
                g = self._block(q, c, diagonal_entries(r0, r1, c0, c1, diag, q.device))
                if g is not None:
                    g_c = g_cols[c0:c1] if g_cols is not None else None
                    self.score.accumulate(g, q, c, g_rows, g_c, self.scale)
                del g  # before the next block is made: one block (or, with the scale, two) more otherwise

    def _block(self, q: Tensor, c: Tensor, ij: tuple[Tensor, Tensor] | None) -> Tensor | None:
        """One block's terms into the sums; its logit gradient ``G (b, t)`` when the embeddings want one."""
        logits = self.score.logits(q, c, self.scale)  # (b, d) @ (d, t): t * sim
        # the scale's gradient is sum(G * t * sim): kept apart from the biased logits (one more block), as
        # sum(G * u) - b * sum(G) would cancel (|b| >> t |sim| loses all digits)
        u = logits + self.bias if self.want.scale else logits.add_(self.bias)
        pos = None
        if ij is not None:  # the positives' terms are softplus(-u): taken out of the block's softplus(u)
            pos = u[ij]
            u[ij] = -torch.inf
            self.loss += F.softplus(-pos).sum()
        g = torch.exp(u).log1p_() if self.exp_safe else F.softplus(u)  # softplus(u), a new block
        self.loss += g.sum()
        if not self.want.any:
            return None
        torch.sigmoid(u, out=g)  # dL/du of a negative pair; the softplus block is reused
        if self.flush:
            torch.threshold_(g, _FLUSH_SIGMOID, 0.0)
        if pos is not None:
            g[ij] = -torch.sigmoid(-pos)  # of a positive: sigmoid(u) - 1, without cancellation
        if self.want.scale:
            self.g_logits += torch.vdot(g.reshape(-1), logits.reshape(-1))
        if self.want.bias:
            self.g_sum += g.sum()
        return g if self.want.embeddings else None

    def column_grad(self, cols: Operand, g: Tensor, factor: float) -> Tensor:
        """``factor`` times a column buffer filled by `visit`, wrt the raw columns, in place."""
        return raw_grad(cols, g.mul_(factor), cols.dtype, self.row_tile)

    def finish(self, factor: float) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The gradients of ``factor * loss`` wrt the raw rows (compute dtype), the scale and the bias
        (fp64)."""
        g_rows = None
        if self.g_rows is not None:
            g_rows = raw_grad(
                self.rows, self.g_rows.mul_(self.scale * factor), self.rows.dtype, self.row_tile
            )
        g_s = self.g_logits * (factor / self.scale) if self.want.scale else None  # sum(G * sim)
        g_b = self.g_sum * factor if self.want.bias else None
        return g_rows, g_s, g_b


def solve_local(
    anchors: Tensor, cols: list[Tensor], bank: Tensor | None, *, score: Score, scale: float, bias: float,
    row_offset: int, plan: Plan, factor: float, want: Wanted, grad_cols: Tensor | list[Tensor] | None = None,
) -> PairSums:  # fmt: skip
    """The rows ``anchors (B, d)`` against the candidate columns ``cols`` (``K`` of ``(N, d)``; row ``i``'s
    positive at ``cols[0][row_offset + i]``) and the negatives ``bank (n, d)``: the loss's sum and the
    gradients of ``factor * sum``; the columns' into ``grad_cols`` (``(K, N, d)``, zeros, made here when
    None). One column at a time: a chunked plan's normalised copy of a column lives only while it is
    scored."""
    prenorm = plan.path == "chunked"
    blocks = PairBlocks(
        anchors, score, scale, bias, row_tile=plan.row_tile, col_tile=plan.col_tile, prenormalize=prenorm,
        want=want,
    )  # fmt: skip
    if (
        want.embeddings and grad_cols is None
    ):  # one buffer per column: lists of negatives have their own length
        grad_cols = [torch.zeros(c.shape, dtype=blocks.rows.dtype, device=anchors.device) for c in cols]
    for k, c in enumerate(cols):
        op = score.operand(c, 1.0, prenorm)
        g = grad_cols[k] if grad_cols is not None else None
        blocks.visit(op, g, row_offset if k == 0 else None)
        if g is not None:
            blocks.column_grad(op, g, factor)
    if bank is not None and bank.shape[0]:
        blocks.visit(score.operand(bank, 1.0, prenorm), None, None)
    g_rows, g_s, g_b = blocks.finish(factor)
    g_list = list(grad_cols) if grad_cols is not None else []
    return PairSums(blocks.loss, g_rows, g_list, g_s, g_b)
