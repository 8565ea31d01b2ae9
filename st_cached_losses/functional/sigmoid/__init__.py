"""The sigmoid family: SigLIP's pairwise sigmoid loss, its options, its blocks, its drivers and its autograd
Function. Imports the shared floor and the kernels, never the InfoNCE family
([`softmax`][st_cached_losses.functional.softmax]).

Re-exports what ``st_cached_losses.functional.sigmoid`` (a module before the rooms) exported; they are defined in
[`loss`][st_cached_losses.functional.sigmoid.loss] and [`options`][st_cached_losses.functional.sigmoid.options]."""

from st_cached_losses.functional.sigmoid.loss import (
    SigmoidOptions,
    SigmoidOutput,
    sigmoid_loss,
    sigmoid_loss_and_grad,
)

__all__ = ["SigmoidOptions", "SigmoidOutput", "sigmoid_loss", "sigmoid_loss_and_grad"]
