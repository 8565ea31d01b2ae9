"""The pairwise sigmoid loss of SigLIP (Zhai et al., 2023), exact at any batch, on one process or many.

For anchors ``x_i`` (``B`` rows) and candidates ``y_j`` (the positives, then every hard-negative column,
then a negative bank's rows: ``C`` entries in all):

```text
L = -(1 / B) * sum_i sum_j log sigmoid(z_ij * (scale * sim(x_i, y_j) + bias))
```

``z_ij = +1`` for row ``i``'s own positive and -1 otherwise; ``sim`` is the cosine (embeddings normalised
once) or the dot product. One sum over every pair: the loss is symmetric by construction (no directions).
Every pair's term is independent, so one pass over blocks of pairs gives the loss and every gradient (the
embeddings', the scale's, the bias's) at once ([`sigmoid.blocks`][st_cached_losses.functional.sigmoid.blocks]):
memory ``O((B + C) d)`` plus two blocks, never the ``B x C`` matrix.

Two entry points, one set of options ([`SigmoidOptions`][st_cached_losses.functional.sigmoid.options.SigmoidOptions]):

* [`sigmoid_loss_and_grad`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss_and_grad] -- the loss and its gradients without a graph (GradCache's loss stage,
  where the loss is the last node of its own graph);
* [`sigmoid_loss`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss] -- the loss as an autograd-capable tensor (any training loop: its forward computes
  the gradients too and keeps them, its backward only scales them).

Both run on one process (``sizes=None``) or across processes (``sizes``: every process's row count in rank
order, from [`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]), gathered or by ring exchange (``ring=True``), each process
returning its share of the global loss ([`sigmoid.drivers`][st_cached_losses.functional.sigmoid.drivers] says why that share makes DDP's
gradient average the full-batch gradient). Similarities are computed in fp32 whatever the input dtype
(fp64 for fp64 inputs; autocast is off inside), their products at ``matmul_precision`` (bf16 operands for
``"medium"``, TF32 on CUDA for ``"high"``, fp32 for ``"highest"`` whatever torch's global setting); the terms,
sums and gradients stay fp32, and gradients come back in each input's dtype."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.checks import candidate_columns, nonfinite_error, validate_inputs
from st_cached_losses.functional.distributed import rank, world_size
from st_cached_losses.functional.placement import placement
from st_cached_losses.functional.precision import accumulation_dtype, fp32_loss_stage
from st_cached_losses.functional.sigmoid.autograd import OnePassFunction
from st_cached_losses.functional.sigmoid.blocks import Wanted
from st_cached_losses.functional.sigmoid.drivers import gathered_pairs, local_pairs, ring_pairs
from st_cached_losses.functional.sigmoid.options import SigmoidOptions, SigmoidOutput

__all__ = ["SigmoidOptions", "SigmoidOutput", "sigmoid_loss", "sigmoid_loss_and_grad"]


@fp32_loss_stage
def sigmoid_loss_and_grad(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    options: SigmoidOptions | None = None,
    *,
    sizes: list[int] | None = None,
    ring: bool = False,
    grad_output: float = 1.0,
    with_grad: bool = True,
    **keywords: Any,
) -> SigmoidOutput:
    """The sigmoid loss and its gradients wrt every embedding (and a tensor scale and bias), without a graph.

    Args:
        anchors: ``(B, d)`` anchor embeddings (this process's rows).
        candidates: ``(N, d)`` or a sequence of ``(N, d)``: the positives first, then hard negatives. Row
            ``i``'s positive is ``candidates[0][row_offset + i]``; every other entry of every column is
            one of its negatives. Across processes: this process's ``(B, d)`` columns.
        options: the loss's options, [`SigmoidOptions`][st_cached_losses.functional.sigmoid.options.SigmoidOptions]; ``keywords``, its fields, replace those of
            ``options`` (``scale=10.0, bias=-10.0, path="tiled"``).
        sizes: every process's ``B`` in rank order ([`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]) to score this process's rows
            against every process's candidates; None (default): this process alone.
        ring: across processes, pass the candidate blocks around a ring instead of gathering them
            (memory flat in the number of processes).
        grad_output: multiplies every gradient (the incoming gradient of the loss).
        with_grad: also the gradients; else the loss only.

    Returns:
        [`SigmoidOutput`][st_cached_losses.functional.sigmoid.options.SigmoidOutput]: the loss (across processes, this process's share: ``W / B_global`` times
        its rows' sum, so that the processes' mean is the global loss) and the gradients of
        ``grad_output * loss``; across processes the scale's and the bias's are averaged over processes."""
    opts = SigmoidOptions.of(options, keywords)
    want = Wanted(with_grad, with_grad and opts.scale_needs_grad, with_grad and opts.bias_needs_grad)
    return _solve(anchors, candidate_columns(candidates), opts, sizes, ring, grad_output, want)


@fp32_loss_stage
def sigmoid_loss(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    options: SigmoidOptions | None = None,
    *,
    sizes: list[int] | None = None,
    ring: bool = False,
    **keywords: Any,
) -> Tensor:
    """The sigmoid loss as an autograd-capable 0-d tensor: fp32 for fp32, bf16 and fp16 embeddings, fp64 for
    fp64 ones. Same arguments as [`sigmoid_loss_and_grad`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss_and_grad], without ``grad_output`` and ``with_grad``.

    Gradients flow to the anchors, every candidate column and a tensor ``scale`` and ``bias`` (SigLIP's
    learnable ``scale = log_scale.exp()`` included), each in its own dtype. Forward computes them with the
    loss when an input requires grad (one pass; across processes, every collective happens in forward) and
    keeps them, ``O((B + C) d)``; backward multiplies them by the incoming gradient."""
    opts = SigmoidOptions.of(options, keywords)
    cols = candidate_columns(candidates)
    dev = anchors.device
    scale = opts.scale if isinstance(opts.scale, Tensor) else torch.tensor(float(opts.scale), device=dev)
    bias = opts.bias if isinstance(opts.bias, Tensor) else torch.tensor(float(opts.bias), device=dev)
    n_cols = len(cols)

    def solve(needs: tuple[bool, ...]) -> tuple[Tensor, list[Tensor | None]]:
        want = Wanted(any(needs[2:]), needs[0], needs[1])
        out = _solve(anchors, cols, opts, sizes, ring, 1.0, want)
        g_cols: list[Tensor | None] = list(out.grad_candidates) if want.embeddings else [None] * n_cols
        grads = [out.grad_scale, out.grad_bias, out.grad_anchors, *g_cols]
        return out.loss, [g if need else None for g, need in zip(grads, needs)]  # kept: the needed ones

    return OnePassFunction.apply(solve, scale, bias, anchors, *cols)


def _solve(
    anchors: Tensor, cols: list[Tensor], opts: SigmoidOptions, sizes: list[int] | None, ring: bool,
    grad_output: float, want: Wanted,
) -> SigmoidOutput:  # fmt: skip
    """Both entry points' checks and the driver for where the rows are; the results in the callers' dtypes."""
    _check(anchors, cols, opts, sizes)
    anchors, cols = anchors.detach(), [c.detach() for c in cols]
    # one process: the mean over its rows; across processes its share, W / B_global times its rows' sum
    row_weight = 1.0 / anchors.shape[0] if sizes is None else len(sizes) / sum(sizes)
    driver = {"local": local_pairs, "gathered": gathered_pairs, "ring": ring_pairs}[
        placement(sizes, ring=ring)
    ]
    # torch's fp32 GEMMs held at the products' precision for the call ("highest": fp32 whatever torch's
    # global setting), every sum fp32 whatever it is
    with torch.no_grad(), opts.products(anchors).pinned(anchors.device):
        sums = driver(anchors, cols, sizes, opts, factor=grad_output * row_weight, want=want)
    loss = (sums.loss_sum * row_weight).to(accumulation_dtype(anchors))
    g_a = sums.grad_rows.to(anchors.dtype) if sums.grad_rows is not None else None
    g_c = [g.to(c.dtype) for g, c in zip(sums.grad_cols, cols)]
    return SigmoidOutput(loss, g_a, g_c, _like(sums.grad_scale, opts.scale), _like(sums.grad_bias, opts.bias))


def _like(grad: Tensor | None, value: float | Tensor) -> Tensor | None:
    """A scale's or bias's gradient in its dtype (there is one only when it is a tensor)."""
    return grad.to(value.dtype) if grad is not None and isinstance(value, Tensor) else None


def _check(anchors: Tensor, cols: list[Tensor], opts: SigmoidOptions, sizes: list[int] | None) -> None:
    """The inputs, the bank and, across processes, where the rows are. Across processes finiteness is not
    checked here: a process raising alone would leave the others waiting in a collective
    ([`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes] checks every process first)."""
    local = sizes is None
    validate_inputs(
        anchors,
        cols,
        None,
        symmetric=False,
        row_offset=opts.row_offset,
        check_finite=opts.check_finite and local,
        listed=opts.listed_negatives,
    )
    bank = opts.bank
    if bank is not None:
        if not isinstance(bank, Tensor) or bank.dim() != 2 or bank.shape[1] != anchors.shape[1]:
            shape = tuple(bank.shape) if isinstance(bank, Tensor) else type(bank).__name__
            raise ValueError(
                f"bank must be (rows, {anchors.shape[1]}) embeddings like the anchors, got {shape}."
            )
        if not bank.is_floating_point() or bank.device != anchors.device:
            raise ValueError(
                f"bank must be a floating-point tensor on the anchors' device ({anchors.device}), got "
                f"{bank.dtype} on {bank.device}."
            )
        if local and opts.check_finite and not bool(torch.isfinite(bank).all()):
            raise nonfinite_error("the bank")
    if sizes is None:
        return
    if opts.row_offset != 0:
        raise ValueError(
            "across processes the strategies place every process's rows themselves: leave row_offset at 0."
        )
    b = anchors.shape[0]
    if len(sizes) != world_size() or sizes[rank()] != b or cols[0].shape[0] != b:  # lists: column 0
        raise ValueError(
            f"sizes={sizes} must be every process's row count in rank order (this is rank {rank()} of "
            f"{world_size()}, with {b} anchors and {cols[0].shape[0]} candidate rows): get them from "
            "st_cached_losses.functional.placement.agree_on_sizes."
        )
