"""The loss stage's autograd Functions: InfoNCE's ([`infonce`][st_cached_losses.functional.softmax.loss.infonce]: statistics in forward, tiles
recomputed in backward) and that of a loss whose gradients come out of the pass that computes it
([`sigmoid_loss`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from st_cached_losses.functional.checks import scale_value
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.softmax.binding import row_lse
from st_cached_losses.functional.softmax.local import LocalCall
from st_cached_losses.functional.softmax.options import LossSpec

__all__ = ["InfoNCEFunction", "OnePassFunction", "OnePassSolve"]

#: ``solve(needs) -> (loss, grads)``: the loss and, for each input whose ``needs`` entry is True, the gradient
#: of the loss wrt it (None for the others), computed together
OnePassSolve = Callable[[tuple[bool, ...]], tuple[Tensor, list[Tensor | None]]]


class InfoNCEFunction(torch.autograd.Function):
    """The loss stage's autograd. Forward: the statistics pass; it saves the input embeddings (no copies)
    and each group's ``O(B)`` log-sum-exp statistics, and only when some input needs a gradient.
    Backward: rebuilds the operands from the saved inputs (``O((B + N) d)``, negligible next to the
    ``O(B N d)`` tiles) and recomputes each logit tile once, holding one block of logits at a time."""

    @staticmethod
    def forward(
        ctx: Any, spec: LossSpec, scale: Tensor, anchors: Tensor, anchors_all: Tensor | None, *cols: Tensor
    ) -> Tensor:
        s = scale_value(scale)
        call = LocalCall(
            spec, anchors, list(cols), anchors_all, s, with_grad=False, one_pass=False, need_scale_grad=False
        )
        with spec.score.products.pinned(anchors.device):
            rows_lse, _ = call.stats()
        if any(ctx.needs_input_grad):
            # nothing derived from the embeddings (a normalised copy in the chunked path) outlives forward
            ctx.spec, ctx.s, ctx.n_cols, ctx.scale_dtype = spec, s, len(cols), scale.dtype
            ctx.save_for_backward(anchors, anchors_all, *cols, call.m, call.ssum)
        # fp64 inputs keep fp64 (for gradcheck); everything else is computed and returned in fp32
        return call.loss(rows_lse)

    @staticmethod
    @fp32_loss_stage
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        anchors, anchors_all, *rest = ctx.saved_tensors
        cols, (m, ssum) = list(rest[: ctx.n_cols]), rest[ctx.n_cols :]
        scale_grad = ctx.needs_input_grad[1]
        call = LocalCall(
            ctx.spec, anchors, cols, anchors_all, ctx.s, with_grad=True, one_pass=False,
            need_scale_grad=scale_grad,
        )  # fmt: skip
        _, lse = row_lse(m, ssum)
        with ctx.spec.score.products.pinned(anchors.device):
            gs = call.grads(lse, scale_grad)
        g_a, g_c, g_all, g_s = call.finish(float(grad_loss), gs, ctx.scale_dtype if scale_grad else None)
        return (None, g_s, g_a, g_all, *g_c)


class OnePassFunction(torch.autograd.Function):
    """A loss whose gradients are computed in the pass that computes it: the sigmoid loss, whose pairs'
    terms are independent, so that a block's gradient needs no statistics of other blocks. Forward calls
    ``solve`` once, for the loss and the gradients of the inputs that need one, and saves those gradients
    (``O((B + C) d)``, what backward would allocate anyway; nothing of the blocks); backward multiplies them
    by the incoming gradient. No block is computed twice; not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, solve: OnePassSolve, *inputs: Tensor) -> Tensor:
        loss, grads = solve(tuple(ctx.needs_input_grad[1:]))
        ctx.present = [g is not None for g in grads]
        ctx.save_for_backward(*[g for g in grads if g is not None])
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        grads: list[Tensor | None] = [None]  # the solve
        for present in ctx.present:
            g = next(saved) if present else None
            # a new tensor, in the gradient's dtype (a 0-d scale's dtype may differ from the loss's)
            grads.append((g * grad_loss).to(g.dtype) if g is not None else None)
        return tuple(grads)
