"""The loss stage's passes on the Triton kernels ([`triton_kernels`][st_cached_losses.functional.kernels.triton_kernels]):
the statistics, the gradients and the fused one-direction pass of bound terms
([`Bound`][st_cached_losses.functional.softmax.terms.Bound]) whose products are TF32 or bf16 (``matmul_precision``
``"high"`` / ``"medium"``, [`Products`][st_cached_losses.functional.precision.Products]), never a ``rows x
columns`` block in memory.

A term runs here when it is plain: a GEMM score (cosine or dot, normalised and scaled once), no hardness
penalty, guide or duplicate mask, and its diagonal entry the positive or kept (not removed). Each pass
returns None where it cannot run (a term that is not plain, Triton missing, a kernel that failed to
compile), and the driver then runs the torch tiles ([`term_stats`][st_cached_losses.functional.softmax.terms.term_stats],
[`term_grads`][st_cached_losses.functional.softmax.terms.term_grads], [`fused_chunk`][st_cached_losses.functional.softmax.terms.fused_chunk]) at the same precision.

What the kernels compute and what stays here, in torch, ``O((B + N) d)``:

* statistics: each term's row ``(max, sum)`` (and a column softmax's, the same kernel on swapped operands)
  folded into the group's running statistics;
* gradients: ``dX = sum_j G_ij y_j`` and ``dY = sum_i G_ij x_i`` with ``G`` the softmax probabilities (the
  row softmax's and the column softmax's), and ``sum G * S`` for a learnable scale; the positives' ``- w Y``
  part is subtracted here, from the rounded operands the kernels read;
* the fused pass (one direction, no column softmax): each term's ``(max, sum, sum_j exp(S - max) y_j)`` in
  one kernel, merged over the group's terms, then ``dY`` from the finished log-sum-exps: 8 ``B C d`` flops
  in all, against 12 for the two passes.

Kernels run on CUDA; with ``ST_CACHED_LOSSES_KERNELS=1`` and ``TRITON_INTERPRET=1`` (set before the first
import of Triton) also on a CPU, in Triton's interpreter (tests); ``ST_CACHED_LOSSES_KERNELS=0`` turns them
off (torch tiles everywhere)."""

from __future__ import annotations

import importlib
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.kernels.tiles import LogSumExp, Operand, merge_stats, spans
from st_cached_losses.functional.softmax.terms import Bound, term_grads, term_stats

__all__ = ["KERNEL_MAX_DIM", "fused", "grads", "grads_or_tiles", "kernels_enabled", "stats", "stats_or_tiles"]

#: The widest embeddings the kernels take: a block of gradient rows is held in registers
#: (``64 x D`` fp32); wider ones take the torch tiles (same precision).
KERNEL_MAX_DIM = 512
#: Rows of the operands are padded to a multiple of this (every block side divides it): no load needs a mask.
ROW_MULTIPLE = 128
#: The block side under the interpreter (tests set it: small blocks make uneven tiles out of small batches).
INTERPRET_BLOCK = 16

_state: dict[str, Any] = {"module": None, "broken": None, "probed": set()}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _module() -> Any | None:
    """The kernels' module, imported on first use (None when Triton is missing or broken)."""
    if _state["broken"] is not None:
        return None
    if _state["module"] is None:
        try:
            _state["module"] = importlib.import_module("st_cached_losses.functional.kernels.triton_kernels")
        except Exception as e:  # not installed, or an install that does not import
            _state["broken"] = f"Triton could not be imported ({type(e).__name__}: {e})"
            if not isinstance(e, ImportError):
                _warn()
            return None
    return _state["module"]


def _warn() -> None:
    warnings.warn(
        f"st_cached_losses: the loss stage's Triton kernels are off for this process: {_state['broken']}. "
        "The torch path runs instead, at the same matmul_precision (slower on a GPU).",
        RuntimeWarning,
        stacklevel=4,
    )


def kernels_enabled(device: torch.device) -> bool:
    """Whether the kernels may run on ``device``: CUDA with Triton importable, unless
    ``ST_CACHED_LOSSES_KERNELS=0``; a CPU only with ``ST_CACHED_LOSSES_KERNELS=1`` under ``TRITON_INTERPRET=1``."""
    flag = os.environ.get("ST_CACHED_LOSSES_KERNELS", "auto")
    if flag == "0" or _state["broken"] is not None:
        return False
    if device.type == "cuda" or (device.type == "cpu" and flag == "1" and _interpreting()):
        return _module() is not None
    return False


def _layout(d: int) -> tuple[int, int]:
    """``(DC, NUM_DC)``: ``d`` lanes as at most 4 chunks of a power of two (384 = 3 x 128, no padding)."""
    dc = max(16, min(128, 1 << (d - 1).bit_length()))
    if math.ceil(d / dc) > 4:
        dc = 1 << (math.ceil(d / 4) - 1).bit_length()
    return dc, math.ceil(d / dc)


def _row_multiple() -> int:
    return INTERPRET_BLOCK if _interpreting() else ROW_MULTIPLE


def _kernel_dtype(b: Bound) -> torch.dtype:
    return torch.bfloat16 if b.score.products.rounds else torch.float32


def _matrix(op: Operand, dtype: torch.dtype) -> Tensor:
    """The whole operand as the kernels read it: normalised (and rounded), without its scale, zero-padded to
    ``(rows up to a multiple of every block, NUM_DC * DC)``; made once per operand."""
    if op.kernel_copy is not None:
        return op.kernel_copy
    n, d = op.x.shape
    dc, num = _layout(d)
    n_pad = -(-n // _row_multiple()) * _row_multiple()
    data = op.data
    reusable = op.rounds and op.row_mult is None and data.dtype == dtype and data.is_contiguous()
    if reusable and (n_pad, dc * num) == (n, d):
        op.kernel_copy = data  # the chunked path's normalised, rounded copy already is it
        return data
    out = torch.zeros(n_pad, dc * num, dtype=dtype, device=op.x.device)
    for r0, r1 in spans(n, 8192):  # fp32 temporaries of a few MiB at a time
        out[r0:r1, :d] = op.unscaled_tile(r0, r1)
    op.kernel_copy = out
    return out


def _plain(b: Bound) -> bool:
    t = b.term
    return (
        b.score.products.kernels
        and b.score.gemm
        and not (t.pen_off or t.pen_diag or t.guided)
        and t.diag in ("positive", "keep")
        and b.row_keys is None
        and b.guide_rows is None
        and b.false_negatives is None
        and b.rows.x.dim() == 2
        and b.rows.x.shape[1] <= KERNEL_MAX_DIM
    )


# --------------------------------------------------------------------------- launching


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.bfloat16 else "tf32"


def _tuned(name: str, dtype: torch.dtype) -> Any:
    """The kernel ``name`` ("stats", "fused", "grad") for ``dtype`` operands: autotuned on a GPU, a fixed small
    block under the interpreter (which cannot time anything)."""
    mod: Any = _module()
    cache = _state.setdefault("tuned", {})
    if (name, dtype) not in cache:
        raw = mod.rows_grad_kernel if name == "grad" else mod.rows_fwd_kernel
        if _interpreting():
            cache[name, dtype] = None
        else:
            f32 = dtype == torch.float32
            stats, acc = (
                (mod.STATS_CONFIGS_F32, mod.ACC_CONFIGS_F32) if f32 else (mod.STATS_CONFIGS, mod.ACC_CONFIGS)
            )
            cache[name, dtype] = mod.autotuned(raw, stats if name == "stats" else acc)
    return cache[name, dtype]


def _launch(name: str, args: list[Any], n_rows_pad: int, n_rows: int, **flags: Any) -> None:
    mod: Any = _module()
    kernel = _tuned(name, args[0].dtype)
    bucket = max(0, int(n_rows).bit_length() - 1)
    if kernel is None:  # the interpreter: one fixed block
        raw = mod.rows_grad_kernel if name == "grad" else mod.rows_fwd_kernel
        blk = INTERPRET_BLOCK
        raw[(n_rows_pad // blk,)](*args, bucket, **flags, UPCAST=True, BM=blk, BN=blk)
        return
    kernel[lambda meta: (n_rows_pad // meta["BM"],)](*args, bucket, **flags, UPCAST=False)


def _fwd(
    x: Tensor,
    y: Tensor,
    n_x: int,
    n_y: int,
    *,
    acc: bool,
    sg: bool,
    diag: int | None = None,
    scale: float = 1.0,
) -> tuple[Tensor, ...]:
    """Rows ``x`` against columns ``y`` (padded kernel matrices, ``n_x`` / ``n_y`` real rows): the rows' running
    max and sum ``(n_x,)``, with ``acc`` ``sum_j exp(S - max) y_j`` ``(n_x, d_pad)`` (without the entries
    ``(i, i + diag)``, whose ``exp(S - max)`` comes apart, ``(n_x,)``) and with ``sg`` ``sum_j exp(S - max) S``
    ``(n_x,)`` (empty tensors when not asked)."""
    dev, f32 = x.device, torch.float32
    m, lsum = torch.empty(n_x, dtype=f32, device=dev), torch.empty(n_x, dtype=f32, device=dev)
    acc_out = torch.empty(x.shape if acc else (1,), dtype=f32, device=dev)
    sg_out = torch.empty(n_x if sg else 1, dtype=f32, device=dev)
    has_diag = acc and diag is not None
    e_out = torch.empty(n_x if has_diag else 1, dtype=f32, device=dev)
    dc, num = _layout(x.shape[1])
    _launch(
        "fused" if acc else "stats",
        [x, y, m, lsum, acc_out, sg_out, e_out, float(scale), n_x, n_y, y.shape[0], diag if has_diag else 0],
        x.shape[0], n_x,
        D=dc * num, DC=dc, NUM_DC=num, WITH_ACC=acc, WITH_SG=sg, HAS_DIAG=has_diag, PRECISION=_precision(x.dtype),
        ROUND_P=x.dtype == torch.bfloat16,
    )  # fmt: skip
    return m, lsum, acc_out, sg_out, e_out


def _grad(
    a: Tensor, b: Tensor, n_a: int, n_b: int, la: LogSumExp | None, wa: float, lb: LogSumExp | None, wb: float,
    sg: bool, diag: int | None = None, w_diag: float = 0.0, scale: float = 1.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``sum_j G_ij b_j`` for the rows of ``a`` ``(n_a_pad, d_pad)`` with ``G = wa exp(S - la_i) + wb exp(S - lb_j)``
    (a missing side adds nothing) less ``w_diag`` on the entries ``(i, i + diag)``, and with ``sg``
    ``sum_j G_ij S_ij`` ``(n_a,)``."""
    has_diag = diag is not None and w_diag != 0.0
    dev, f32 = a.device, torch.float32
    out = torch.empty(a.shape, dtype=f32, device=dev)
    sg_out = torch.empty(n_a if sg else 1, dtype=f32, device=dev)
    dummy = out[:1, 0]
    la_m, la_ls = (la.m.contiguous(), la.log_s.contiguous()) if la is not None else (dummy, dummy)
    lb_m, lb_ls = (lb.m.contiguous(), lb.log_s.contiguous()) if lb is not None else (dummy, dummy)
    dc, num = _layout(a.shape[1])
    _launch(
        "grad",
        [a, b, la_m, la_ls, lb_m, lb_ls, float(wa), float(wb), float(w_diag), out, sg_out, float(scale), n_a, n_b,
         b.shape[0], diag if has_diag else 0],
        a.shape[0], n_a, D=dc * num, DC=dc, NUM_DC=num, HAS_LA=la is not None, HAS_LB=lb is not None,
        HAS_DIAG=has_diag, WITH_SG=sg, PRECISION=_precision(a.dtype), ROUND_P=a.dtype == torch.bfloat16,
    )  # fmt: skip
    return out, sg_out


def _ready(variants: set[tuple], device: torch.device, dtype: torch.dtype, d: int) -> bool:
    """Each kernel variant compiled and run once on a small input (compiling every autotuner config), before a
    pass uses it: a failure turns the kernels off for the process (one warning) and the pass runs in torch."""
    if _state["broken"] is not None or _module() is None or dtype in _state.setdefault("bad", set()):
        return False
    for v in variants:
        key = (v, device, dtype, d)
        if key in _state["probed"]:
            continue
        try:
            x = torch.zeros(_row_multiple(), _layout(d)[0] * _layout(d)[1], dtype=dtype, device=device)
            stats = LogSumExp(torch.zeros(2, device=device), torch.zeros(2, device=device))
            if v[0] == "grad":
                _grad(x, x, 2, 2, stats if v[1] else None, 1.0, stats if v[2] else None, 1.0, v[3], *v[4:])
            else:
                _fwd(x, x, 2, 2, acc=v[0] == "fused", sg=v[1], diag=v[2])
        except Exception as e:  # off for this operand dtype only (bf16's may run where fp32's do not fit)
            _state["bad"].add(dtype)
            warnings.warn(
                f"st_cached_losses: the loss stage's Triton kernels for {dtype} operands are off for this "
                f"process: a kernel failed to compile or run ({type(e).__name__}: {str(e)[:300]}). The torch "
                "path runs instead, at the same matmul_precision (slower on a GPU).",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        _state["probed"].add(key)
    return True


def _usable(bound: Sequence[Bound], variants: set[tuple]) -> bool:
    if not bound or not all(_plain(b) for b in bound):
        return False
    b0 = bound[0]
    return _ready(variants, b0.rows.x.device, _kernel_dtype(b0), b0.rows.x.shape[1])


# --------------------------------------------------------------------------- the passes


def stats(bound: Sequence[Bound], m: Tensor, ssum: Tensor) -> bool:
    """[`term_stats`][st_cached_losses.functional.softmax.terms.term_stats] on the kernels: fold every term's row
    statistics into the per-group ``(m, ssum)`` ``(groups, B)``, and a column softmax's into its running
    statistics. False (nothing done) where the kernels cannot run these terms."""
    if not _usable(bound, {("stats", False, None)}):
        return False
    for b in bound:
        if b.cols.n == 0:
            continue
        dtype = _kernel_dtype(b)
        x, y = _matrix(b.rows, dtype), _matrix(b.cols, dtype)
        sc = b.rows.mult * b.cols.mult
        mb, lb, *_ = _fwd(x, y, b.rows.n, b.cols.n, acc=False, sg=False, scale=sc)
        merge_stats(m[b.term.group], ssum[b.term.group], mb, lb)
        if b.col_stats is not None:  # the softmax down the columns: the columns as rows
            mc, lc, *_ = _fwd(y, x, b.cols.n, b.rows.n, acc=False, sg=False, scale=sc)
            merge_stats(b.col_stats[0], b.col_stats[1], mc, lc)
    return True


def _positive(b: Bound, weights: Sequence[float]) -> tuple[int | None, float]:
    """Where row ``i``'s positive is (``i + diag``; None: not in these columns) and the total weight of the
    softmaxes whose positive it is."""
    w = (weights[b.term.group] if b.term.diag == "positive" else 0.0) + (
        b.col_weight if b.col_positive else 0.0
    )
    return (b.diag, w) if b.diag is not None and w else (None, 0.0)


def _grad_variants(b: Bound, need_scale_grad: bool, diag: int | None) -> set[tuple]:
    has_col, mark = b.col_lse is not None, (0, 1.0) if diag is not None else (None, 0.0)
    out = {("grad", True, has_col, need_scale_grad, *mark)}
    if b.g_cols is not None:
        out.add(("grad", has_col, True, False, *mark))
    return out


def grads(
    bound: Sequence[Bound], lse: Sequence[LogSumExp], weights: Sequence[float], *, need_scale_grad: bool
) -> Tensor | None:
    """[`term_grads`][st_cached_losses.functional.softmax.terms.term_grads] on the kernels: each term's row and column
    gradients into its buffers; returns ``sum(G * S)`` (fp64, 0 when not needed), or None (nothing done)
    where the kernels cannot run these terms."""
    variants: set[tuple] = set()
    for b in bound:
        variants |= _grad_variants(b, need_scale_grad, _positive(b, weights)[0])
    if not _usable(bound, variants):
        return None
    gs = torch.zeros((), dtype=torch.float64, device=bound[0].rows.x.device)
    for b in bound:
        if b.cols.n == 0:
            continue
        dtype, g = _kernel_dtype(b), b.term.group
        x, y = _matrix(b.rows, dtype), _matrix(b.cols, dtype)
        d = b.rows.x.shape[1]
        row_lse, w = lse[g], weights[g]
        col_lse, cw = b.col_lse, b.col_weight
        diag, w_pos = _positive(b, weights)
        sc = b.rows.mult * b.cols.mult
        if b.g_rows is not None or need_scale_grad:
            dx, sg = _grad(
                x, y, b.rows.n, b.cols.n, row_lse, w, col_lse, cw, need_scale_grad, diag, w_pos, sc
            )
            if b.g_rows is not None:  # as the torch tiles: wrt the rows before their scale, the columns' kept
                b.g_rows.add_(dx[: b.rows.n, :d], alpha=b.cols.mult)
            if need_scale_grad:
                gs += sg.double().sum()
        if b.g_cols is not None:  # the columns' gradients: the same kernel, the columns as rows
            back = (
                -diag if diag is not None else None
            )  # entry (i, i + diag) is (j, j - diag) seen from column j
            dy, _ = _grad(y, x, b.cols.n, b.rows.n, col_lse, cw, row_lse, w, False, back, w_pos, sc)
            b.g_cols.add_(dy[: b.cols.n, :d], alpha=b.rows.mult)
    return gs


def stats_or_tiles(
    bound: Sequence[Bound], m: Tensor, ssum: Tensor, *, scale: float, row_tile: int, col_tile: int
) -> None:
    """A statistics pass: on the kernels where these terms allow ([`stats`][st_cached_losses.functional.softmax.flash.stats]),
    else on torch tiles ([`term_stats`][st_cached_losses.functional.softmax.terms.term_stats])."""
    if not stats(bound, m, ssum):
        term_stats(bound, m, ssum, scale=scale, row_tile=row_tile, col_tile=col_tile)


def grads_or_tiles(
    bound: Sequence[Bound], lse: Sequence[LogSumExp], weights: Sequence[float], *, scale: float, row_tile: int,
    col_tile: int, need_scale_grad: bool,
) -> Tensor:  # fmt: skip
    """A gradient pass: on the kernels where these terms allow ([`grads`][st_cached_losses.functional.softmax.flash.grads]),
    else on torch tiles ([`term_grads`][st_cached_losses.functional.softmax.terms.term_grads]); returns ``sum(G * S)``."""
    gs = grads(bound, lse, weights, need_scale_grad=need_scale_grad)
    if gs is not None:
        return gs
    return term_grads(
        bound,
        lse,
        weights,
        scale=scale,
        row_tile=row_tile,
        col_tile=col_tile,
        need_scale_grad=need_scale_grad,
    )


def fused(
    bound: Sequence[Bound], weights: Sequence[float], *, n_rows: int, need_grads: bool, need_scale_grad: bool
) -> tuple[Tensor, Tensor] | None:
    """[`fused_chunk`][st_cached_losses.functional.softmax.terms.fused_chunk] on the kernels (no term has a column
    softmax): every group's log-sum-exp per row ``(G, n_rows)`` fp64 and ``sum(G * S)``; the row gradients
    come out of the statistics' kernel (FlashAttention's forward, the columns as its values), the column
    gradients from a second kernel. None (nothing done) where the kernels cannot run these terms."""
    variants: set[tuple] = set()
    for b in bound:
        diag = _positive(b, weights)[0]
        if need_grads:
            variants.add(("fused", need_scale_grad, 0 if diag is not None else None))
            if b.g_cols is not None:
                variants.add(("grad", False, True, False, *((0, 1.0) if diag is not None else (None, 0.0))))
        else:
            variants.add(("stats", False, None))
    if any(b.col_group is not None for b in bound) or not _usable(bound, variants):
        return None
    dev = bound[0].rows.x.device
    lse = torch.zeros(len(weights), n_rows, dtype=torch.float64, device=dev)
    gs = torch.zeros((), dtype=torch.float64, device=dev)
    for grp, w in enumerate(weights):
        mine = [b for b in bound if b.term.group == grp and b.cols.n > 0]
        if not mine:
            continue
        parts: list[Any] = []
        for b in mine:
            dtype, diag = _kernel_dtype(b), _positive(b, weights)[0]
            x, y = _matrix(b.rows, dtype), _matrix(b.cols, dtype)
            sc = b.rows.mult * b.cols.mult
            out = _fwd(x, y, n_rows, b.cols.n, acc=need_grads, sg=need_scale_grad, diag=diag, scale=sc)
            parts.append((b, x, y, diag, *out))
        m = torch.stack([p[4] for p in parts]).amax(0)  # (n_rows,): finite, every term has a column
        lsum = torch.zeros_like(m)
        for p in parts:
            lsum += p[5] * torch.exp(p[4] - m)
        lse[grp] = m.double() + lsum.double().log()
        if not need_grads:
            continue
        stats_g = LogSumExp(m, lsum.log())
        for b, x, y, diag, mb, _, acc, sg, e_diag in parts:
            d = b.rows.x.shape[1]
            prob = torch.exp(mb - m) / lsum  # (n_rows,): each term's max to the group's, over the sum
            if b.g_rows is not None:
                b.g_rows.addcmul_(acc[:n_rows, :d], prob[:, None], value=w * b.cols.mult)
            if need_scale_grad:
                gs += w * (sg * prob).double().sum()
            if diag is not None:  # the positive: w (P_ii - 1) y_{i + diag}, in fp32
                gs += _positive_apart(b, diag, w, e_diag * prob, need_scale_grad)
            if b.g_cols is not None:
                back, w_pos = (-diag, w) if diag is not None else (None, 0.0)
                dy, _ = _grad(y, x, b.cols.n, n_rows, None, 0.0, stats_g, w, False, back, w_pos, sc)
                b.g_cols.add_(dy[: b.cols.n, :d], alpha=b.rows.mult)
    return lse, gs


def _positive_apart(b: Bound, diag: int, w: float, p_diag: Tensor, need_scale_grad: bool) -> Tensor:
    """The fused pass's diagonal entries, kept out of its bf16 product: ``w (P_ii - 1) y_{i + diag}`` into the
    rows' buffer, from the rounded operands; returns the ``- w S_ii`` part of ``sum G * S`` (0 when not needed)."""
    lo, hi = max(0, -diag), min(b.rows.n, b.cols.n - diag)
    if lo >= hi:
        return torch.zeros((), dtype=torch.float64, device=p_diag.device)
    coef = (p_diag[lo:hi] - 1.0).mul_(w)  # (k,)
    y = b.cols.tile(lo + diag, hi + diag)  # (k, d) fp32, as the kernel reads it
    if b.g_rows is not None:
        b.g_rows[lo:hi].addcmul_(y, coef[:, None])
    if not need_scale_grad:
        return torch.zeros((), dtype=torch.float64, device=p_diag.device)
    # the kernel's sum holds w P_ii S_ii already: the - w S_ii is what is left
    return -w * (b.rows.tile(lo, hi) * y).sum(1).double().sum()
