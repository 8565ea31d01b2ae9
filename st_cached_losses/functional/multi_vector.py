"""Late-interaction (multi-vector) scores as a plug-in of the one InfoNCE core: MaxSim and MeanMaxSim.

A multi-vector row is a padded ``(t, d)`` matrix of token embeddings with a ``(t,)`` mask. The core
reads it *packed*: one ``(n, t, d + 1)`` tensor whose last channel is the mask (1 for a scored token,
0 for padding or a token the model masked out), so that a row's tokens and its mask travel together
through every tile slice, gather and gradient buffer of the core without any of them knowing. The
gradient wrt a packed tensor is 0 in the mask channel.

:class:`MaxSim` is a similarity function in the sense of :mod:`.score` (``f(a, c) -> (len(a), len(c))``),
so the core scores it tile by tile, rows x columns, and takes each tile's gradient by autograd on that
tile alone: the largest intermediate is one tile's ``(b, t, q_tokens, d_tokens)`` token similarities,
never the ``(Q, Q*N, q_tokens, d_tokens)`` tensor. The arithmetic is sentence-transformers'
``maxsim`` (``sentence_transformers.util.similarity``) per (query, document) pair: padded document
tokens are excluded from the max (filled with the dtype's minimum), padded query tokens from the sum
(multiplied by 0), a document without any token scores :data:`EMPTY_DOCUMENT_SCORE`, and MeanMaxSim
divides by the query's token count (at least 1). The gradient through the max is exact, ties resolved
as ``torch.max`` resolves them.

Shapes: ``b`` rows of a tile, ``t`` columns of a tile, ``tq`` / ``td`` query / document tokens, ``d``
the token embedding dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["EMPTY_DOCUMENT_SCORE", "MaxSim", "pack_tokens", "pad_tokens", "unpack_tokens"]

#: The score of a document without any scored token, as sentence-transformers gives it.
EMPTY_DOCUMENT_SCORE = -1e9


def pack_tokens(embeddings: Tensor, mask: Tensor) -> Tensor:
    """``(n, t, d)`` token embeddings and their ``(n, t)`` mask as one ``(n, t, d + 1)`` tensor, the
    mask in the last channel (in the embeddings' dtype; the result carries the embeddings' graph)."""
    if embeddings.dim() != 3 or mask.shape != embeddings.shape[:2]:
        raise ValueError(
            f"token embeddings must be (rows, tokens, dim) with a (rows, tokens) mask, got "
            f"{tuple(embeddings.shape)} and {tuple(mask.shape)}."
        )
    return torch.cat([embeddings, mask.ne(0).to(embeddings.dtype).unsqueeze(-1)], dim=-1)


def unpack_tokens(packed: Tensor) -> tuple[Tensor, Tensor]:
    """``(n, t, d)`` embeddings (a view) and the ``(n, t)`` boolean mask of a packed tensor."""
    return packed[..., :-1], packed[..., -1].detach().ne(0)


def pad_tokens(packed: Tensor, tokens: int) -> Tensor:
    """``packed`` with its token axis padded on the right to ``tokens`` (padding: zeros, mask 0)."""
    extra = tokens - packed.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad {packed.shape[1]} tokens down to {tokens}.")
    if extra == 0:
        return packed
    return torch.cat([packed, packed.new_zeros(packed.shape[0], extra, packed.shape[2])], dim=1)


class MaxSim:
    """``sum_i max_j <q_i, d_j>`` over a query's scored tokens ``i`` and a document's scored tokens ``j``
    (ColBERT), divided by the query's token count when ``length_normalize`` (MeanMaxSim): the score of
    sentence-transformers' ``colbert_scores`` / ``mean_colbert_scores`` for every (query, document) pair,
    on packed operands (:func:`pack_tokens`)."""

    #: operands are packed ``(n, t, d + 1)`` token tensors (read by :class:`~.score.Score`)
    token_score = True

    def __init__(self, length_normalize: bool = False) -> None:
        self.length_normalize = bool(length_normalize)

    def __repr__(self) -> str:
        return f"MaxSim(length_normalize={self.length_normalize})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MaxSim) and other.length_normalize == self.length_normalize

    def __hash__(self) -> int:
        return hash((MaxSim, self.length_normalize))

    def __call__(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b, t)`` scores of packed ``queries (b, tq, d + 1)`` against packed ``documents (t, td, d + 1)``."""
        q, q_mask = unpack_tokens(queries)
        c, c_mask = unpack_tokens(documents)
        sim = torch.einsum("ash,bth->abst", q, c)  # (b, t, tq, td)
        return self._reduce(sim, q_mask[:, None, :], c_mask[None, :, None, :])

    def pairwise(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b,)`` scores of query ``i`` against document ``i`` (both ``b`` packed rows): a tile's
        diagonal without the rest of the tile."""
        q, q_mask = unpack_tokens(queries)
        c, c_mask = unpack_tokens(documents)
        sim = torch.einsum("ash,ath->ast", q, c)  # (b, tq, td)
        return self._reduce(sim, q_mask, c_mask[:, None, :])

    def _reduce(self, sim: Tensor, q_mask: Tensor, c_mask: Tensor) -> Tensor:
        """Token similarities ``(..., tq, td)`` to scores ``(...)``; the masks broadcast against
        ``(..., tq)`` (queries) and ``(..., tq, td)`` (documents)."""
        # padded document tokens never win the max (0 would beat a real negative similarity); in place
        # (einsum keeps its inputs, not its output, for backward): one tile-sized tensor, not two
        sim.masked_fill_(~c_mask, torch.finfo(sim.dtype).min)
        best = sim.amax(-1) if not torch.is_grad_enabled() else sim.max(-1).values  # (..., tq)
        acc = torch.float64 if best.dtype == torch.float64 else torch.float32  # sums in fp32 (fp64 kept)
        scores = (best.to(acc) * q_mask).sum(-1)  # padded query tokens add 0
        scores = scores.masked_fill(~c_mask.any(-1).any(-1), EMPTY_DOCUMENT_SCORE)
        if self.length_normalize:
            scores = scores / q_mask.sum(-1).clamp(min=1).to(scores.dtype)
        return scores
