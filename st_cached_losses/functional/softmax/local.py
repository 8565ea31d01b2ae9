"""The local driver: this process's rows against the given (possibly gathered) columns. The chunked path
holds, for a chunk of rows, the logits of every term against every column at once (one pass: loss and
gradients, nothing recomputed); the tiled path, and the chunked one when a softmax runs down the columns
(the symmetric loss sharing its tiles, [`binding`][st_cached_losses.functional.softmax.binding]), makes a statistics pass and a gradient pass,
``O((B + N) d)`` memory plus a few blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from st_cached_losses.functional.checks import scale_value
from st_cached_losses.functional.kernels.tiles import LogSumExp, plan_blocks
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
from st_cached_losses.functional.softmax.options import LossSpec
from st_cached_losses.functional.softmax.terms import fused_chunk

__all__ = ["LocalCall", "terms_solve"]


class LocalCall:
    """One process's rows against the given (possibly gathered) columns: operands, buffers, the bound
    terms and the per-group running statistics ``(groups, B)``; a statistics pass and a gradient pass, or
    both in one (``one_pass``: the fused chunks, when no softmax runs down the columns)."""

    def __init__(
        self, spec: LossSpec, anchors: Tensor, cols: list[Tensor], anchors_all: Tensor | None, s: float,
        *, with_grad: bool, one_pass: bool, need_scale_grad: bool,
    ) -> None:  # fmt: skip
        terms, b, o = spec.terms, anchors.shape[0], spec.options
        self.spec, self.s, self.b = spec, s, b
        self.anchors, self.cols, self.anchors_all = anchors, cols, anchors_all
        # the doc_to_query tiles are the transposes of query_to_doc's on one process (columns = these rows)
        filtered = o.false_negatives is not None
        pair = (
            transposed_pair(terms, spec.score, filtered)
            if anchors_all is None and cols[0].shape[0] == b
            else None
        )
        # sharing tiles needs two passes, 4 GEMMs per shared tile and per other term; the fused chunks
        # take 3 per term in one pass: with four terms or more, those are cheaper
        n_terms = len(terms.terms)
        if pair is not None and one_pass and o.path != "tiled" and 4 * (n_terms - 1) >= 3 * n_terms:
            pair = None
        scored = [t for t in terms.terms if pair is None or t != pair[1]]
        bank_c, bank_q = o.bank.sizes if o.bank is not None else (0, 0)
        # every source's own length: lists of hard negatives (listed_negatives) have any number of rows
        n_cols = {
            "q_local": b,
            "bank_c": bank_c,
            "bank_q": bank_q,
            **{f"c{k}": len(c) for k, c in enumerate(cols)},
        }
        width = sum(n_cols.get(t.cols, cols[0].shape[0]) for t in scored)
        one_pass = one_pass and pair is None
        buffers = (1 + need_scale_grad + terms.guided) if one_pass else 3 + terms.guided
        self.plan = plan_blocks(
            b, width, path=o.path, chunk_size=o.chunk_size, tile_size=o.tile_size, memory_budget=o.memory_budget,
            # a token score's chunks are as thin as the others': each chunk reads every column's tokens
            # again (MaxSim, B = 512, 180 document tokens: 1-row chunks 19 s, tiles 5.5 s)
            buffers=buffers * spec.score.entry_cost(anchors, cols),
        )  # fmt: skip
        self.fused = one_pass and self.plan.path == "chunked"
        prenorm = self.plan.path == "chunked"
        self.src = Sources.of(spec, anchors, cols, anchors_all, s, prenorm=prenorm, with_grad=with_grad)
        gsrc, thr = guide_sources(o.guide, terms, o.row_offset, prenorm, self.plan.row_tile)
        self.m, self.ssum = group_stats(len(terms.weights), b, self.src.q)
        # a list of hard negatives may be empty (listed_negatives): its terms hold no logit
        fn = false_negatives(spec, self.src, o.row_offset, s, self.plan.row_tile)
        self.bound = [x for x in bind(terms.terms, self.src, o.row_offset, gsrc, thr, fn) if x.cols.n > 0]
        self.pair = pair
        if pair is not None:
            g_back = pair[1].group  # the columns are these rows: their statistics are the group's own
            self.bound = pair_up(
                self.bound, pair, terms.weights, col_stats=(self.m[g_back], self.ssum[g_back])
            )

    def stats(self) -> tuple[Tensor, list[LogSumExp]]:
        """First pass: every group's statistics; their log-sum-exp per row, ``(G, b)`` fp64, and them."""
        p = self.plan
        flash.stats_or_tiles(
            self.bound, self.m, self.ssum, scale=self.s, row_tile=p.row_tile, col_tile=p.col_tile
        )
        return row_lse(self.m, self.ssum)

    def grads(self, lse: list[LogSumExp], need_scale_grad: bool) -> Tensor:
        """Second pass: the gradients into the buffers; returns ``sum(G * s * sim)``."""
        bound = self.bound
        if self.pair is not None:
            col_lse = lse[self.pair[1].group]
            bound = [replace(x, col_lse=col_lse) if x.col_group is not None else x for x in bound]
        p = self.plan
        return flash.grads_or_tiles(
            bound, lse, self.spec.terms.weights, scale=self.s, row_tile=p.row_tile, col_tile=p.col_tile,
            need_scale_grad=need_scale_grad,
        )  # fmt: skip

    def solve_fused(self, with_grad: bool, need_scale_grad: bool) -> tuple[Tensor, Tensor]:
        """Both passes in one (no softmax runs down the columns): every group's log-sum-exp per row
        ``(G, b)`` fp64 and ``sum(G * s * sim)``."""
        weights = self.spec.terms.weights
        done = flash.fused(
            self.bound, weights, n_rows=self.b, need_grads=with_grad, need_scale_grad=need_scale_grad
        )
        if done is not None:
            return done
        return fused_chunk(
            self.bound, weights, n_rows=self.b, scale=self.s, chunk=self.plan.row_tile, need_grads=with_grad,
            need_scale_grad=need_scale_grad,
        )  # fmt: skip

    def loss(self, lse: Tensor) -> Tensor:
        """The mean loss over this process's rows, in the compute dtype, from the ``(G, b)`` log-sum-exps."""
        total = loss_sum(
            self.spec.terms, lse, self.src, self.spec.options.row_offset, self.plan.row_tile, self.s
        )
        return (total / self.b).to(self.src.q.dtype)

    def finish(
        self, grad_output: float, gs: Tensor, scale_dtype: torch.dtype | None
    ) -> tuple[Tensor, list[Tensor], Tensor | None, Tensor | None]:
        """The gradients of ``grad_output * loss`` wrt the caller's tensors (and the scale)."""
        factor = float(grad_output) / self.b
        tile = self.plan.row_tile
        g_a, g_c, g_all = finish_grads(
            self.src, self.anchors, self.cols, self.anchors_all, self.s, factor, tile
        )
        g_s = (gs * factor / self.s).to(scale_dtype) if scale_dtype is not None else None
        return g_a, g_c, g_all, g_s


def terms_solve(
    spec: LossSpec, anchors: Tensor, cols: Sequence[Tensor], *, scale: float | Tensor,
    anchors_all: Tensor | None, grad_output: float, with_grad: bool,
) -> Solution:  # fmt: skip
    """The mean loss of this process's rows against the given (possibly gathered) columns, and its
    gradients when asked for (of ``grad_output * loss``, in the inputs' dtypes, without a graph): one pass
    over row chunks where it can, else a statistics and a gradient pass."""
    s = scale_value(scale)
    need_scale_grad = with_grad and isinstance(scale, Tensor) and scale.requires_grad
    with spec.score.products.pinned(anchors.device):
        call = LocalCall(
            spec, anchors, list(cols), anchors_all, s, with_grad=with_grad,
            one_pass=with_grad or spec.options.path != "tiled", need_scale_grad=need_scale_grad,
        )  # fmt: skip
        if call.fused:
            rows_lse, gs = call.solve_fused(with_grad, need_scale_grad)
        else:
            rows_lse, lse = call.stats()
            gs = call.grads(lse, need_scale_grad) if with_grad else torch.zeros(())
    loss = call.loss(rows_lse)
    if not with_grad:
        return loss, None, [], None, None
    scale_dtype = scale.dtype if need_scale_grad else None  # type: ignore[union-attr]
    return (loss, *call.finish(grad_output, gs, scale_dtype))
