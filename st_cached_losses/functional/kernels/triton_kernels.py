"""The loss stage's Triton kernels (FlashAttention-style): per-row log-sum-exps and gradient rows of
``S = X Y^T`` without ever holding ``S``. Imported only by [`flash`][st_cached_losses.functional.softmax.flash], and only
when Triton is installed: the functional layer stays importable with torch alone.

Two kernels, each a program per block of ``BM`` rows of ``X (n_x, D)`` streaming ``Y (n_y, D)`` in blocks
of ``BN`` rows, products on tensor cores (bf16 operands, or fp32 operands as TF32), fp32 accumulation:

* `_rows_fwd`: the running max ``m_i`` and sum ``l_i = sum_j exp(S_ij - m_i)`` of each row (online, as
  FlashAttention's forward), with ``WITH_ACC`` also ``acc_i = sum_j exp(S_ij - m_i) y_j`` rescaled as the
  max moves (the one-direction loss's anchor gradient, unnormalised: the fused pass) and with ``WITH_SG``
  ``sum_j exp(S_ij - m_i) S_ij`` (a learnable scale's gradient);
* `_rows_grad`: ``sum_j G_ij y_j`` with ``G_ij = wa exp(S_ij - La_i) + wb exp(S_ij - Lb_j)`` from finished
  log-sum-exps ``L = m + log_s`` of the rows (``HAS_LA``) and of the columns (``HAS_LB``, the symmetric
  loss's column softmax), and with ``WITH_SG`` ``sum_j G_ij S_ij``. The column gradients are the same
  kernel on swapped operands.

``D`` is cut into ``NUM_DC`` (at most 4) chunks of ``DC`` (a power of two) lanes, so that ``D = 384`` runs as
3 x 128 without padding to 512: the row block's chunks are loaded once, each column block's chunks feed
both the score product and the gradient product. Every kernel writes its outputs (never accumulates into
them): the autotuner may run it several times.

Under ``TRITON_INTERPRET=1`` (tests on a CPU) the interpreter multiplies bf16 operands as their bit
patterns (triton-lang/triton#11584, bf16 is unsupported there), so ``UPCAST`` turns the loaded tiles to
fp32 first: bf16 values are exact in fp32, the products too, and the sums are fp32 as on a GPU."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rows_fwd_kernel", "rows_grad_kernel"]


@triton.jit
def _low(p, like, UPCAST: tl.constexpr, ROUND_P: tl.constexpr):
    """``p`` as the first operand of a product with ``like``: in its dtype (bf16: rounded, as on tensor
    cores); under the interpreter's fp32 operands, rounded through bf16 all the same when ``ROUND_P``."""
    out = p.to(like.dtype)
    if UPCAST and ROUND_P:
        out = p.to(tl.bfloat16).to(tl.float32)
    return out


@triton.jit
def _ld(ptrs, UPCAST: tl.constexpr):
    t = tl.load(ptrs)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def _load_chunks(ptrs, DC: tl.constexpr, NUM_DC: tl.constexpr, UPCAST: tl.constexpr):
    """The ``NUM_DC`` chunks of ``DC`` lanes from ``ptrs`` on (the chunks past ``NUM_DC`` repeat chunk 0 and
    are never read)."""
    c0 = _ld(ptrs, UPCAST)
    c1 = c0
    c2 = c0
    c3 = c0
    if NUM_DC > 1:
        c1 = _ld(ptrs + DC, UPCAST)
    if NUM_DC > 2:
        c2 = _ld(ptrs + 2 * DC, UPCAST)
    if NUM_DC > 3:
        c3 = _ld(ptrs + 3 * DC, UPCAST)
    return c0, c1, c2, c3


@triton.jit
def _block_scores(
    r0, r1, r2, r3, ptrs,
    DC: tl.constexpr, NUM_DC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """The unscaled scores ``(BM, BN)`` of the row block's chunks ``r`` against the column block at ``ptrs``,
    each column chunk loaded as its product needs it; returns the scores and the column chunks (reused by
    the gradient product)."""
    c0 = _ld(ptrs, UPCAST)
    s = _dot(r0, tl.trans(c0), tl.zeros([BM, BN], tl.float32), PRECISION)
    c1 = c0
    c2 = c0
    c3 = c0
    if NUM_DC > 1:
        c1 = _ld(ptrs + DC, UPCAST)
        s = _dot(r1, tl.trans(c1), s, PRECISION)
    if NUM_DC > 2:
        c2 = _ld(ptrs + 2 * DC, UPCAST)
        s = _dot(r2, tl.trans(c2), s, PRECISION)
    if NUM_DC > 3:
        c3 = _ld(ptrs + 3 * DC, UPCAST)
        s = _dot(r3, tl.trans(c3), s, PRECISION)
    return s, c0, c1, c2, c3


@triton.jit
def _store_chunks(ptrs, c0, c1, c2, c3, DC: tl.constexpr, NUM_DC: tl.constexpr):
    """``_load_chunks``' inverse: the ``NUM_DC`` chunks written from ``ptrs`` on."""
    tl.store(ptrs, c0)
    if NUM_DC > 1:
        tl.store(ptrs + DC, c1)
    if NUM_DC > 2:
        tl.store(ptrs + 2 * DC, c2)
    if NUM_DC > 3:
        tl.store(ptrs + 3 * DC, c3)


@triton.jit
def _rows_fwd(
    X, Y, M_out, L_out, Acc_out, SG_out, E_out, scale, n_x, n_y, n_y_pad, diag, n_bucket,
    D: tl.constexpr, DC: tl.constexpr, NUM_DC: tl.constexpr,
    WITH_ACC: tl.constexpr, WITH_SG: tl.constexpr, HAS_DIAG: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Operands are padded: ``X (n_x_pad, D)`` and ``Y (n_y_pad, D)`` with zero rows up to a multiple of
    every block and zero lanes up to ``D = NUM_DC * DC``, so that no load needs a mask. ``S = scale * X Y^T``:
    the operands are normalised, the scale multiplies their fp32 product.

    ``HAS_DIAG`` (with ``WITH_ACC``): entry ``(i, i + diag)``, the row's positive, stays out of the bf16
    product and its ``exp(S - m)`` is summed apart (``E_out``), in fp32: its gradient ``w (P_ii - 1) y``
    cancels where ``P_ii`` is near 1, which a bf16 ``P_ii`` would not survive."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    lanes = tl.arange(0, DC)
    x_ptrs = X + rows[:, None] * D + lanes[None, :]  # (BM, DC), chunk 0
    x0, x1, x2, x3 = _load_chunks(x_ptrs, DC, NUM_DC, UPCAST)
    m = tl.full([BM], float("-inf"), tl.float32)
    lsum = tl.zeros([BM], tl.float32)
    sg = tl.zeros([BM], tl.float32)
    e_diag = tl.zeros([BM], tl.float32)
    acc0 = tl.zeros([BM, DC], tl.float32)
    acc1 = tl.zeros([BM, DC], tl.float32)
    acc2 = tl.zeros([BM, DC], tl.float32)
    acc3 = tl.zeros([BM, DC], tl.float32)
    y_ptrs = Y + tl.arange(0, BN)[:, None] * D + lanes[None, :]  # (BN, DC), block 0, chunk 0
    for j0 in range(0, n_y_pad, BN):
        s, y0, y1, y2, y3 = _block_scores(x0, x1, x2, x3, y_ptrs, DC, NUM_DC, UPCAST, PRECISION, BM, BN)
        cols = j0 + tl.arange(0, BN)
        s = s * scale + tl.where(cols < n_y, 0.0, float("-inf"))[None, :]  # the padding's columns
        # every block holds a column in range, so m_new is finite and exp(-inf) gives the 0 it should
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        if WITH_SG:
            sg = sg * alpha + tl.sum(p * tl.where(cols < n_y, s, 0.0), 1)
        if WITH_ACC:
            if HAS_DIAG:
                on_diag = cols[None, :] == rows[:, None] + diag
                e_diag = e_diag * alpha + tl.sum(tl.where(on_diag, p, 0.0), 1)
                p = tl.where(on_diag, 0.0, p)
            pc = _low(p, y0, UPCAST, ROUND_P)
            acc0 = _dot(pc, y0, acc0 * alpha[:, None], PRECISION)
            if NUM_DC > 1:
                acc1 = _dot(pc, y1, acc1 * alpha[:, None], PRECISION)
            if NUM_DC > 2:
                acc2 = _dot(pc, y2, acc2 * alpha[:, None], PRECISION)
            if NUM_DC > 3:
                acc3 = _dot(pc, y3, acc3 * alpha[:, None], PRECISION)
        m = m_new
        y_ptrs += BN * D
    in_rows = rows < n_x
    tl.store(M_out + rows, m, mask=in_rows)
    tl.store(L_out + rows, lsum, mask=in_rows)
    if WITH_SG:
        tl.store(SG_out + rows, sg, mask=in_rows)
    if HAS_DIAG:
        tl.store(E_out + rows, e_diag, mask=in_rows)
    if WITH_ACC:  # padded rows (n_x_pad, D): the caller slices
        _store_chunks(Acc_out + rows[:, None] * D + lanes[None, :], acc0, acc1, acc2, acc3, DC, NUM_DC)


@triton.jit
def _rows_grad(
    A, B, La_m, La_ls, Lb_m, Lb_ls, wa, wb, w_diag, Out, SG_out, scale, n_a, n_b, n_b_pad, diag, n_bucket,
    D: tl.constexpr, DC: tl.constexpr, NUM_DC: tl.constexpr,
    HAS_LA: tl.constexpr, HAS_LB: tl.constexpr, HAS_DIAG: tl.constexpr, WITH_SG: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ROUND_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Padded operands as `_rows_fwd`'s. A padding column's ``G`` meets a zero row of ``B`` (and a zero
    score), so it adds nothing; its column statistics load as ``+inf`` all the same. ``HAS_DIAG``: entry
    ``(i, i + diag)`` is the positive of softmaxes of total weight ``w_diag``, subtracted from ``G`` in fp32
    before ``G`` is rounded (``G_ii = w (P_ii - 1)`` is small where ``P_ii`` is near 1)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    in_rows = rows < n_a
    lanes = tl.arange(0, DC)
    a_ptrs = A + rows[:, None] * D + lanes[None, :]
    a0, a1, a2, a3 = _load_chunks(a_ptrs, DC, NUM_DC, UPCAST)
    la_m = tl.zeros([BM], tl.float32)
    la_ls = tl.zeros([BM], tl.float32)
    if HAS_LA:  # rows out of range: their gradient is not kept, any finite statistics do
        la_m = tl.load(La_m + rows, mask=in_rows, other=0.0)
        la_ls = tl.load(La_ls + rows, mask=in_rows, other=0.0)
    sg = tl.zeros([BM], tl.float32)
    acc0 = tl.zeros([BM, DC], tl.float32)
    acc1 = tl.zeros([BM, DC], tl.float32)
    acc2 = tl.zeros([BM, DC], tl.float32)
    acc3 = tl.zeros([BM, DC], tl.float32)
    b_ptrs = B + tl.arange(0, BN)[:, None] * D + lanes[None, :]
    for j0 in range(0, n_b_pad, BN):
        s, b0, b1, b2, b3 = _block_scores(a0, a1, a2, a3, b_ptrs, DC, NUM_DC, UPCAST, PRECISION, BM, BN)
        s = s * scale
        g = tl.zeros([BM, BN], tl.float32)
        if HAS_LA:  # (S - m) - log_s: exact where S is near the max (a probability near 1)
            g += wa * tl.exp((s - la_m[:, None]) - la_ls[:, None])
        if HAS_LB:
            cols = j0 + tl.arange(0, BN)
            lb_m = tl.load(Lb_m + cols, mask=cols < n_b, other=float("inf"))
            lb_ls = tl.load(Lb_ls + cols, mask=cols < n_b, other=0.0)
            g += wb * tl.exp((s - lb_m[None, :]) - lb_ls[None, :])
        if HAS_DIAG:
            cols_d = j0 + tl.arange(0, BN)
            g -= tl.where(cols_d[None, :] == rows[:, None] + diag, w_diag, 0.0)
        if WITH_SG:
            sg += tl.sum(g * s, 1)
        gc = _low(g, b0, UPCAST, ROUND_P)
        acc0 = _dot(gc, b0, acc0, PRECISION)
        if NUM_DC > 1:
            acc1 = _dot(gc, b1, acc1, PRECISION)
        if NUM_DC > 2:
            acc2 = _dot(gc, b2, acc2, PRECISION)
        if NUM_DC > 3:
            acc3 = _dot(gc, b3, acc3, PRECISION)
        b_ptrs += BN * D
    if WITH_SG:
        tl.store(SG_out + rows, sg, mask=in_rows)
    # padded rows (n_a_pad, D): the caller slices
    _store_chunks(Out + rows[:, None] * D + lanes[None, :], acc0, acc1, acc2, acc3, DC, NUM_DC)


def _configs(specs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in specs]


#: (BM, BN, warps, stages) the autotuner picks from (keyed on D, the operands' dtype and the size bucket),
#: each compiled for sm_90 here first (shared memory and registers without spills at D = 384): few, so that
#: compiling and tuning every kernel a step needs stays within a minute on a fresh machine.
STATS_CONFIGS = [(128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3)]
ACC_CONFIGS = [(64, 64, 8, 2), (64, 64, 8, 3)]
#: fp32 operands (TF32 products) take twice the shared memory: narrower column blocks
STATS_CONFIGS_F32 = [(64, 32, 4, 2), (64, 32, 8, 2)]
ACC_CONFIGS_F32 = [(64, 32, 8, 2)]

rows_fwd_kernel = _rows_fwd
rows_grad_kernel = _rows_grad


def autotuned(kernel, specs: list[tuple[int, int, int, int]]):
    """``kernel`` under ``triton.autotune`` over ``specs``, keyed on ``D`` and the row count's bucket."""
    return triton.autotune(configs=_configs(specs), key=["D", "n_bucket"])(kernel)
