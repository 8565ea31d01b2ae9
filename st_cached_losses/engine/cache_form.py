"""The form in which the engine keeps a step's cached embeddings and their gradients: a hook a loss
implements (the sparse loss keeps only the non-zero entries of vocabulary-sized rows).

Without a form the engine keeps each mini-batch's output as it comes (``out.detach().float()``), puts the
column's rows back in order, and hands a replayed mini-batch the rows of the loss's gradient as they are."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

__all__ = ["CacheForm"]


class CacheForm(Protocol):
    """How the cached embeddings are kept (between stage 1 and stage 2) and how the loss's gradient, of
    the same form, becomes the gradient of a replayed mini-batch's output (stage 3). Every form must be
    exact: what the loss stage reads is the embeddings, and the replay back-propagates the same gradient
    as the dense one (or one the encoder's Jacobian cannot tell apart)."""

    def pack(self, out: Tensor) -> Tensor:
        """One mini-batch's output ``(m, ...)`` (detached, fp32) as it is kept; rows on dim 0."""
        ...

    def finish(self, columns: list[list[Tensor]]) -> list[list[Tensor]]:
        """Every column's kept mini-batch parts, after stage 1, in the form the loss stage will read
        (e.g. all kept compact, or all made dense again); the engine then puts each column's rows in
        order (3-D parts of different widths padded with zeros on the right)."""
        ...

    def expand(self, grad: Tensor, out: Tensor) -> Tensor:
        """The loss's gradient rows ``grad`` of one mini-batch (the form of its column) as the gradient of
        the replayed output ``out``: ``out``'s shape."""
        ...
