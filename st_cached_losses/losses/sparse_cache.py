"""The sparse loss's cache form ([`CacheForm`][st_cached_losses.engine.cache_form.CacheForm]): SPLADE embeddings
kept as their non-zero entries (packed rows, [`st_cached_losses.functional.representations.sparse`][st_cached_losses.functional.representations.sparse]), and the gradients
wrt them on the same entries.

Exactness. Only zeros are dropped from the embeddings, so the loss stage reads the same numbers. The
gradient is kept on each row's non-zero entries only; that is the whole gradient of the encoder's
parameters when the encoder's Jacobian is zero at every exactly-zero output entry. sentence-transformers'
``SpladePooling`` (6.2) computes ``pool_t act(x_t * mask_t)`` with ``act`` = ``log1p(relu(.))`` or
``log1p(log1p(relu(.)))`` and ``pool`` = max or sum over tokens: an output entry is exactly 0 only when
``relu`` gave 0 for every token (the terms are >= 0; a sum of non-negative floats is 0 only if each is),
and ``relu``'s backward passes nothing where its output is 0 (``threshold_backward``: a select, not a
product), through either pooling (``max`` / ``maximum`` route the gradient to tied zeros, which are
``relu`` zeros too). So the replay back-propagates the same parameter gradients, bit for bit, as with
the dense gradient. Any other model (a ``Router`` for inference-free queries, a ``SparseAutoEncoder``, a
custom module) keeps the dense form.

When. The form is used when every mini-batch's packed rows take at most ``2 * max_density`` of the dense
bytes (an index and a value per kept entry, padded to the widest row); otherwise the step is kept dense as
before. A packed mini-batch is never made dense again unless another one of the step was too dense.
Across processes (the loss stage gathers the rows, or passes them around a ring), every process must read
the same form: the step's decision is then one all-reduce (the minimum of each process's "every mini-batch
packed" flag, [`agree_packed`][st_cached_losses.functional.representations.sparse.agree_packed]), so that one process's dense
mini-batch keeps every process's step dense. Processes' packed rows may differ in width (their densest row):
the loss stage pads them to a common one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from st_cached_losses.engine.cache_form import CacheForm, pad_packed
from st_cached_losses.engine.features import unwrap_model
from st_cached_losses.functional.representations.sparse import (
    MAX_PACKED_DIM,
    agree_packed,
    dense_rows,
    pack_rows,
)

__all__ = ["MAX_DENSITY", "CompactSparseRows", "zero_gradient_at_zero"]

#: Largest fraction of non-zero entries (of a mini-batch's densest row) kept packed: the packed rows then
#: take at most half the dense bytes. Trained SPLADE rows: ~100-300 of 30,522 (under 1%).
MAX_DENSITY = 0.25

#: SpladePooling's activations and poolings whose output is 0 only where every token's relu is 0
_ZERO_SAFE = {"activation_function": ("relu", "log1p_relu"), "pooling_strategy": ("max", "sum")}


def zero_gradient_at_zero(model: nn.Module) -> bool:
    """Whether the model's output ends with sentence-transformers' ``SpladePooling`` with one of the
    activations and poolings checked in this module's notes: then an exactly-zero entry has no gradient."""
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    children = list(unwrap_model(model).children())
    last = children[-1] if children else None
    return (
        type(last) is SpladePooling
        and type(last).forward is SpladePooling.forward
        and all(getattr(last, name, None) in ok for name, ok in _ZERO_SAFE.items())
    )


class CompactSparseRows(CacheForm):
    """Keeps vocabulary-sized rows packed (their non-zero entries) while ``active()`` and while every
    mini-batch of the step is sparse enough (``max_density``) on every process that reads the rows together
    (``across()``: the loss stage is across processes); ``compact`` tells what the last step kept."""

    def __init__(
        self,
        active: Callable[[], bool],
        max_density: float = MAX_DENSITY,
        across: Callable[[], bool] = lambda: False,
    ) -> None:
        self.active = active
        self.across = across
        self.max_density = max_density
        self.dim: int | None = None  # V, once a mini-batch was packed
        self.compact = False

    def pack(self, out: Tensor) -> Tensor:
        if out.dim() != 2 or out.shape[1] > MAX_PACKED_DIM or not self.active():
            return out
        packed = pack_rows(out)
        if packed.shape[1] > self.max_density * out.shape[1]:
            return out  # too dense to gain: this step stays dense (see finish)
        self.dim = out.shape[1]
        return packed

    def finish(self, columns: list[list[Tensor]]) -> list[list[Tensor]]:
        parts = [p for column in columns for p in column]
        packed = [p.dim() == 3 for p in parts]
        self.compact = bool(parts) and all(packed)
        if self.active() and self.across():  # the same on every process: each joins the all-reduce
            device = parts[0].device if parts else torch.device("cpu")
            self.compact = agree_packed(self.compact, device)
        if self.compact:
            return pad_packed(columns)  # each column's packed parts at its widest row's width
        if not any(packed):
            return columns
        # some mini-batch was too dense: every column dense, as the loss stage reads one form
        assert self.dim is not None
        return [[dense_rows(p, self.dim) if p.dim() == 3 else p for p in column] for column in columns]

    def expand(self, grad: Tensor, out: Tensor) -> Tensor:
        """A packed gradient (the embeddings' indices, the gradient's values) as ``out``'s dense rows: 0
        off each row's non-zero entries, where ``out`` has no gradient (see the module's notes)."""
        if grad.dim() == 3 and out.dim() == 2:
            return dense_rows(grad, out.shape[1])
        return grad
