"""Blockwise InfoNCE kernels: statistics, gradients, and the fused one-pass loss-and-gradient.

Everything here works on *prepared operands* (embeddings already validated, with the similarity's
normalisation and the scale folded in per tile) and returns gradients with respect to the
**normalised** embeddings. :mod:`st_cached_losses.functional.infonce` turns them into gradients of
the raw embeddings. Nothing of size ``rows x candidates`` is ever held beyond one block.

Notation used in the shape comments: ``b`` rows in a row tile, ``t`` candidates in a column tile,
``d`` the embedding dimension, ``N`` the rows of one candidate column, ``K`` the number of columns.

The loss is ``w_r * sum_i (lse_r[i] - pos[i]) + w_c * sum_j (lse_c[j] - pos[j])`` where
``lse_r[i] = logsumexp_c S[i, c]`` over every candidate of every column, ``lse_c[j]`` (symmetric
loss only) is the log-sum-exp of positive ``j`` against every row, and ``pos[i] = S[i, row_offset + i]``.
Its gradient wrt the logits is ``w_r * (P_r - Y) + w_c * (P_c - Y)``. The one-hot ``Y`` is subtracted
inside the logit block, before the block meets the embeddings in a GEMM: where the positive's
probability is close to 1, ``P - Y`` is small, and forming it first keeps the cancellation in one
fp32 number rather than in the d-dimensional products (as accurate as the naive dense gradient).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

NORM_EPS = 1e-12


class Operand:
    """An embedding matrix ``x (n, d)`` whose tiles come out as fp32, normalised and scaled.

    With ``prenormalize=True`` one fp32 copy is made up front (the chunked path, where each chunk
    spans whole columns and re-normalising them per chunk would repeat work); otherwise only the
    per-row multipliers (``mult / ||x_i||``) are stored and each tile is normalised when it is read,
    so memory stays ``O(n)`` beyond the input (the tiled path).
    """

    def __init__(self, x: Tensor, cosine: bool, mult: float, prenormalize: bool) -> None:
        self.x = x
        self.n = x.shape[0]
        # fp32 accumulation for half types; fp64 stays fp64 (for gradcheck)
        self.dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.cosine = cosine
        # (n,) fp32: 1 / max(||x_i||, eps), the same clamp as F.normalize
        self.inv_norm = (
            torch.linalg.vector_norm(x, dim=1, dtype=self.dtype).clamp_min_(NORM_EPS).reciprocal_()
            if cosine
            else None
        )
        row_mult = self.inv_norm * mult if self.inv_norm is not None else None
        if row_mult is None and mult != 1.0:
            row_mult = torch.full((self.n,), mult, dtype=self.dtype, device=x.device)
        if prenormalize and (row_mult is not None or x.dtype != self.dtype):
            data = x.to(self.dtype)
            if row_mult is not None:
                data = data * row_mult[:, None]
            self.data, self.row_mult = data, None
        else:
            self.data, self.row_mult = x, row_mult

    def tile(self, i0: int, i1: int) -> Tensor:
        """Rows ``i0:i1`` in the compute dtype, normalised and scaled: ``(i1 - i0, d)``."""
        t = self.data[i0:i1].to(self.dtype)
        if self.row_mult is not None:
            return t * self.row_mult[i0:i1, None]
        return t


#: Log-probabilities (relative to the row's largest logit) below this are flushed to exactly zero
#: before ``exp``. Left alone they would be denormal floats, which make CPU GEMMs tens of times slower
#: (seen: 37x for a 2048 x 8192 by 8192 x 384 product), and ``torch.set_flush_denormal`` does not reach
#: the GEMM's worker threads. The flushed mass is below N * e^-64 of the row's total: nothing in fp32.
FLUSH_BELOW = -64.0


def exp_flushed_(x: Tensor) -> Tensor:
    """``exp`` in place, with entries below :data:`FLUSH_BELOW` (including -inf) giving exactly 0."""
    return torch.threshold_(x, FLUSH_BELOW, -torch.inf).exp_()


def spans(n: int, size: int) -> Iterator[tuple[int, int]]:
    for i0 in range(0, n, size):
        yield i0, min(i0 + size, n)


def diagonal_entries(
    r0: int, r1: int, c0: int, c1: int, offset: int | None, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """Tile-local indices ``(ri, ci)`` of the entries ``(i, offset + i)`` of rows ``r0:r1`` that fall in
    columns ``c0:c1`` (a row's positive, or its own entry), or None when there are none."""
    if offset is None:
        return None
    lo, hi = max(r0, c0 - offset), min(r1, c1 - offset)
    if lo >= hi:
        return None
    i = torch.arange(lo, hi, device=device)
    return i - r0, i + offset - c0


def positive_logits(rows: Operand, pos_col: Operand, row_offset: int, row_tile: int) -> Tensor:
    """``pos[i] = <rows_i, pos_col_{row_offset + i}>`` in fp32: ``(B,)``."""
    out = torch.empty(rows.n, dtype=rows.dtype, device=rows.x.device)
    for r0, r1 in spans(rows.n, row_tile):
        out[r0:r1] = (rows.tile(r0, r1) * pos_col.tile(row_offset + r0, row_offset + r1)).sum(1)
    return out


@dataclass
class LogSumExp:
    """``m + log_s`` kept as its two parts: a softmax ``exp(x - m - log_s)`` is then accurate even
    where the probability is close to 1 (``x - m`` is exact for nearby values, while ``x - lse`` would
    inherit the fp32 rounding of a large ``lse``)."""

    m: Tensor  # (n,) running max
    log_s: Tensor  # (n,) log of the sum of exp(x - m)

    def __getitem__(self, idx: slice) -> LogSumExp:
        return LogSumExp(self.m[idx], self.log_s[idx])

    def total(self) -> Tensor:
        """``(n,)`` float64 log-sum-exp."""
        return self.m.double() + self.log_s.double()

    def stacked(self) -> Tensor:
        """``(n, 2)``, to send it as one block."""
        return torch.stack([self.m, self.log_s], dim=1)

    @staticmethod
    def unstack(t: Tensor) -> LogSumExp:
        return LogSumExp(t[:, 0], t[:, 1])

    def log_softmax(self, logits: Tensor, dim: int) -> Tensor:
        """``logits - lse`` along ``dim`` of a ``(b, t)`` block, as a new tensor."""
        if dim == 1:
            return (logits - self.m[:, None]).sub_(self.log_s[:, None])
        return (logits - self.m[None, :]).sub_(self.log_s[None, :])


@dataclass
class Stats:
    """Per-row (and per-positive) log-sum-exp of the logits."""

    lse_rows: LogSumExp  # (B,)
    lse_cols: LogSumExp | None  # (N,) symmetric only: positive j against every row


@dataclass
class DuplicateKeys:
    """Hashes of the inputs, to mask false negatives (True in a mask = not a candidate).

    Rows are pairs ``(row_i, target_i)`` whose target sits in column 0. Pair ``j`` is a duplicate of
    pair ``i`` when their targets are equal or their rows are equal: then ``j``'s column-0 entry is not a
    negative of row ``i``, and, for the symmetric loss, row ``i`` is not a negative of ``j``'s entry
    (the relation is symmetric, so both directions use one mask). A later column's entry equal to a
    row's target is not a negative of that row either. The positive pair itself is never masked.

    ``row_pos``: ``(B,)`` key of each row's target (its positive); ``cols``: one ``(N_k,)`` key vector per
    column; ``row_self``: ``(B,)`` keys of the rows themselves and ``col_pair``: ``(N,)`` keys of the rows
    that column 0's entries are the targets of (both None: only equal targets are duplicates). For the
    positive -> anchors problem across processes the roles swap: the rows are positives, their targets
    anchors.
    """

    row_pos: Tensor
    cols: list[Tensor]
    row_self: Tensor | None = None
    col_pair: Tensor | None = None


def _masks(
    keys: DuplicateKeys | None,
    k: int,
    r0: int,
    r1: int,
    c0: int,
    c1: int,
    row_offset: int | None,
    column_direction: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Row- and column-direction masks of one ``(b, t)`` tile (True = not a candidate)."""
    if keys is None:
        return None, None
    m_r = keys.row_pos[r0:r1, None] == keys.cols[k][None, c0:c1]
    if k == 0 and keys.row_self is not None and keys.col_pair is not None:
        m_r |= keys.row_self[r0:r1, None] == keys.col_pair[None, c0:c1]
    ij = diagonal_entries(r0, r1, c0, c1, row_offset, m_r.device) if k == 0 else None
    if ij is not None:
        m_r[ij] = False  # the positive pair (i, row_offset + i) is never masked
    # duplicate pairs are duplicates both ways: the column direction masks the same entries
    return m_r, m_r if k == 0 and column_direction else None


def online_lse_update(m: Tensor, s: Tensor, block: Tensor, dim: int, scratch: Tensor | None) -> None:
    """Fold ``block`` into a running (max ``m``, sum-of-exp ``s``) along ``dim``, in place. Entries
    may be -inf (masked), including whole rows of a tile."""
    m_new = torch.maximum(m, block.amax(dim))
    m_safe = m_new.masked_fill(m_new == -torch.inf, 0.0)  # exp(-inf - -inf) would be nan
    s.mul_(torch.exp(m - m_safe))
    m_b = m_safe[:, None] if dim == 1 else m_safe[None, :]
    if scratch is None:  # block may be destroyed
        s.add_(exp_flushed_(block.sub_(m_b)).sum(dim))
    else:
        s.add_(exp_flushed_(torch.sub(block, m_b, out=scratch)).sum(dim))
    m.copy_(m_new)


def init_stats(n: int, like: Operand) -> tuple[Tensor, Tensor]:
    """A running (max, sum-of-exp) pair for ``n`` log-sum-exps."""
    dev = like.x.device
    return (
        torch.full((n,), -torch.inf, dtype=like.dtype, device=dev),
        torch.zeros(n, dtype=like.dtype, device=dev),
    )


def update_stats(
    rows: Operand,
    cols: list[Operand],
    row_acc: tuple[Tensor, Tensor],
    col_acc: tuple[Tensor, Tensor] | None,
    *,
    row_tile: int,
    col_tile: int,
    row_offset: int | None,
    keys: DuplicateKeys | None = None,
) -> None:
    """Fold the logits of ``rows`` against ``cols`` into running row statistics and, when ``col_acc``
    is given, into column 0's running statistics over these rows. One ``(b, t)`` tile at a time.
    ``row_offset``: positive pairs are ``(i, row_offset + i)`` of column 0 (None when this block has none)."""
    m_r, s_r = row_acc
    scratch: Tensor | None = None
    for r0, r1 in spans(rows.n, row_tile):
        q = rows.tile(r0, r1)  # (b, d)
        for k, col in enumerate(cols):
            for c0, c1 in spans(col.n, col_tile):
                block = q @ col.tile(c0, c1).T  # (b, d) @ (d, t) -> (b, t)
                mask_r, mask_c = _masks(keys, k, r0, r1, c0, c1, row_offset, col_acc is not None)
                if k == 0 and col_acc is not None:
                    m_c, s_c = col_acc
                    col_block = block if mask_c is None else block.masked_fill(mask_c, -torch.inf)
                    if scratch is None or scratch.shape != block.shape:
                        scratch = torch.empty_like(block)
                    online_lse_update(m_c[c0:c1], s_c[c0:c1], col_block, 0, scratch)
                if mask_r is not None:
                    block.masked_fill_(mask_r, -torch.inf)
                online_lse_update(m_r[r0:r1], s_r[r0:r1], block, 1, None)


def finish_stats(acc: tuple[Tensor, Tensor]) -> LogSumExp:
    m, s = acc
    return LogSumExp(m, s.log())


def row_col_stats(
    rows: Operand,
    cols: list[Operand],
    *,
    column_direction: bool,
    row_tile: int,
    col_tile: int,
    row_offset: int | None = 0,
    keys: DuplicateKeys | None = None,
) -> Stats:
    """First pass: log-sum-exp of every row over all candidates, and, for the symmetric loss, of
    every candidate of column 0 over all rows."""
    row_acc = init_stats(rows.n, rows)
    col_acc = init_stats(cols[0].n, rows) if column_direction else None
    update_stats(
        rows, cols, row_acc, col_acc, row_tile=row_tile, col_tile=col_tile, row_offset=row_offset, keys=keys
    )
    return Stats(lse_rows=finish_stats(row_acc), lse_cols=finish_stats(col_acc) if col_acc else None)


@dataclass
class Grads:
    """Gradients wrt the normalised (unscaled) embeddings, fp32, and ``dL/dscale``."""

    rows: Tensor  # (B, d)
    cols: list[Tensor]  # K x (N, d)
    scale: Tensor  # 0-d


def _subtract_positives(
    g: Tensor, r0: int, r1: int, c0: int, c1: int, row_offset: int, weight: float
) -> None:
    """``g[i, row_offset + i - c0] -= weight`` for the rows of this tile whose positive falls in it."""
    ij = diagonal_entries(r0, r1, c0, c1, row_offset, g.device)
    if ij is not None:
        g[ij] -= weight


def accumulate_gradients(
    rows: Operand,
    cols: list[Operand],
    lse_rows: LogSumExp,
    lse_cols: LogSumExp | None,
    g_rows: Tensor,
    g_cols: list[Tensor],
    *,
    w_rows: float,
    w_cols: float,
    row_tile: int,
    col_tile: int,
    need_scale_grad: bool,
    row_offset: int | None,
    keys: DuplicateKeys | None = None,
) -> Tensor:
    """Second pass over one set of columns: recompute each logit tile, turn it into the logit gradient
    ``G = w_r * (P_r - Y) (+ w_c * (P_c - Y))`` (``Y`` only where ``row_offset`` puts positives in these
    columns) and accumulate ``G @ c`` into ``g_rows`` and ``G^T @ q_s`` into ``g_cols``. Returns
    ``sum(G * logits)`` (for the scale's gradient; 0 if not needed). ``rows`` carry the scale, ``cols``
    do not."""
    w_pos = w_rows + (w_cols if lse_cols is not None else 0.0)
    gs = torch.zeros((), dtype=torch.float64, device=rows.x.device)
    for r0, r1 in spans(rows.n, row_tile):
        q = rows.tile(r0, r1)  # (b, d), scaled
        gq = g_rows[r0:r1]
        for k, col in enumerate(cols):
            for c0, c1 in spans(col.n, col_tile):
                c = col.tile(c0, c1)  # (t, d)
                logits = q @ c.T  # (b, t)
                mask_r, mask_c = _masks(keys, k, r0, r1, c0, c1, row_offset, lse_cols is not None)
                g = lse_rows[r0:r1].log_softmax(logits, 1)
                if mask_r is not None:
                    g.masked_fill_(mask_r, -torch.inf)
                exp_flushed_(g).mul_(w_rows)  # w_r * P_r: (b, t)
                if k == 0 and lse_cols is not None:
                    # + w_c * P_c; the logits are only needed afterwards for the scale's gradient
                    p_c = lse_cols[c0:c1].log_softmax(logits, 0)
                    if mask_c is not None:
                        p_c.masked_fill_(mask_c, -torch.inf)
                    g.add_(exp_flushed_(p_c), alpha=w_cols)
                if k == 0 and row_offset is not None:
                    _subtract_positives(g, r0, r1, c0, c1, row_offset, w_pos)
                if need_scale_grad:
                    gs += torch.vdot(g.reshape(-1), logits.reshape(-1)).double()
                gq.addmm_(g, c)  # (b, t) @ (t, d)
                g_cols[k][c0:c1].addmm_(g.T, q)  # (t, b) @ (b, d)
    return gs


def gradients(
    rows: Operand,
    cols: list[Operand],
    stats: Stats,
    pos: Tensor,
    *,
    scale: float,
    w_rows: float,
    w_cols: float,
    row_offset: int,
    row_tile: int,
    col_tile: int,
    need_scale_grad: bool,
    keys: DuplicateKeys | None = None,
) -> Grads:
    """Second pass of one process's problem: ``dL/dq_hat = s * G @ c``, ``dL/dc_hat = G^T @ q_s``."""
    dev = rows.x.device
    d = rows.x.shape[1]
    g_rows = torch.zeros(rows.n, d, dtype=rows.dtype, device=dev)
    g_cols = [torch.zeros(c.n, d, dtype=rows.dtype, device=dev) for c in cols]
    gs = accumulate_gradients(
        rows,
        cols,
        stats.lse_rows,
        stats.lse_cols,
        g_rows,
        g_cols,
        w_rows=w_rows,
        w_cols=w_cols,
        row_tile=row_tile,
        col_tile=col_tile,
        need_scale_grad=need_scale_grad,
        row_offset=row_offset,
        keys=keys,
    )
    g_rows.mul_(scale)
    return Grads(rows=g_rows, cols=g_cols, scale=(gs / scale).to(rows.dtype))


def fused_one_direction(
    rows: Operand,
    cols: list[Operand],
    pos: Tensor,
    *,
    scale: float,
    weight: float,
    row_offset: int,
    chunk: int,
    need_scale_grad: bool,
    keys: DuplicateKeys | None = None,
) -> tuple[Tensor, Grads]:
    """Loss and gradients of the one-directional loss in a single pass over row chunks.

    Each chunk holds its logits against every candidate, ``(K, b, N)``, so the softmax is exact
    there and then and nothing is recomputed: 6 * B * C * d flops in three GEMMs.
    """
    dev = rows.x.device
    d = rows.x.shape[1]
    n = cols[0].n
    g_rows = torch.empty(rows.n, d, dtype=rows.dtype, device=dev)
    g_cols = [torch.zeros(c.n, d, dtype=rows.dtype, device=dev) for c in cols]
    loss = torch.zeros((), dtype=torch.float64, device=dev)
    gs = torch.zeros((), dtype=torch.float64, device=dev)
    buf = torch.empty(len(cols), min(chunk, rows.n), n, dtype=rows.dtype, device=dev)
    col_tiles = [c.tile(0, c.n) for c in cols]  # K x (N, d); views when prenormalised
    for r0, r1 in spans(rows.n, chunk):
        q = rows.tile(r0, r1)  # (b, d), scaled
        e = buf[:, : r1 - r0]  # (K, b, N)
        for k, c in enumerate(col_tiles):
            torch.mm(q, c.T, out=e[k])  # (b, d) @ (d, N)
            mask_r, _ = _masks(keys, k, r0, r1, 0, c.shape[0], row_offset, False)
            if mask_r is not None:
                e[k].masked_fill_(mask_r, -torch.inf)
        m = e.amax(dim=(0, 2))  # (b,)
        e.sub_(m[None, :, None])
        if need_scale_grad:
            # sum_c P * logits = sum_c P * (logits - m) + m, since each row of P sums to 1
            shifted = e.clone() if keys is None else e.nan_to_num(neginf=0.0)
        exp_flushed_(e)
        z = e.sum(dim=(0, 2))  # (b,)
        loss += (m + z.log()).double().sum()
        inv_z = z.reciprocal_()
        if need_scale_grad:
            gs += ((e * shifted).sum(dim=(0, 2)) * inv_z + m).double().sum()
        e.mul_(inv_z[None, :, None])  # P
        _subtract_positives(e[0], r0, r1, 0, n, row_offset, 1.0)  # P - Y
        gq = g_rows[r0:r1]
        for k, c in enumerate(col_tiles):
            if k == 0:
                torch.mm(e[k], c, out=gq)  # (b, N) @ (N, d)
            else:
                gq.addmm_(e[k], c)
            g_cols[k].addmm_(e[k].T, q)  # (N, b) @ (b, d)
    loss -= pos.double().sum()
    if need_scale_grad:
        gs -= pos.double().sum()
    g_rows.mul_(scale * weight)
    for g in g_cols:
        g.mul_(weight)
    return loss * weight, Grads(rows=g_rows, cols=g_cols, scale=(gs * weight / scale).to(rows.dtype))
