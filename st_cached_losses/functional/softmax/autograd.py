"""InfoNCE's autograd Function ([`infonce`][st_cached_losses.functional.softmax.loss.infonce]): statistics in forward,
tiles recomputed in backward. (A loss whose gradients come out of the pass that computes it, the sigmoid loss, has
its own: [`OnePassFunction`][st_cached_losses.functional.sigmoid.autograd.OnePassFunction].)"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.checks import scale_value
from st_cached_losses.functional.precision import fp32_loss_stage
from st_cached_losses.functional.softmax.binding import row_lse
from st_cached_losses.functional.softmax.local import LocalCall
from st_cached_losses.functional.softmax.options import LossSpec

__all__ = ["InfoNCEFunction"]


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
