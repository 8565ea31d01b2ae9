"""The autograd Function of a loss whose gradients are computed in the pass that computes it
([`sigmoid_loss`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss]): forward computes the loss and the gradients
together, backward scales them. (InfoNCE's, which recomputes its tiles in backward, is
[`InfoNCEFunction`][st_cached_losses.functional.softmax.autograd.InfoNCEFunction].)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["OnePassFunction", "OnePassSolve"]

#: ``solve(needs) -> (loss, grads)``: the loss and, for each input whose ``needs`` entry is True, the gradient
#: of the loss wrt it (None for the others), computed together
OnePassSolve = Callable[[tuple[bool, ...]], tuple[Tensor, list[Tensor | None]]]


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
