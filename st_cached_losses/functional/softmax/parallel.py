"""InfoNCE across processes: each process scores its own rows against every process's candidates.

Two strategies behind one signature: both take this process's embeddings and every process's row
count ``sizes`` (rank order), and return this process's share of the loss with its gradients wrt this
process's embeddings, as an [`InfoNCEOutput`][st_cached_losses.functional.softmax.loss.InfoNCEOutput]:

* [`gathered_loss_and_grad`][st_cached_losses.functional.softmax.parallel.gathered_loss_and_grad]: the candidates (and, symmetric, the anchors) are all-gathered once;
  every process's gradients wrt the gathered rows are summed over processes (the gather's true
  backward, seed 002) and each keeps its own slice. Memory ``O(B_global x d)`` per process.
* [`ring_loss_and_grad`][st_cached_losses.functional.softmax.parallel.ring_loss_and_grad]: candidate blocks travel around a ring (Inf-CL); nothing is gathered.
  Memory ``O(local B x d)`` per process, whatever the number of processes.

Packed rows (a score of 3-D rows: MaxSim / MeanMaxSim / XTR token rows ``(n, t, d + 1)``, SparseDot's
sparse rows ``(n, k, 2)``) may have a width of their own on each process: both strategies pad them to the
widest of every process first (one all-reduce of the widths, none outside a process group; the padding is
zeros, mask 0, or index 0 and value 0: it changes no score and its gradient is 0) and return each
process's gradients at its own width.

Weighting: process ``r`` returns ``W / B_global * sum_{i in r} loss_i``, so the mean over processes is
the global mean loss and DDP's gradient average is the exact full-batch gradient, even when processes
hold different numbers of rows. A tensor scale lives outside DDP: its gradient is averaged here.

[`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes] is the step's first collective (row counts, shapes and finiteness in one small
all-gather); [`gathered_infonce`][st_cached_losses.functional.softmax.parallel.gathered_infonce] is the gathered loss with autograd."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.distributed import (
    all_gather_rows,
    all_reduce_min,
    all_reduce_sum,
    gather_with_grad,
    is_distributed,
    own_rows,
    rank,
    ring_exchange,
    world_size,
)
from st_cached_losses.functional.placement import (
    agree_on_sizes,
    agree_on_sizes_and_tag,
    column_sizes,
    mean_scale_grad,
    placement,
)
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.representations.multi_vector import pad_tokens
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.softmax.loss import InfoNCEOutput, infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import Bank, Guide, InfoNCEOptions
from st_cached_losses.functional.softmax.own import (
    in_batch_negatives,
    own_candidates_infonce,
    own_candidates_loss_and_grad,
)
from st_cached_losses.functional.softmax.ring import ring_terms_solve
from st_cached_losses.functional.softmax.terms import bank_terms

__all__ = [
    "agree_on_sizes",
    "agree_on_sizes_and_tag",
    "bank_sizes",
    "gathered_bank",
    "gathered_infonce",
    "gathered_loss_and_grad",
    "loss_and_grad",
    "mean_scale_grad",
    "pad_to_common_tokens",
    "ring_loss_and_grad",
]


def bank_sizes(bank: Bank) -> tuple[list[int], list[int]]:
    """Every process's rows of its share of a negative bank, candidates and anchors, in rank order (one
    small all-gather; this process's alone outside a process group)."""
    n_c, n_q = bank.sizes
    if not is_distributed():
        return [n_c], [n_q]
    counts = all_gather_rows(
        torch.tensor([[n_c, n_q]], dtype=torch.long, device=bank.candidates.device), [1] * world_size()
    )  # (W, 2)
    return counts[:, 0].tolist(), counts[:, 1].tolist()


def gathered_bank(bank: Bank) -> Bank:
    """Every process's share of a negative bank, concatenated in rank order (no autograd: nothing flows
    to the bank). Every process calls it, whatever its own share holds."""
    c_sizes, q_sizes = bank_sizes(bank)
    empty = bank.candidates[:0]
    candidates = all_gather_rows(bank.candidates, c_sizes) if sum(c_sizes) else empty
    anchors = None
    if sum(q_sizes):
        anchors = all_gather_rows(bank.anchors if bank.anchors is not None else empty, q_sizes)
    return Bank(candidates, anchors)


def pad_to_common_tokens(columns: Sequence[Tensor]) -> list[Tensor]:
    """Packed columns (token rows ``(b, t_k, d + 1)``, [`multi_vector`][st_cached_losses.functional.representations.multi_vector]; sparse rows ``(b, k, 2)``,
    [`sparse`][st_cached_losses.functional.representations.sparse]) padded on the right with zeros to the widest ``t_k`` of every process, column by
    column, so that they can be gathered (see the module's notes on packed rows)."""
    return [pad_tokens(c, w) for c, w in zip(columns, _widest(columns))]


def _widest(tensors: Sequence[Tensor]) -> list[int]:
    """Each tensor's dim 1 (packed rows' width) widened to the widest of every process at that position."""
    widths = torch.tensor([-t.shape[1] for t in tensors], dtype=torch.long, device=tensors[0].device)
    all_reduce_min(widths, "all_reduce_token_widths")  # min of the negated widths: the widest
    return [-w for w in widths.tolist()]


def _trimmed(grads: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """Gradients wrt padded packed rows cut back to the caller's own widths (the padding's are 0)."""
    return [g[:, : x.shape[1]] if g.dim() == 3 else g for g, x in zip(grads, like)]


def _own_rows_only(opts: InfoNCEOptions) -> None:
    """The strategies place every process's rows themselves: the options say nothing of where they are."""
    if opts.anchors_all is not None or opts.row_offset != 0 or opts.anchors_all_keys is not None:
        raise ValueError(
            "the strategies across processes take this process's rows and gather what they need: pass "
            "neither anchors_all, row_offset nor anchors_all_keys."
        )


def _gathered(
    gather: Callable[[Tensor, list[int]], Tensor],
    anchors: Tensor,
    candidates: Sequence[Tensor],
    sizes: list[int],
    opts: InfoNCEOptions,
) -> tuple[list[Tensor], InfoNCEOptions]:
    """Every process's candidate columns (``gather``: with or without autograd) and the options of this
    process's rows against them: where its positives are, the gathered anchors when a term reads them, the
    keys (every column's in one collective) and the guide's candidates."""
    _own_rows_only(opts)
    layout: dict[str, Any] = {"row_offset": sum(sizes[: rank()]), "check_finite": False}  # agree_on_sizes's
    per_column = column_sizes(candidates, sizes, opts.listed_negatives)
    if opts.candidate_keys is not None:
        # without anchor keys the pairs are compared by their positives only, as on one process and the ring;
        # the row-aligned keys in one collective, each list column's at its own lengths
        n_aligned = 1 if opts.listed_negatives else len(opts.candidate_keys)
        keys = [*opts.candidate_keys[:n_aligned]] + (
            [opts.anchor_keys] if opts.anchor_keys is not None else []
        )
        all_keys = all_gather_rows(torch.stack(keys, dim=1), sizes)
        layout["candidate_keys"] = [all_keys[:, j] for j in range(n_aligned)] + [
            all_gather_rows(k, n) if max(n) > 0 else k
            for k, n in zip(opts.candidate_keys[n_aligned:], per_column[n_aligned:])
        ]
        if opts.anchor_keys is not None:
            layout["anchors_all_keys"] = all_keys[:, -1]
    if opts.uses_anchors_all:
        layout["anchors_all"] = gather(anchors, sizes)
    if opts.guide is not None:  # its anchors stay: rows are this process's; its columns as the rows' (lists)
        layout["guide"] = Guide(
            opts.guide.anchors,
            [all_gather_rows(c, n) if max(n) > 0 else c for c, n in zip(opts.guide.candidates, per_column)],
        )
    if opts.bank is not None:
        layout["bank"] = gathered_bank(opts.bank)
    cols = [gather(c, n) if max(n) > 0 else c for c, n in zip(candidates, per_column)]
    return cols, replace(opts, **layout)


@fp32_loss_stage
def gathered_loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    sizes: list[int],
    options: InfoNCEOptions | None = None,
    *,
    with_grad: bool = True,
    **keywords: Any,
) -> InfoNCEOutput:
    """This process's share of the global InfoNCE, against all-gathered candidates.

    Args:
        anchors: ``(b, d)`` this process's anchors; ``candidates``: ``K x (b, d)``, its positives then
            hard negatives; ``sizes``: every process's ``b`` in rank order ([`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]).
        options: the loss's options ([`InfoNCEOptions`][st_cached_losses.functional.softmax.options.InfoNCEOptions]; ``keywords`` replace its fields)
            but where the rows are, which this sets; the keys and the guide's embeddings are gathered with
            the embeddings, and a tensor scale's gradient is averaged over processes.
        with_grad: also the gradients wrt this process's embeddings; else the loss only.

    Collectives: one all-gather per gathered tensor (the keys in one), and with ``with_grad`` one
    all-reduce per gathered tensor (and one for a tensor scale's gradient)."""
    opts = InfoNCEOptions.of(options, keywords)
    given = [anchors, *candidates]
    if Score(opts.similarity).packed:  # packed rows: every process's padded to one width per column
        anchors, *candidates = pad_to_common_tokens(given)
    cands_all, core = _gathered(all_gather_rows, anchors, candidates, sizes, opts)
    per_column = column_sizes(candidates, sizes, opts.listed_negatives)
    w, b = len(sizes), anchors.shape[0]
    factor = w / sum(sizes) * b  # the module's weighting; the core averages over local rows
    if not with_grad:
        return InfoNCEOutput(infonce(anchors, cands_all, core) * factor, None, [], None, None)
    out = infonce_loss_and_grad(anchors, cands_all, core, grad_output=factor)
    # every process scored everyone's candidates: sum their gradients, keep this process's rows (a list
    # column no process has an entry of has none to sum)
    g_cands = [
        own_rows(all_reduce_sum(g, "all_reduce_grad"), n) if max(n) > 0 else g
        for g, n in zip(out.grad_candidates, per_column)
    ]
    g_anchors = out.grad_anchors
    if out.grad_anchors_all is not None and g_anchors is not None:
        g_anchors = g_anchors + own_rows(all_reduce_sum(out.grad_anchors_all, "all_reduce_grad"), sizes)
    assert g_anchors is not None  # asked for
    g_anchors, *g_cands = _trimmed([g_anchors, *g_cands], given)
    return InfoNCEOutput(out.loss * factor, g_anchors, g_cands, None, mean_scale_grad(out.grad_scale, w))


@fp32_loss_stage
def loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    sizes: list[int] | None,
    options: InfoNCEOptions | None = None,
    *,
    ring: bool = False,
    with_grad: bool = True,
    **keywords: Any,
) -> InfoNCEOutput:
    """The loss stage wherever the rows are: one process (``sizes`` None: ``infonce_loss_and_grad``),
    gathered, or by ring exchange (``ring``); ``options`` / ``keywords``: [`InfoNCEOptions`][st_cached_losses.functional.softmax.options.InfoNCEOptions].
    Finiteness must have been checked by [`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]."""
    opts = InfoNCEOptions.of(options, keywords)
    anchors, candidates = anchors.detach(), [c.detach() for c in candidates]
    where = placement(sizes, ring=ring, in_batch=in_batch_negatives(opts))
    if where == "own":
        return _own_loss_and_grad(anchors, candidates, sizes, opts, with_grad)
    if sizes is not None:  # gathered or ring
        strategy = ring_loss_and_grad if where == "ring" else gathered_loss_and_grad
        return strategy(anchors, candidates, sizes, opts, with_grad=with_grad)
    opts = replace(opts, check_finite=False)
    if with_grad:
        return infonce_loss_and_grad(anchors, candidates, opts)
    with torch.no_grad():
        loss = infonce(anchors, candidates, opts)
    return InfoNCEOutput(loss, None, [], None, None)


def _own_loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    sizes: list[int] | None,
    opts: InfoNCEOptions,
    with_grad: bool,
) -> InfoNCEOutput:
    """Each row against its own candidates ([`own`][st_cached_losses.functional.softmax.own]): across processes nothing is
    gathered, each process weighs its rows' mean as the module says and averages a tensor scale's gradient."""
    factor = 1.0
    if sizes is not None:
        _own_rows_only(opts)
        factor = len(sizes) / sum(sizes) * anchors.shape[0]
    out = own_candidates_loss_and_grad(
        anchors, candidates, replace(opts, check_finite=False), factor=factor, with_grad=with_grad
    )
    grad_scale = mean_scale_grad(out.grad_scale, len(sizes)) if sizes is not None else out.grad_scale
    return InfoNCEOutput(out.loss, out.grad_anchors, out.grad_candidates, None, grad_scale)


@fp32_loss_stage
def gathered_infonce(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    sizes: list[int],
    options: InfoNCEOptions | None = None,
    **keywords: Any,
) -> Tensor:
    """[`gathered_loss_and_grad`][st_cached_losses.functional.softmax.parallel.gathered_loss_and_grad]'s loss with autograd: the gather's backward sums over processes,
    and a tensor scale's gradient is averaged over processes by a hook."""
    opts = InfoNCEOptions.of(options, keywords)
    w, b = len(sizes), anchors.shape[0]
    if isinstance(opts.scale, Tensor) and opts.scale.requires_grad:
        opts.scale.register_hook(lambda g: all_reduce_sum(g.clone(), "all_reduce_scale") / w)
    if placement(sizes, in_batch=in_batch_negatives(opts)) == "own":  # nothing to gather
        _own_rows_only(opts)
        return own_candidates_infonce(
            anchors, candidates, replace(opts, check_finite=False), w / sum(sizes) * b
        )
    cands_all, core = _gathered(gather_with_grad, anchors, candidates, sizes, opts)
    return infonce(anchors, cands_all, core) * (w / sum(sizes) * b)


# --------------------------------------------------------------------------- the ring


@fp32_loss_stage
def ring_loss_and_grad(
    anchors: Tensor,
    candidates: Sequence[Tensor],
    sizes: list[int],
    options: InfoNCEOptions | None = None,
    *,
    with_grad: bool = True,
    **keywords: Any,
) -> InfoNCEOutput:
    """[`gathered_loss_and_grad`][st_cached_losses.functional.softmax.parallel.gathered_loss_and_grad] by ring exchange (same arguments; ``path`` must be "auto" or
    "tiled": the ring is tiled by construction): each process keeps its rows, and every process's column
    blocks visit it ([`ring_terms_solve`][st_cached_losses.functional.softmax.ring.ring_terms_solve]). A score whose rows carry data computed from every
    column (XTR: each query token's top-``k`` over every process's document tokens) gets it from a first
    pass of the column blocks around the ring (`_ring_row_data`), after XTR's columns numbered
    their documents over every process's rows.

    No finiteness check inside: a process raising on its own NaN in the middle of the ring would leave
    its peers blocked in a send / receive; [`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes] checks every process first."""
    opts = InfoNCEOptions.of(options, keywords)
    if opts.path not in ("auto", "tiled"):
        raise ValueError(
            f"the ring exchange is tiled by construction: path must be 'auto' or 'tiled', got {opts.path!r}."
        )
    _own_rows_only(opts)
    score, given = Score(opts.similarity), list(candidates)
    spec = opts.spec(anchors, given, score)
    bank, shares = opts.bank, None
    if bank is not None:  # the terms of every process's bank, whatever this process's share holds
        shares = bank_sizes(bank)
        base = replace(opts, bank=None).spec(anchors, given, score).terms
        spec = replace(spec, terms=bank_terms(base, sum(shares[0]) > 0, sum(shares[1]) > 0))
    row_state = getattr(score.fn, "row_state", None)
    cols, rows = given, anchors
    with torch.no_grad():
        if score.packed:
            # every block travels with one row shape: the columns (and the anchors when a term reads them)
            anchors_travel = any(t.cols == "q_all" for t in spec.terms.terms)
            width = max(_widest([*cols, anchors] if anchors_travel else cols))
            cols = [pad_tokens(c, width) for c in cols]
            rows = pad_tokens(anchors, width) if anchors_travel else anchors
        if row_state is not None:
            # the columns number their documents over every process's rows before they travel
            cols = score.fn.with_column_data(cols, sum(sizes[: rank()]), sum(sizes))  # type: ignore[union-attr]
            rows = _ring_row_data(score, rows, cols, sizes, opts.memory_budget)
        loss, g_a, g_c, g_all, g_s = ring_terms_solve(
            spec, rows, cols, sizes, scale=opts.scale, with_grad=with_grad, bank_shares=shares,
            list_sizes=column_sizes(given, sizes, True)[1:] if opts.listed_negatives else None,
        )  # fmt: skip
    if g_a is not None:
        if row_state is not None:  # rows carrying data of their own (XTR's retrieved tokens)
            g_a = score.fn.without_row_data(g_a).to(anchors.dtype)  # type: ignore[union-attr]
        g_a, *g_c = _trimmed([g_a, *g_c], [anchors, *given])
        g_c = [g.to(c.dtype) for g, c in zip(g_c, given)]
    return InfoNCEOutput(loss, g_a, g_c, g_all, g_s)


def _ring_row_data(
    score: Score, rows: Tensor, cols: list[Tensor], sizes: list[int], memory_budget: int
) -> Tensor:
    """The rows with the data a score computes from every process's columns, by a first ring pass: each
    visiting block of columns updates the rows' running state ([`row_state`][st_cached_losses.functional.representations.multi_vector.XTR.row_state])."""
    fn: Any = score.fn
    state: Any = None

    def visit(owner: int, blocks: list[Tensor], carried: list[Tensor]) -> None:
        nonlocal state
        block = blocks[0]  # (n, K, *row_shape)
        state = fn.row_state(rows, [block[:, j] for j in range(block.shape[1])], memory_budget, state)

    ring_exchange([torch.stack(cols, dim=1).contiguous()], [], sizes, visit)
    assert state is not None  # every process's block visited
    return fn.with_row_state(rows, state)
