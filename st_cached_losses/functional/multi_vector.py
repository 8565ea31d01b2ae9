"""Late-interaction (multi-vector) scores as a plug-in of the one InfoNCE core: MaxSim, MeanMaxSim and XTR.

A multi-vector row is a padded ``(t, d)`` matrix of token embeddings with a ``(t,)`` mask. The core
reads it *packed*: one ``(n, t, d + 1)`` tensor whose last channel is the mask (1 for a scored token,
0 for padding or a token the model masked out), so that a row's tokens and its mask travel together
through every tile slice, gather and gradient buffer of the core without any of them knowing. The
gradient wrt a packed tensor is 0 in the mask channel.

:class:`MaxSim` is a similarity function in the sense of :mod:`.score` (``f(a, c) -> (len(a), len(c))``),
so the core scores it tile by tile, rows x columns, and takes each tile's gradient in closed form
(:meth:`MaxSim.vjp`: each query token's weight goes to the document token that wins its max, a gather and
a scatter of token rows from the winners the scoring kept, instead of autograd's two more products of the
token similarities): the largest intermediate is one tile's ``(b, t, q_tokens, d_tokens)`` token
similarities, never the ``(Q, Q*N, q_tokens, d_tokens)`` tensor. The arithmetic is sentence-transformers'
``maxsim`` (``sentence_transformers.util.similarity``) per (query, document) pair: padded document
tokens are excluded from the max (filled with the dtype's minimum), padded query tokens from the sum
(multiplied by 0), a document without any token scores :data:`EMPTY_DOCUMENT_SCORE`, and MeanMaxSim
divides by the query's token count (at least 1). The gradient through the max is exact, ties resolved
as ``torch.max`` resolves them.

:class:`XTR` is sentence-transformers' ``xtr_scores`` (Lee et al. 2023): each query token keeps only its
``top_k`` best document tokens over *every* in-batch document token, a document's per-token maximum is
taken over its retrieved tokens (0 when none), and the sum is divided by the number of query tokens that
retrieved one of the document's tokens. The top-k depends on the whole batch, so the core first runs a
streaming pass (:func:`xtr_thresholds`) that keeps each query token's running top-``k + 1`` over the
document tokens of every column, tile by tile, and turns it into a per-query-token threshold; the
threshold travels with the query rows as one more channel (:meth:`XTR.with_row_data`), after which each
(query, document) score is again a function of the pair and is scored tile by tile like MaxSim. Across
processes by ring exchange, each visiting block of documents is merged into the running top-``k + 1``
(:meth:`XTR.row_state`) before the thresholds are taken (:meth:`XTR.with_row_state`).

Shapes: ``b`` rows of a tile, ``t`` columns of a tile, ``tq`` / ``td`` query / document tokens, ``d``
the token embedding dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "EMPTY_DOCUMENT_SCORE",
    "XTR",
    "MaxSim",
    "pack_tokens",
    "pad_tokens",
    "thresholds_from_top",
    "unpack_tokens",
    "xtr_thresholds",
    "xtr_top_values",
]

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

    @torch.no_grad()
    def scores_and_state(self, queries: Tensor, documents: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`__call__` without a graph, and what :meth:`vjp` needs of the tile: the index of the
        document token that wins each query token's max, ``(b, t, tq)`` (ties as ``torch.max`` resolves
        them, as autograd through :meth:`__call__` would route the gradient)."""
        q, q_mask = unpack_tokens(queries)
        c, c_mask = unpack_tokens(documents)
        best, winner = self._masked(torch.einsum("ash,bth->abst", q, c), c_mask[None, :, None, :]).max(-1)
        return self._finish(best, q_mask[:, None, :], c_mask[None, :, None, :]), winner  # (b, t), (b, t, tq)

    @torch.no_grad()
    def vjp(
        self,
        g: Tensor,
        queries: Tensor,
        documents: Tensor,
        rows: bool,
        cols: bool,
        state: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of ``sum(g * self(queries, documents))`` (``g``: ``(b, t)``) wrt the packed
        ``queries`` (if ``rows``) and ``documents`` (if ``cols``), 0 in the mask channel, in closed form:
        each query token's max passes its weight ``w = g * mask (/ token count)`` to the one document token
        that wins it (``state``: the winners from :meth:`scores_and_state`, else found again), so

            d/dq_as = sum_b w_abs c_b[win_abs],    d/dc_bj = sum_(a, s: win_abs = j) w_abs q_as

        a gather and a scatter of ``(b, t, tq, d)`` rows instead of autograd's two more products of the
        ``(b, t, tq, td)`` token similarities."""
        if state is None:
            state = self.scores_and_state(queries, documents)[1]
        q, q_mask = unpack_tokens(queries)
        c, c_mask = unpack_tokens(documents)
        b, tq, d = q.shape
        t, td = c.shape[:2]
        acc = _accumulation_dtype(q)
        w = g.to(acc) * c_mask.any(-1)[None, :]  # an empty document's score is a constant
        if self.length_normalize:
            w = w / q_mask.sum(-1).clamp(min=1).to(acc)[:, None]
        w = (w[:, :, None] * q_mask[:, None, :]).to(q.dtype)  # (b, t, tq)
        start = torch.arange(t, device=q.device) * td  # each document's first row in (t * td, d)
        grad_q = grad_c = None
        if rows:
            # per query token, its t winners side by side: (b, tq, t, d), then (1, t) @ (t, d) per token
            won = c.reshape(t * td, d).index_select(0, (start + state.transpose(1, 2)).reshape(-1))
            grad_q = (w.transpose(1, 2).unsqueeze(-2) @ won.view(b, tq, t, d)).squeeze(-2)  # (b, tq, d)
            del won
            grad_q = torch.cat([grad_q, grad_q.new_zeros(b, tq, 1)], dim=-1)
        if cols:
            sent = (w[..., None] * q[:, None]).reshape(-1, d)  # (b * t * tq, d), rows in state's order
            grad_c = c.new_zeros(t * td, d).index_add_(0, (start[:, None] + state).reshape(-1), sent)
            del sent
            grad_c = torch.cat([grad_c.view(t, td, d), grad_c.new_zeros(t, td, 1)], dim=-1)
        return grad_q, grad_c

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
        sim = self._masked(sim, c_mask)
        best = sim.amax(-1) if not torch.is_grad_enabled() else sim.max(-1).values  # (..., tq)
        return self._finish(best, q_mask, c_mask)

    @staticmethod
    def _masked(sim: Tensor, c_mask: Tensor) -> Tensor:
        """Padded document tokens never win the max (0 would beat a real negative similarity); in place
        (einsum keeps its inputs, not its output, for backward): one tile-sized tensor, not two."""
        return sim.masked_fill_(~c_mask, torch.finfo(sim.dtype).min)

    def _finish(self, best: Tensor, q_mask: Tensor, c_mask: Tensor) -> Tensor:
        """Each query token's best similarity ``(..., tq)`` to scores ``(...)`` (masks as in :meth:`_reduce`)."""
        acc = _accumulation_dtype(best)  # sums in fp32 (fp64 kept)
        scores = (best.to(acc) * q_mask).sum(-1)  # padded query tokens add 0
        scores = scores.masked_fill(~c_mask.any(-1).any(-1), EMPTY_DOCUMENT_SCORE)
        if self.length_normalize:
            scores = scores / q_mask.sum(-1).clamp(min=1).to(scores.dtype)
        return scores


def _accumulation_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def xtr_thresholds(queries: Tensor, columns: list[Tensor], top_k: int, memory_budget: int) -> Tensor:
    """``(B, tq)`` per-query-token retrieval thresholds of packed ``queries (B, tq, d + 1)`` against every
    scored token of the packed document ``columns`` (each ``(n, td_k, d + 1)``), in fp32 (fp64 kept).

    A document token is retrieved by query token ``(i, s)`` when its similarity is at least the threshold:
    the midpoint of the ``top_k``-th and ``(top_k + 1)``-th largest similarities of that query token over
    every scored document token of every column, or ``-inf`` when there are at most ``top_k`` scored
    tokens (all of them are retrieved). The midpoint, not the ``top_k``-th value itself, so that the
    scoring pass, whose products may round differently in another tile shape, retrieves the same
    ``top_k`` tokens; only near-ties within rounding of each other can differ (and exact ties, where
    ``torch.topk`` itself picks an arbitrary subset).

    Streaming (:func:`xtr_top_values`): the running top-``k + 1`` over the columns' tokens, then
    :func:`thresholds_from_top`; across processes the same running values are merged block by block."""
    return thresholds_from_top(xtr_top_values(queries, columns, top_k, memory_budget), top_k)


def thresholds_from_top(best: Tensor, top_k: int) -> Tensor:
    """``(B, tq)`` thresholds from the running top-``k + 1`` values ``best (B, tq, k + 1)`` (descending,
    ``-inf`` where fewer tokens were seen): the midpoint of the ``top_k``-th and ``(top_k + 1)``-th, which is
    ``-inf`` when at most ``top_k`` scored tokens were seen (every one of them is retrieved)."""
    return best[..., top_k - 1] / 2 + best[..., top_k] / 2


def xtr_top_values(
    queries: Tensor, columns: list[Tensor], top_k: int, memory_budget: int, best: Tensor | None = None
) -> Tensor:
    """``(B, tq, k + 1)`` the ``top_k + 1`` largest similarities of each query token of packed ``queries
    (B, tq, d + 1)`` over the scored tokens of the packed document ``columns`` (each ``(n, td_k, d + 1)``)
    and, when given, the running values ``best`` (the same shape, from other columns: another process's
    documents); descending, ``-inf`` for slots no scored token filled. fp32 (fp64 kept), no graph.

    Query rows in chunks, document rows in chunks, each chunk's top-``k + 1`` merged with the running one;
    the largest intermediate is one ``(rows, tq, docs * td)`` tile and the ``(rows, tq, k + 1)`` running
    values, sized from ``memory_budget`` bytes."""
    acc = _accumulation_dtype(queries)
    q, _ = unpack_tokens(queries)
    b_all, tq = q.shape[:2]
    k1 = top_k + 1
    if best is None:
        best = torch.full((b_all, tq, k1), float("-inf"), dtype=acc, device=queries.device)
    td_max = max([c.shape[1] for c in columns], default=1)
    elems = max(1, memory_budget // (4 * 3))  # fp32 tile, its masked copy and the merged candidates
    rb = max(1, min(b_all, elems // (tq * (2 * k1 + td_max))))
    out = torch.empty_like(best)
    with torch.no_grad():
        for r0 in range(0, b_all, rb):
            qc = q[r0 : r0 + rb].to(acc)
            run = best[r0 : r0 + rb]  # (rb, tq, k + 1), the running top values
            for col in columns:
                c_all, m_all = unpack_tokens(col)
                n, td = c_all.shape[:2]
                cb = max(1, min(n, (elems // (qc.shape[0] * tq) - 2 * k1) // max(td, 1)))
                for c0 in range(0, n, cb):
                    c, m = c_all[c0 : c0 + cb].to(acc), m_all[c0 : c0 + cb]
                    sim = torch.einsum("ash,bth->asbt", qc, c)  # (rb, tq, cb, td)
                    sim.masked_fill_(~m[None, None], float("-inf"))
                    merged = torch.cat([run, sim.flatten(2)], dim=-1)
                    run = merged.topk(k1, dim=-1).values  # sorted, descending
            out[r0 : r0 + rb] = run
    return out


class XTR:
    """sentence-transformers' ``xtr_scores`` / ``XTRScores(top_k)`` for every (query, document) pair, on
    packed documents (:func:`pack_tokens`) and packed queries that carry their retrieval thresholds
    (:meth:`with_row_data`, which the core calls once per loss call with every document column).

    Per query token ``s`` and document ``j``: the retrieved tokens are the document's scored tokens whose
    similarity reaches the token's threshold (:func:`xtr_thresholds`); ``m_s`` is the largest retrieved
    similarity, or 0 when none is retrieved (``alpha_s`` = whether one is). The score is
    ``sum_s m_s / max(1, sum_s alpha_s)`` over the query's scored tokens; a document without any scored
    token scores :data:`EMPTY_DOCUMENT_SCORE`. The gradient is exact: through the max to the retrieved
    token that wins it (ties as ``torch.max`` resolves them), nothing through the retrieval itself or the
    count, as in sentence-transformers."""

    #: operands are packed token tensors (read by :class:`~.score.Score`)
    token_score = True

    def __init__(self, top_k: int = 256) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}.")
        self.top_k = top_k

    def __repr__(self) -> str:
        return f"XTR(top_k={self.top_k})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, XTR) and other.top_k == self.top_k

    def __hash__(self) -> int:
        return hash((XTR, self.top_k))

    def with_row_data(self, queries: Tensor, columns: list[Tensor], memory_budget: int) -> Tensor:
        """Packed ``queries (B, tq, d + 1)`` as ``(B, tq, d + 2)``: the embeddings, each query token's
        retrieval threshold against every token of ``columns`` (detached), then the mask; the result keeps
        ``queries``' graph (the threshold channel gets no gradient)."""
        return self.with_row_state(queries, self.row_state(queries, columns, memory_budget))

    def row_state(
        self, queries: Tensor, columns: list[Tensor], memory_budget: int, state: Tensor | None = None
    ) -> Tensor:
        """What the rows' data is made of, over ``columns`` and a previous ``state`` (other columns: the
        blocks of other processes visiting in a ring): each query token's running top-``k + 1``
        similarities (:func:`xtr_top_values`)."""
        return xtr_top_values(queries, columns, self.top_k, memory_budget, state)

    def with_row_state(self, queries: Tensor, state: Tensor) -> Tensor:
        """:meth:`with_row_data` from a finished :meth:`row_state` (every column of every process seen)."""
        thr = thresholds_from_top(state, self.top_k)  # fp32 (fp64 kept)
        # a half-precision threshold would round away from the midpoint: the rows travel in its dtype
        queries = queries.to(thr.dtype)
        return torch.cat([queries[..., :-1], thr.unsqueeze(-1), queries[..., -1:]], dim=-1)

    @staticmethod
    def without_row_data(x: Tensor) -> Tensor:
        """A ``(B, tq, d + 2)`` tensor laid out as :meth:`with_row_data`'s (rows or their gradient) back as
        ``(B, tq, d + 1)``: the threshold channel dropped."""
        return torch.cat([x[..., :-2], x[..., -1:]], dim=-1)

    def __call__(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b, t)`` scores of threshold-carrying ``queries (b, tq, d + 2)`` against packed
        ``documents (t, td, d + 1)``."""
        q, thr, q_mask = queries[..., :-2], queries[..., -2].detach(), queries[..., -1].detach().ne(0)
        c, c_mask = unpack_tokens(documents)
        sim = torch.einsum("ash,bth->abst", q, c)  # (b, t, tq, td)
        return self._reduce(sim, thr[:, None, :, None], q_mask[:, None, :], c_mask[None, :, None, :])

    def pairwise(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b,)`` scores of query ``i`` against document ``i``: a tile's diagonal alone."""
        q, thr, q_mask = queries[..., :-2], queries[..., -2].detach(), queries[..., -1].detach().ne(0)
        c, c_mask = unpack_tokens(documents)
        sim = torch.einsum("ash,ath->ast", q, c)  # (b, tq, td)
        return self._reduce(sim, thr[:, :, None], q_mask, c_mask[:, None, :])

    @staticmethod
    def _reduce(sim: Tensor, thr: Tensor, q_mask: Tensor, c_mask: Tensor) -> Tensor:
        """Token similarities ``(..., tq, td)`` to scores ``(...)``; ``thr`` broadcasts against them, the
        masks against ``(..., tq)`` (queries) and ``(..., tq, td)`` (documents)."""
        retrieved = c_mask & (sim >= thr)  # (..., tq, td)
        best = sim.masked_fill(~retrieved, float("-inf"))
        best = best.amax(-1) if not torch.is_grad_enabled() else best.max(-1).values  # (..., tq)
        alpha = retrieved.any(-1) & q_mask  # query tokens that retrieved one of the document's tokens
        acc = torch.float64 if best.dtype == torch.float64 else torch.float32
        # a token that retrieved nothing imputes 0 (where, not a product: its max is -inf)
        total = torch.where(alpha, best.to(acc), torch.zeros((), dtype=acc, device=best.device)).sum(-1)
        scores = total / alpha.sum(-1).clamp(min=1).to(acc)
        return scores.masked_fill(~c_mask.any(-1).any(-1), EMPTY_DOCUMENT_SCORE)
