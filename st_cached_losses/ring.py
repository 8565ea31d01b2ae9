"""InfoNCE across processes without gathering: candidate blocks travel around a ring (Inf-CL style).

Each process keeps its own anchors and candidates; every other process's candidate block visits it
once per pass (the next one already in flight while the current one is scored). Pass 1 accumulates
each row's log-sum-exp, and for the symmetric loss each positive's column statistics travel with
its block, so they are complete when the block comes home. Pass 2 recomputes each tile and
accumulates the gradient of the visiting block into a buffer that travels with it. Memory per
process: its own blocks plus one visiting set, ``O(local B x d)`` whatever the world size.

The loss of process ``r`` is ``weight * sum_{i in r} loss_i`` (``weight = W / B_global`` makes DDP's
gradient average the exact full-batch gradient, even with unequal per-process batches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from st_cached_losses.distributed import all_reduce_sum, rank, ring_exchange
from st_cached_losses.functional._kernels import (
    DuplicateKeys,
    LogSumExp,
    Operand,
    accumulate_gradients,
    finish_stats,
    init_stats,
    positive_logits,
    update_stats,
)
from st_cached_losses.functional.infonce import InfoNCEOutput, _raw_grad


def _tile(tile_size: int | None, memory_budget: int) -> int:
    if tile_size is not None:
        return tile_size
    return min(2048, max(1, int((memory_budget // 12) ** 0.5)))


def ring_infonce(*args: object, **kwargs: object) -> InfoNCEOutput:
    """See :func:`_ring_infonce` (run without autograd)."""
    with torch.no_grad():
        return _ring_infonce(*args, **kwargs)  # type: ignore[arg-type]


def _ring_infonce(
    anchors: Tensor,
    candidates: list[Tensor],
    sizes: list[int],
    *,
    scale: float | Tensor,
    cosine: bool,
    symmetric: bool,
    weight: float,
    tile_size: int | None,
    memory_budget: int,
    with_grad: bool,
    anchor_keys: Tensor | None = None,
    candidate_keys: list[Tensor] | None = None,
) -> InfoNCEOutput:
    """This process's share of the global InfoNCE (and its gradients) by ring exchange.

    Args:
        anchors: ``(b, d)`` this process's anchors; ``candidates``: ``K x (b, d)`` its positives then
            hard negatives. ``sizes``: every process's ``b``, in rank order.
        scale: float, or a 0-d tensor (its gradient, averaged over processes, is returned if it
            requires grad).
        weight: multiplies the summed per-row losses (and so every gradient).
        with_grad: also compute the gradients (pass 2); else only the loss.
        anchor_keys / candidate_keys: ``(b,)`` integer keys to mask duplicates, the same rule as
            ``infonce`` (pairs sharing an anchor or a positive, in both directions).

    No finiteness check here: a rank raising on its own NaN in the middle of the ring would leave its
    peers blocked in a send / receive. The caller agrees on finiteness first, in the shape exchange
    (:func:`~st_cached_losses.distributed.exchange_shapes` with ``nonfinite``), where every rank
    raises together.
    """
    me = rank()
    s = float(scale.detach()) if isinstance(scale, Tensor) else float(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    dtype = torch.float64 if anchors.dtype == torch.float64 else torch.float32
    k, (b, d) = len(candidates), anchors.shape
    tile = _tile(tile_size, memory_budget)
    rows = Operand(anchors, cosine, s, prenormalize=False)
    w = weight * (0.5 if symmetric else 1.0)
    # one message per pass for all columns: (b, K, d); the keys travel alongside
    block = candidates[0].unsqueeze(1) if k == 1 else torch.stack(candidates, dim=1)  # no copy for pairs
    block = block.contiguous()
    masking = candidate_keys is not None
    key_block = torch.stack(candidate_keys, dim=1).contiguous() if candidate_keys is not None else None
    static = [block] + ([key_block] if key_block is not None else [])
    if masking and anchor_keys is not None:
        # pairs sharing an anchor are duplicates too (in both directions): the anchors' keys travel too
        static.append(anchor_keys.contiguous())

    def columns(blk: Tensor) -> list[Operand]:
        return [Operand(blk[:, j], cosine, 1.0, prenormalize=False) for j in range(k)]

    def keys_for(owner: int, statics: list[Tensor]) -> DuplicateKeys | None:
        if not masking:
            return None
        own_pos = candidate_keys[0]  # type: ignore[index]
        kb = statics[1]
        col_pair = statics[2] if len(statics) > 2 else None
        return DuplicateKeys(own_pos, [kb[:, j] for j in range(k)], anchor_keys, col_pair)

    # pass 1: row statistics stay here; column statistics of each positive travel with its block
    row_acc = init_stats(b, rows)
    carried = [torch.stack(init_stats(b, rows), dim=1)] if symmetric else []

    def visit_stats(owner: int, statics: list[Tensor], carried: list[Tensor]) -> None:
        col_acc = (carried[0][:, 0], carried[0][:, 1]) if symmetric else None
        update_stats(
            rows,
            columns(statics[0]),
            row_acc,
            col_acc,
            row_tile=tile,
            col_tile=tile,
            diag=0 if owner == me else None,
            keys=keys_for(owner, statics),
        )

    carried = ring_exchange(static, carried, sizes, visit_stats)
    own_cols = columns(block)
    lse_r = finish_stats(row_acc)
    lse_c = (
        finish_stats((carried[0][:, 0].contiguous(), carried[0][:, 1].contiguous())) if symmetric else None
    )
    pos = positive_logits(rows, own_cols[0], 0, tile)
    loss = w * (lse_r.total().sum() - pos.double().sum())
    if lse_c is not None:
        loss = loss + w * (lse_c.total().sum() - pos.double().sum())
    if not with_grad:
        return InfoNCEOutput(
            loss=loss.to(dtype),
            grad_anchors=anchors,
            grad_candidates=[],
            grad_anchors_all=None,
            grad_scale=None,
        )

    # pass 2: the visiting block's gradient accumulates in a buffer that travels with it
    g_rows = torch.zeros(b, d, dtype=dtype, device=anchors.device)
    gs_total = torch.zeros((), dtype=torch.float64, device=anchors.device)
    static2 = [block] + ([lse_c.stacked()] if lse_c is not None else []) + static[1:]

    def visit_grads(owner: int, statics: list[Tensor], carried: list[Tensor]) -> None:
        nonlocal gs_total
        blk = statics[0]
        lse_c_owner = LogSumExp.unstack(statics[1]) if symmetric else None
        key_statics = [blk, *statics[2:]] if symmetric else statics
        g_blk = carried[0]
        gs_total += accumulate_gradients(
            rows,
            columns(blk),
            lse_r,
            lse_c_owner,
            g_rows,
            [g_blk[:, j] for j in range(k)],
            w_rows=w,
            w_cols=w,
            row_tile=tile,
            col_tile=tile,
            need_scale_grad=need_scale_grad,
            diag=0 if owner == me else None,
            keys=keys_for(owner, key_statics),
        )

    g_block = torch.zeros(b, k, d, dtype=dtype, device=anchors.device)
    (g_block,) = ring_exchange(static2, [g_block], sizes, visit_grads)
    g_cols = [g_block[:, j].contiguous() for j in range(k)]
    g_rows.mul_(s)
    grad_scale = None
    if need_scale_grad:
        # every process holds part of d(sum_r L_r)/ds = W dL/ds; the average is the true gradient
        gs = all_reduce_sum(gs_total.reshape(1), "all_reduce_scale") / len(sizes)
        grad_scale = (gs[0] / s).to(scale.dtype)  # type: ignore[union-attr]
    g_anchors = _raw_grad(rows, g_rows, anchors.dtype, tile)
    g_candidates = [_raw_grad(op, g, c.dtype, tile) for op, g, c in zip(own_cols, g_cols, candidates)]
    return InfoNCEOutput(
        loss=loss.to(dtype),
        grad_anchors=g_anchors,
        grad_candidates=g_candidates,
        grad_anchors_all=None,
        grad_scale=grad_scale,
    )


__all__ = ["ring_infonce"]
