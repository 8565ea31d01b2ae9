"""The ring driver: this process's rows against every process's columns, the column blocks passed around
a ring of processes (Inf-CL), tiled by construction; nothing is gathered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.checks import scale_value
from st_cached_losses.functional.distributed import all_reduce_sum, rank, ring_exchange
from st_cached_losses.functional.kernels.tiles import LogSumExp, Operand, init_stats, merge_stats, tile_side
from st_cached_losses.functional.softmax import flash
from st_cached_losses.functional.softmax.binding import (
    Solution,
    Sources,
    bind,
    false_negatives,
    finish_grads,
    group_stats,
    guide_sources,
    loss_sum,
    pair_up,
    row_lse,
    transposed_pair,
)
from st_cached_losses.functional.softmax.options import Keys, LossSpec
from st_cached_losses.functional.softmax.terms import Bound

__all__ = ["ring_terms_solve"]


def ring_terms_solve(
    spec: LossSpec, anchors: Tensor, cols: Sequence[Tensor], sizes: list[int], *, scale: float | Tensor,
    with_grad: bool, bank_shares: tuple[list[int], list[int]] | None = None,
    list_sizes: list[list[int]] | None = None, factor: float | None = None,
) -> Solution:  # fmt: skip
    """``_ring_terms_solve`` (below) with torch's GEMMs at the
    call's product precision."""
    with spec.score.products.pinned(anchors.device):
        return _ring_terms_solve(
            spec, anchors, cols, sizes, scale=scale, with_grad=with_grad, bank_shares=bank_shares,
            list_sizes=list_sizes, factor=factor,
        )  # fmt: skip


def _pad_rows(x: Tensor, n: int) -> Tensor:
    """``x`` with zero rows appended up to ``n`` rows."""
    return x if x.shape[0] == n else torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])


def _ring_terms_solve(
    spec: LossSpec, anchors: Tensor, cols: Sequence[Tensor], sizes: list[int], *, scale: float | Tensor,
    with_grad: bool, bank_shares: tuple[list[int], list[int]] | None = None,
    list_sizes: list[list[int]] | None = None, factor: float | None = None,
) -> Solution:  # fmt: skip
    """This process's share of the global loss (``W / B_global * sum`` over its rows) by ring exchange:
    every process's columns (its candidates, its anchors when a term reads ``q_all``, its guide
    embeddings when guided, its keys when masking) visit every process once per pass, the next block in
    flight while the current one is scored; a visiting block's gradient travels with it and is home after
    the circle. Row statistics never leave their process; the statistics of a softmax down the columns
    (the symmetric loss's positives against every anchor) travel with their block.

    Rows are ``(b, *row_shape)``: embeddings ``(b, d)``, or packed rows (token rows ``(b, t, d + 1)``,
    sparse rows ``(b, k, 2)``). Every travelling tensor (the candidate columns, and the anchors when a term
    reads them) must have the same row shape on every process (the caller pads packed rows to a common
    width: [`ring_loss_and_grad`][st_cached_losses.functional.softmax.parallel.ring_loss_and_grad]); the rows (anchors) may have a shape of their own.

    A negative bank (``spec.options.bank``, this process's share; ``bank_shares``: every process's rows of
    it, candidates and anchors) travels around a ring of its own in each pass, after the columns: its
    blocks feed the rows' statistics and gradients only (no gradient goes to the bank, no column softmax
    runs down it), so nothing travels with them.

    Lists of hard negatives (``spec.options.listed_negatives``; ``list_sizes``: every process's rows of each
    hard-negative column, ``cols[1:]``): those columns have a length of their own on each process, so they
    travel apart from the row-aligned ones, side by side in one block padded to the longest list column of
    every process (zeros that no term reads: each visiting column is cut back to its owner's rows), their
    gradient block travelling with them (and their duplicate keys when masking, padded the same way); a column
    no process has an entry of travels not at all.

    Rows other than the block's (several positives per row,
    [`ring_several_positives_loss_and_grad`][st_cached_losses.functional.softmax.positives.ring_several_positives_loss_and_grad]):
    ``sizes`` are every process's rows of the row-aligned columns, and this call's rows (``anchors``, any number,
    none too) have their positives at ``spec.options.row_offset`` onwards in this process's own block; the keys'
    ``anchors_all`` (each column row's anchor key) travel with the block then. ``factor``: the weight of this
    process's sum of row losses (default ``W / sum(sizes)``, the module's weighting)."""
    terms, score, guide, keys = spec.terms, spec.score, spec.options.guide, spec.keys
    me, w = rank(), len(sizes)
    cols = list(cols)
    s = scale_value(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    b, offset = anchors.shape[0], spec.options.row_offset
    k = len(cols)
    pair = transposed_pair(terms, score, spec.options.false_negatives is not None)
    if offset or b != sizes[me]:  # the rows are not the block's: no softmax runs down its columns
        pair = None
    # a token score's logit costs q_tokens x d_tokens elements (the block plan's entry cost)
    cost = score.entry_cost(anchors, cols)
    tile = tile_side(spec.options.tile_size, spec.options.memory_budget, buffers=(3 + terms.guided) * cost)
    src = Sources.of(spec, anchors, cols, None, s, prenorm=False, with_grad=with_grad)
    gsrc, thr = guide_sources(guide, terms, 0, False, tile)
    fn = false_negatives(spec, src, offset, s, tile)  # every row's positive is in this process's own columns
    banked = [t for t in terms.terms if t.cols.startswith("bank")]
    visiting = [t for t in terms.terms if t.cols != "q_local" and t not in banked]
    local = [t for t in terms.terms if t.cols == "q_local"]
    reads_q_all = any(t.cols == "q_all" and (pair is None or t != pair[1]) for t in visiting)
    listed = spec.options.listed_negatives and k > 1
    if listed and guide is not None:
        raise ValueError(
            "listed_negatives=True on the ring: the lists travel without a guide's embeddings yet; drop the guide, "
            "or use the gathered strategy."
        )
    aligned = [0] if listed else list(range(k))  # the columns of one row per anchor
    names = [f"c{j}" for j in aligned] + (["q_all"] if reads_q_all else [])
    # what travels: the columns side by side (b, K', *row_shape); lists of hard negatives side by side, padded
    # to the longest (L, K - 1, *row_shape); the guide's (b, K, g); the keys (b, K' + 1); the lists' (L, K - 1)
    travelling = [*[cols[j] for j in aligned], anchors][: len(names)]
    row_shape = travelling[0].shape[1:]
    if any(t.shape[1:] != row_shape for t in travelling):
        raise ValueError(
            "the ring exchange sends the columns (and the anchors when a term reads them) side by side: their "
            f"rows must have one shape, got {[tuple(t.shape[1:]) for t in travelling]} (pad packed rows to a "
            "common width first)."
        )
    own = [torch.stack(travelling, dim=1).contiguous()]
    static_sizes: list[list[int] | None] = [None]
    list_names = [f"c{j}" for j in range(1, k)] if listed else []
    lists_own: list[int] = [len(cols[j]) for j in range(1, k)] if listed else []
    longest = 0
    if listed:
        if list_sizes is None or len(list_sizes) != k - 1:
            raise ValueError(
                "listed_negatives=True on the ring needs every process's rows of each list column."
            )
        longest = max(max(n) for n in list_sizes)
    lsizes = list_sizes or []
    if longest:
        padded = [_pad_rows(cols[j], longest) for j in range(1, k)]
        own.append(torch.stack(padded, dim=1).contiguous())
        static_sizes.append([longest] * w)
    if guide is not None:
        own.append(torch.stack(guide.candidates, dim=1).contiguous())
        static_sizes.append(None)
    if keys is not None:
        # each block row's anchor key: the rows' own, or (rows other than the block's) each positive's anchor's
        key_anchor = keys.anchors_all if keys.anchors_all is not None else keys.anchors
        if key_anchor is None:
            key_anchor = torch.full_like(keys.candidates[0], -1)
        own.append(torch.stack([*[keys.candidates[j] for j in aligned], key_anchor], dim=1).contiguous())
        static_sizes.append(None)
        if longest:
            own.append(
                torch.stack([_pad_rows(keys.candidates[j], longest) for j in range(1, k)], 1).contiguous()
            )
            static_sizes.append([longest] * w)
    n_groups = len(terms.weights)
    m, ssum = group_stats(n_groups, b, src.q)
    # a score that keeps per-block data (SparseDot's CSR forms) forgets a visiting block once scored:
    # the blocks of every process would otherwise pile up
    release = getattr(score.fn, "release", None) or (lambda: None)

    def bind_block(
        owner: int,
        tensors: list[Tensor],
        g_block: Tensor | None,
        *,
        g_lists: Tensor | None = None,
        **col_state: Any,
    ) -> list[Bound]:
        """The terms against a visiting block (and, for this process's own block, the local terms)."""
        rest = iter(tensors)
        blk = next(rest)
        lst = next(rest) if longest else None
        gblk = next(rest) if guide is not None else None
        kb = next(rest) if keys is not None else None
        list_kb = next(rest) if keys is not None and longest else None
        grads = {}
        if g_block is not None:  # this process's rows keep theirs; the block's travel with it
            grads = {r: g for r, g in src.grads.items() if r in ("q", "d")}
            grads.update({n: g_block[:, j] for j, n in enumerate(names)})
            if g_lists is not None:
                grads.update({n: g_lists[: lsizes[j][owner], j] for j, n in enumerate(list_names)})
        col_keys = None
        if kb is not None:
            anchor = kb[:, len(aligned)] if keys is not None and keys.anchors is not None else None
            block_keys = [kb[:, j] for j in range(len(aligned))]
            for j in range(len(list_names)):  # each list column's keys cut back to its owner's rows
                block_keys.append(list_kb[: lsizes[j][owner], j] if list_kb is not None else kb[:0, 0])
            col_keys = Keys(anchor, block_keys).sources(0, kb.shape[0])
        operands = {n: score.operand(blk[:, j], 1.0, prenormalize=False) for j, n in enumerate(names)}
        for j, n in enumerate(list_names):  # each list column cut back to its owner's rows
            rows_j = lst[: lsizes[j][owner], j] if lst is not None else blk[:0, 0]
            operands[n] = score.operand(rows_j, 1.0, prenormalize=False)
        visit = src.with_columns(operands, grads, col_keys)
        gvisit = None
        if gsrc is not None and gblk is not None:
            gvisit = gsrc.with_columns(
                {f"c{j}": Operand(gblk[:, j], True, 1.0, False) for j in range(k)}, {}, None
            )
        scored = [t for t in visiting if pair is None or t != pair[1]]  # the pair's back term rides along
        bound = bind(scored, visit, offset if owner == me else None, gvisit, thr, fn)
        if listed:  # a list column the owner has no entry of holds no logit
            bound = [x for x in bound if x.cols.n > 0]
        if pair is not None:
            bound = pair_up(bound, pair, terms.weights, **col_state)
        if owner == me and local:
            bound += bind(local, src, 0, gsrc, thr, fn)
        return bound

    def visit_stats(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        col_state: dict[str, Any] = (
            {"col_stats": (carried[0][:, 0], carried[0][:, 1])} if pair is not None else {}
        )
        flash.stats_or_tiles(
            bind_block(owner, tensors, None, **col_state), m, ssum, scale=s, row_tile=tile, col_tile=tile
        )
        release()

    # the column softmax's statistics of each block's positives travel with it and come home complete
    col_acc = [torch.stack(init_stats(b, src.q), dim=1)] if pair is not None else []
    col_acc = ring_exchange(own, col_acc, sizes, visit_stats, static_sizes)
    if pair is not None:
        g_back = pair[1].group  # joint with this process's own terms of the group, or alone
        merge_stats(m[g_back], ssum[g_back], col_acc[0][:, 0], col_acc[0][:, 1])
    row_grads = {r: g for r, g in src.grads.items() if r in ("q", "d")}

    def bank_ring(visit_bound: Any) -> None:
        """Each process's bank blocks visit this process's rows, one source after the other."""
        bank = spec.options.bank
        if not banked or bank is None or bank_shares is None:
            return
        for name, x, shares in (
            ("bank_c", bank.candidates, bank_shares[0]),
            ("bank_q", bank.anchors, bank_shares[1]),
        ):
            bank_t = [t for t in banked if t.cols == name]
            if not bank_t or not sum(shares):
                continue
            block = x if x is not None else bank.candidates[:0]

            def visit(
                owner: int,
                tensors: list[Tensor],
                carried: list[Tensor],
                bank_t: list = bank_t,
                name: str = name,
            ) -> None:
                if tensors[0].shape[0]:
                    ops = {name: score.operand(tensors[0], 1.0, prenormalize=False)}
                    visit_bound(bind(bank_t, src.with_columns(ops, row_grads, None), None, None, None, fn))

            ring_exchange([block.contiguous()], [], shares, visit)

    bank_ring(lambda bound: flash.stats_or_tiles(bound, m, ssum, scale=s, row_tile=tile, col_tile=tile))
    rows_lse, lse = row_lse(m, ssum)
    factor = w / sum(sizes) if factor is None else factor
    loss = (loss_sum(terms, rows_lse, src, offset, tile, s) * factor).to(src.q.dtype)
    if not with_grad:
        return loss, None, [], None, None
    gs_total = torch.zeros((), dtype=torch.float64, device=anchors.device)
    if pair is not None:  # in pass 2 each block's finished column statistics travel with it
        own.append(lse[pair[1].group].stacked())

    def visit_grads(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        nonlocal gs_total
        col_state = {"col_lse": LogSumExp.unstack(tensors[-1])} if pair is not None else {}
        g_lists = carried[1] if longest else None
        bound = bind_block(
            owner, tensors[:-1] if pair is not None else tensors, carried[0], g_lists=g_lists, **col_state
        )
        gs_total += flash.grads_or_tiles(
            bound, lse, terms.weights, scale=s, row_tile=tile, col_tile=tile, need_scale_grad=need_scale_grad
        )
        release()

    g_block = torch.zeros(sizes[me], len(names), *row_shape, dtype=src.q.dtype, device=anchors.device)
    carried = [g_block]
    if longest:  # the lists' gradients travel with them
        carried.append(g_block.new_zeros(longest, k - 1, *row_shape))
    g_block, *g_lists = ring_exchange(own, carried, sizes, visit_grads, static_sizes, static_sizes)

    def bank_grads(bound: list[Bound]) -> None:
        nonlocal gs_total
        gs_total += flash.grads_or_tiles(
            bound, lse, terms.weights, scale=s, row_tile=tile, col_tile=tile, need_scale_grad=need_scale_grad
        )

    bank_ring(bank_grads)
    for j, n in enumerate(names):
        src.grads[n if n != "q_all" else "q_local"].add_(g_block[:, j])
    for j, n in enumerate(list_names):
        if g_lists:
            src.grads[n].add_(g_lists[0][: lists_own[j], j])
    g_a, g_c, _ = finish_grads(src, anchors, cols, None, s, factor, tile)
    g_s = None
    if need_scale_grad:
        # every process holds part of d(sum_r L_r)/ds = W dL/ds; the average is the true gradient
        gs = all_reduce_sum((gs_total * factor).reshape(1), "all_reduce_scale")[0] / w
        g_s = (gs / s).to(scale.dtype)  # type: ignore[union-attr]
    return loss, g_a, g_c, None, g_s
