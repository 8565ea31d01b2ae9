"""Where the rows are: the sigmoid loss's three drivers, one signature (this process's embeddings, every
process's row count ``sizes`` in rank order or None, the options, the weight of the sum in the gradients and
the gradients wanted), each returning [`PairSums`][st_cached_losses.functional.sigmoid.blocks.PairSums] of this process's rows:

* [`local_pairs`][st_cached_losses.functional.sigmoid.drivers.local_pairs]: one process, its rows against the given columns (and the bank).
* [`gathered_pairs`][st_cached_losses.functional.sigmoid.drivers.gathered_pairs]: the candidate columns of every process are all-gathered once (side by
  side, one collective), this process's positives sit at its row offset, and every process's gradients wrt
  the gathered columns are summed over processes (one all-reduce: the gather's true backward) before each
  keeps its own rows. Memory ``O(B_global x K x d)`` per process.
* [`ring_pairs`][st_cached_losses.functional.sigmoid.drivers.ring_pairs]: the candidate blocks travel around a ring of processes (asynchronous send /
  receive, the next block in flight while the current one is scored); a visiting block's gradient travels
  with it and is home, complete, after the circle (SigLIP's own scheme: no statistics have to travel, as
  every pair's term is independent). Memory ``O(local B x K x d)`` per process, whatever the number of
  processes.

Weighting across processes (the caller's ``factor``): process ``r`` returns ``W / B_global`` times the sum
of its rows' terms, so the mean over processes is the paper's loss of the global batch,
``-(1 / B_global) sum_ij``, and DDP's gradient average is exactly the full-batch gradient, even when
processes hold different numbers of rows. The scale and the bias live outside DDP (they belong to the
loss): their gradients are averaged over processes here (one all-reduce of two numbers), so every process
steps them by the full-batch gradient and they stay equal everywhere (a copy inside DDP would be averaged
again, which changes nothing).

Across processes every process must call with the same options and ask for the same gradients (the
collectives must match); finiteness and shapes are agreed on first by
[`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]."""

from __future__ import annotations

import torch
from torch import Tensor

from st_cached_losses.functional.checks import bias_value, scale_value
from st_cached_losses.functional.distributed import all_gather_rows, all_reduce_sum, rank, ring_exchange
from st_cached_losses.functional.kernels.tiles import Operand, Plan, plan_blocks
from st_cached_losses.functional.placement import column_sizes
from st_cached_losses.functional.precision import accumulation_dtype
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.sigmoid.blocks import PairBlocks, PairSums, Wanted, solve_local
from st_cached_losses.functional.sigmoid.options import SigmoidOptions

__all__ = ["block_plan", "gathered_pairs", "local_pairs", "mean_over_processes", "ring_pairs"]

#: fp32 blocks of ``rows x columns`` a block holds at once: the logits and their softplus / sigmoid
BLOCK_BUFFERS = 2


def block_plan(n_rows: int, n_cols: int, opts: SigmoidOptions, score: Score, want: Wanted) -> Plan:
    """The block sizes of ``n_rows`` rows against columns of up to ``n_cols`` entries (the scale's gradient
    keeps the logits beside the biased ones, and a function score its tile's autograd graph: one more block
    each)."""
    buffers = BLOCK_BUFFERS + want.scale + (not score.gemm)
    return plan_blocks(
        n_rows, max(n_cols, 1), path=opts.path, chunk_size=opts.chunk_size, tile_size=opts.tile_size,
        memory_budget=opts.memory_budget, buffers=buffers,
    )  # fmt: skip


def _bank_shares(bank: Tensor | None, w: int) -> list[int]:
    """Every process's rows of its share of the bank, in rank order (one small all-gather); without a bank
    (None on every process: the option is the same everywhere), no collective."""
    if bank is None:
        return [0] * w
    n = torch.tensor([[bank.shape[0]]], dtype=torch.long, device=bank.device)
    return all_gather_rows(n, [1] * w)[:, 0].tolist()


def mean_over_processes(sums: PairSums, w: int) -> None:
    """The scale's and the bias's gradients averaged over the ``w`` processes, in place (one all-reduce)."""
    wanted = [g for g in (sums.grad_scale, sums.grad_bias) if g is not None]
    if not wanted or w == 1:
        return
    total = all_reduce_sum(torch.stack(wanted), "all_reduce_scale") / w
    it = iter(total)
    if sums.grad_scale is not None:
        sums.grad_scale = next(it)
    if sums.grad_bias is not None:
        sums.grad_bias = next(it)


def local_pairs(
    anchors: Tensor,
    cols: list[Tensor],
    sizes: list[int] | None,
    opts: SigmoidOptions,
    *,
    factor: float,
    want: Wanted,
) -> PairSums:
    """This process's rows ``anchors (B, d)`` against the columns ``cols`` (``K`` of ``(N, d)``, positives at
    ``opts.row_offset``) and ``opts.bank``; ``factor``: the weight of the sum in the gradients. ``sizes`` is
    not read (one process)."""
    score = opts.score(anchors)
    n_bank = opts.bank.shape[0] if opts.bank is not None else 0
    plan = block_plan(anchors.shape[0], max(*(c.shape[0] for c in cols), n_bank), opts, score, want)
    s, bias = scale_value(opts.scale), bias_value(opts.bias)
    return solve_local(
        anchors, cols, opts.bank, score=score, scale=s, bias=bias, row_offset=opts.row_offset, plan=plan,
        factor=factor, want=want,
    )  # fmt: skip


def gathered_pairs(
    anchors: Tensor,
    cols: list[Tensor],
    sizes: list[int] | None,
    opts: SigmoidOptions,
    *,
    factor: float,
    want: Wanted,
) -> PairSums:
    """This process's rows against every process's candidate columns, gathered (see the module's notes).

    Args:
        anchors: ``(b, d)`` this process's anchors; ``cols``: ``K`` of ``(b, d)``, its positives then its
            hard-negative columns; ``sizes``: every process's ``b``; ``opts.bank``: its share of the bank.
        factor: the weight of the sum in the gradients (``grad_output * W / B_global``).

    Collectives: one all-gather of the columns (and, with a bank, one of its shares' sizes and one of the
    shares); with gradients, one all-reduce of the columns' gradients and one of the scale's and bias's."""
    assert sizes is not None  # across processes
    if opts.listed_negatives:
        return _gathered_lists(anchors, cols, sizes, opts, factor=factor, want=want)
    me, w = rank(), len(sizes)
    score = opts.score(anchors)
    start = sum(sizes[:me])
    # (N, K, d): the columns side by side, one collective; each column a strided (N, d) view
    gathered = all_gather_rows(torch.stack(cols, dim=1), sizes)
    cols_all = list(gathered.unbind(1))
    bank = opts.bank
    shares = _bank_shares(bank, w)
    if bank is not None and max(shares) > 0:
        bank = all_gather_rows(bank, shares)
    n = gathered.shape[0]
    plan = block_plan(anchors.shape[0], max(n, bank.shape[0] if bank is not None else 0), opts, score, want)
    g_cols = None
    if want.embeddings:  # (K, N, d): each column's buffer contiguous, one collective for all
        g_cols = torch.zeros(
            len(cols), n, anchors.shape[1], dtype=accumulation_dtype(anchors), device=anchors.device
        )
    s, bias = scale_value(opts.scale), bias_value(opts.bias)
    sums = solve_local(
        anchors, cols_all, bank, score=score, scale=s, bias=bias, row_offset=start, plan=plan, factor=factor,
        want=want, grad_cols=g_cols,
    )  # fmt: skip
    if g_cols is not None:
        # every process scored everyone's columns: sum their gradients, keep this process's rows
        all_reduce_sum(g_cols, "all_reduce_grad")
        sums.grad_cols = list(g_cols[:, start : start + sizes[me]].unbind(0))
    mean_over_processes(sums, w)
    return sums


def _gathered_lists(
    anchors: Tensor,
    cols: list[Tensor],
    sizes: list[int],
    opts: SigmoidOptions,
    *,
    factor: float,
    want: Wanted,
) -> PairSums:
    """[`gathered_pairs`][st_cached_losses.functional.sigmoid.drivers.gathered_pairs] with lists of hard
    negatives (``cols[1:]`` of each process's own lengths, agreed in one small all-gather): each column
    gathered at every process's lengths, the gradients of every column summed over processes in one
    all-reduce."""
    me, w = rank(), len(sizes)
    score = opts.score(anchors)
    start = sum(sizes[:me])
    per_column = column_sizes(cols, sizes, True)
    cols_all = [all_gather_rows(c, n) if max(n) > 0 else c for c, n in zip(cols, per_column)]
    bank = opts.bank
    shares = _bank_shares(bank, w)
    if bank is not None and max(shares) > 0:
        bank = all_gather_rows(bank, shares)
    longest = max(*(c.shape[0] for c in cols_all), bank.shape[0] if bank is not None else 0)
    plan = block_plan(anchors.shape[0], longest, opts, score, want)
    g_cols = None
    if want.embeddings:  # one buffer, each column's rows a span of it: one collective for all
        dtype = accumulation_dtype(anchors)
        flat = torch.zeros(
            sum(c.shape[0] for c in cols_all), anchors.shape[1], dtype=dtype, device=anchors.device
        )
        g_cols = list(flat.split([c.shape[0] for c in cols_all]))
    s, bias = scale_value(opts.scale), bias_value(opts.bias)
    sums = solve_local(
        anchors, cols_all, bank, score=score, scale=s, bias=bias, row_offset=start, plan=plan, factor=factor,
        want=want, grad_cols=g_cols,
    )  # fmt: skip
    if g_cols is not None:
        # every process scored everyone's columns: sum their gradients, keep this process's rows
        all_reduce_sum(flat, "all_reduce_grad")
        sums.grad_cols = [
            g[sum(n[:me]) : sum(n[: me + 1])]
            for g, n in zip(flat.split([c.shape[0] for c in cols_all]), per_column)
        ]
    mean_over_processes(sums, w)
    return sums


def ring_pairs(
    anchors: Tensor,
    cols: list[Tensor],
    sizes: list[int] | None,
    opts: SigmoidOptions,
    *,
    factor: float,
    want: Wanted,
) -> PairSums:
    """[`gathered_pairs`][st_cached_losses.functional.sigmoid.drivers.gathered_pairs] by ring exchange (same arguments): the columns of every process visit this
    process's rows once, side by side as one ``(b_r, K, d)`` block in the inputs' dtype, the next block in
    flight while the current one is scored; the block's gradient ``(b_r, K, d)`` (fp32) travels with it and
    comes home complete. A bank's shares go round a ring of their own after the columns, nothing travelling
    with them (no gradient goes to the bank).

    Collectives: ``W - 1`` sends and receives of each block (and of each gradient block, ``W`` hops), one
    small all-gather of the bank shares' sizes (and their ring), one all-reduce of the scale's and bias's
    gradients."""
    assert sizes is not None  # across processes
    me, w = rank(), len(sizes)
    score = opts.score(anchors)
    # lists of hard negatives: those columns (each process's own lengths) travel apart, side by side in one
    # block padded to the longest of every process, their gradient block with them
    list_sizes = column_sizes(cols, sizes, True)[1:] if opts.listed_negatives else []
    longest = max((max(n) for n in list_sizes), default=0)
    aligned = cols[:1] if opts.listed_negatives else cols
    k = len(aligned)
    bank = opts.bank
    shares = _bank_shares(bank, w)
    plan = block_plan(anchors.shape[0], max(max(sizes), max(shares), longest), opts, score, want)
    prenorm = plan.path == "chunked"
    s, bias = scale_value(opts.scale), bias_value(opts.bias)
    blocks = PairBlocks(
        anchors, score, s, bias, row_tile=plan.row_tile, col_tile=plan.col_tile, prenormalize=prenorm,
        want=want,
    )  # fmt: skip

    def visit(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
        block = tensors[0]  # (b_owner, K, d)
        for j in range(k):
            g = carried[0][:, j] if carried else None  # (b_owner, d), strided
            blocks.visit(score.operand(block[:, j], 1.0, prenorm), g, 0 if j == 0 and owner == me else None)
        for j, n in enumerate(list_sizes):  # each list column cut back to its owner's rows
            if n[owner]:
                g = carried[1][: n[owner], j] if carried else None
                blocks.visit(score.operand(tensors[1][: n[owner], j], 1.0, prenorm), g, None)

    travelling = [torch.stack(aligned, dim=1).contiguous()]
    block_sizes: list[list[int] | None] = [None]
    if longest:
        padded = [torch.cat([c, c.new_zeros(longest - c.shape[0], *c.shape[1:])]) for c in cols[1:]]
        travelling.append(torch.stack(padded, dim=1).contiguous())
        block_sizes.append([longest] * w)
    g_home: list[Tensor] = []
    if want.embeddings:
        g_home = [
            torch.zeros(anchors.shape[0], k, anchors.shape[1], dtype=blocks.rows.dtype, device=anchors.device)
        ]
        if longest:
            g_home.append(g_home[0].new_zeros(longest, len(list_sizes), anchors.shape[1]))
    g_home = ring_exchange(travelling, g_home, sizes, visit, block_sizes, block_sizes)
    if bank is not None and max(shares) > 0:

        def visit_bank(owner: int, tensors: list[Tensor], carried: list[Tensor]) -> None:
            if tensors[0].shape[0]:
                blocks.visit(score.operand(tensors[0], 1.0, prenorm), None, None)

        ring_exchange([bank.contiguous()], [], shares, visit_bank)
    grad_cols = []
    if g_home:  # wrt this process's own columns, complete: every process's rows scored them
        own = [Operand(c, score.cosine, 1.0, prenormalize=False) for c in cols]
        grad_cols = [blocks.column_grad(op, g_home[0][:, j], factor) for j, op in enumerate(own[:k])]
        for j, op in enumerate(own[k:]):
            g = g_home[1][: cols[k + j].shape[0], j] if longest else cols[k + j].new_zeros(cols[k + j].shape)
            grad_cols.append(blocks.column_grad(op, g, factor))
    g_rows, g_s, g_b = blocks.finish(factor)
    sums = PairSums(blocks.loss, g_rows, grad_cols, g_s, g_b)
    mean_over_processes(sums, w)
    return sums
