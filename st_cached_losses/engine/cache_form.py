"""The form in which the engine keeps a step's cached rows and their gradients: what a mini-batch's forward
yields, how its output is kept between stage 1 and stage 2, and how the loss's gradient of that form becomes
the gradient of a replayed mini-batch's output in stage 3.

[`CacheForm`][st_cached_losses.engine.cache_form.CacheForm] keeps each mini-batch's output as it comes (a
``SentenceTransformer``'s ``(m, d)`` rows, a ``CrossEncoder``'s ``(m, 1)`` scores);
[`TokenRows`][st_cached_losses.engine.cache_form.TokenRows] keeps a multi-vector model's token embeddings and
scoring masks packed (``(m, t, d + 1)``, each mini-batch as wide as its own longest row); the sparse loss keeps
only the non-zero entries of vocabulary-sized rows (``st_cached_losses.losses.sparse_cache``). Every form is
exact: the loss stage reads the same numbers, and the replay back-propagates the same gradient as the dense
one (or one the encoder's Jacobian cannot tell apart)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.functional.representations.multi_vector import pack_tokens, pad_tokens, unpack_tokens

__all__ = ["CacheForm", "TokenRows", "pad_packed"]


def pad_packed(columns: list[list[Tensor]]) -> list[list[Tensor]]:
    """Each column's packed parts (``(m, t, c)``, as wide as each mini-batch's own longest row) padded with
    zeros on the right to the column's widest, so that the column's rows can be put back in order."""
    out = []
    for parts in columns:
        width = max((p.shape[1] for p in parts), default=0)
        out.append([pad_tokens(p, width) if p.dim() == 3 else p for p in parts])
    return out


class CacheForm:
    """Rows kept as the model outputs them: the mini-batch's forward yields ``model(features)[output]``
    (the engine's ``output`` key), kept as is, and the loss's gradient rows are the output's gradient."""

    def encode(self, model: nn.Module, features: dict[str, Any], output: str) -> Tensor:
        """One mini-batch's forward: what the cache keeps of it, ``(m, ...)`` with rows on dim 0."""
        return model(features)[output]

    def pack(self, out: Tensor) -> Tensor:
        """One mini-batch's output ``(m, ...)`` (detached, fp32) as it is kept."""
        return out

    def finish(self, columns: list[list[Tensor]]) -> list[list[Tensor]]:
        """Every column's kept mini-batch parts, after stage 1, in the form the loss stage reads (e.g. all
        compact, or all dense again, and of one width per column); the engine then puts each column's rows
        in order."""
        return columns

    def expand(self, grad: Tensor, out: Tensor) -> Tensor:
        """The loss's gradient rows ``grad`` of one mini-batch (the form of its column) as the gradient of
        the replayed output ``out`` (``out``'s shape)."""
        return grad

    def expose(self, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        """A column's kept rows as the loss's ``calculate_loss`` takes them, which a wrapper decorating it sees
        (MatryoshkaLoss truncates and normalises their last axis), and what is kept aside to restore them
        (None: the rows as they are)."""
        return rows, None

    def restore(self, exposed: Tensor, aside: Tensor | None) -> Tensor:
        """The rows the loss stage reads, from ``exposed`` (perhaps a wrapper's truncation) and ``aside``."""
        return exposed

    def exposed_grad(self, grad: Tensor, aside: Tensor | None) -> Tensor:
        """The gradient wrt the restored rows as the gradient wrt the exposed ones."""
        return grad

    def rows_grad(self, grad: Tensor, aside: Tensor | None) -> Tensor:
        """The gradient wrt the exposed rows as the gradient wrt the kept rows (``expose`` undone)."""
        return grad


class TokenRows(CacheForm):
    """A multi-vector model's rows: the model is called with the column's ``task`` and its token embeddings
    and scoring mask are packed as ``(m, t, d + 1)``
    ([`pack_tokens`][st_cached_losses.functional.representations.multi_vector.pack_tokens]), each mini-batch trimmed to its
    own longest row; a column's parts are padded on the right to the column's widest (the padding is masked
    out), and a mini-batch's gradient is cut back to its own width (the padding never has one)."""

    def encode(self, model: nn.Module, features: dict[str, Any], output: str) -> Tensor:
        # a multi-vector model routes by task (query / document: prefix, length, mask); its output
        # attention_mask is the scoring mask
        out = model(dict(features), task=features.get("task"))
        return pack_tokens(out["token_embeddings"], out["attention_mask"])

    def finish(self, columns: list[list[Tensor]]) -> list[list[Tensor]]:
        return pad_packed(columns)

    def expand(self, grad: Tensor, out: Tensor) -> Tensor:
        return grad[:, : out.shape[1]]

    def expose(self, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        # the token embeddings (n, t, d) alone, as sentence-transformers' cached multi-vector loss hands them to
        # a wrapper (MultiVectorMatryoshkaLoss truncates d); the (n, t) mask kept aside
        return unpack_tokens(rows)

    def restore(self, exposed: Tensor, aside: Tensor | None) -> Tensor:
        return exposed if aside is None else pack_tokens(exposed, aside)

    def exposed_grad(self, grad: Tensor, aside: Tensor | None) -> Tensor:
        return grad if aside is None else grad[..., :-1]

    def rows_grad(self, grad: Tensor, aside: Tensor | None) -> Tensor:
        return grad if aside is None else torch.cat([grad, grad.new_zeros(*grad.shape[:-1], 1)], dim=-1)
