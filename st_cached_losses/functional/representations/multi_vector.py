"""Late-interaction (multi-vector) scores as a plug-in of the one InfoNCE core: MaxSim, MeanMaxSim and XTR.

A multi-vector row is a padded ``(t, d)`` matrix of token embeddings with a ``(t,)`` mask. The core
reads it *packed*: one ``(n, t, d + 1)`` tensor whose last channel is the mask (1 for a scored token,
0 for padding or a token the model masked out), so that a row's tokens and its mask travel together
through every tile slice, gather and gradient buffer of the core without any of them knowing. The
gradient wrt a packed tensor is 0 in the mask channel.

[`MaxSim`][st_cached_losses.functional.representations.multi_vector.MaxSim] (ColBERT, MeanMaxSim) and [`XTR`][st_cached_losses.functional.representations.multi_vector.XTR] are similarity functions in the sense of [`score`][st_cached_losses.functional.score]
(``f(a, c) -> (len(a), len(c))``): the core scores them tile by tile, rows x columns, so the largest
intermediate is one tile's ``(b, t, q_tokens, d_tokens)`` token similarities, never the
``(Q, Q*N, q_tokens, d_tokens)`` tensor. XTR's retrieval depends on the whole batch: the core numbers the
documents first, and the rows carry what each query token retrieves (see [`XTR`][st_cached_losses.functional.representations.multi_vector.XTR]).

Shapes: ``b`` rows of a tile, ``t`` columns of a tile, ``tq`` / ``td`` query / document tokens, ``d``
the token embedding dimension."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from st_cached_losses.functional.precision import accumulation_dtype

__all__ = [
    "EMPTY_DOCUMENT_SCORE",
    "XTR",
    "MaxSim",
    "document_ids",
    "pack_tokens",
    "pad_tokens",
    "unpack_tokens",
    "xtr_top_keys",
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


@dataclass(unsafe_hash=True)
class MaxSim:
    """``sum_i max_j <q_i, d_j>`` over a query's scored tokens ``i`` and a document's scored tokens ``j``
    (ColBERT), divided by the query's token count (at least 1) when ``length_normalize`` (MeanMaxSim): the
    score of sentence-transformers' ``colbert_scores`` / ``mean_colbert_scores`` (their ``maxsim``) for
    every (query, document) pair, on packed operands ([`pack_tokens`][st_cached_losses.functional.representations.multi_vector.pack_tokens]). Padded document tokens are
    excluded from the max, padded query tokens from the sum, and a document without any token scores
    [`EMPTY_DOCUMENT_SCORE`][st_cached_losses.functional.representations.multi_vector.EMPTY_DOCUMENT_SCORE]. A tile's gradient is exact and in closed form ([`vjp`][st_cached_losses.functional.representations.multi_vector.MaxSim.vjp]), ties in the
    max resolved as ``torch.max`` resolves them."""

    length_normalize: bool = False
    #: operands are packed ``(n, t, d + 1)`` token tensors (read by [`Score`][st_cached_losses.functional.score.Score])
    token_score = True

    def __post_init__(self) -> None:
        self.length_normalize = bool(self.length_normalize)

    def __call__(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b, t)`` scores of packed ``queries (b, tq, d + 1)`` against packed ``documents (t, td, d + 1)``."""
        q, q_mask = unpack_tokens(queries)
        c, c_mask = unpack_tokens(documents)
        sim = torch.einsum("ash,bth->abst", q, c)  # (b, t, tq, td)
        return self._reduce(sim, q_mask[:, None, :], c_mask[None, :, None, :])

    @torch.no_grad()
    def scores_and_state(self, queries: Tensor, documents: Tensor) -> tuple[Tensor, Tensor]:
        """`__call__` without a graph, and what [`vjp`][st_cached_losses.functional.representations.multi_vector.MaxSim.vjp] needs of the tile: the index of the
        document token that wins each query token's max, ``(b, t, tq)`` (ties as ``torch.max`` resolves
        them, as autograd through `__call__` would route the gradient)."""
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
        that wins it (``state``: the winners from [`scores_and_state`][st_cached_losses.functional.representations.multi_vector.MaxSim.scores_and_state], else found again), so

            d/dq_as = sum_b w_abs c_b[win_abs],    d/dc_bj = sum_(a, s: win_abs = j) w_abs q_as

        a gather and a scatter of ``(b, t, tq, d)`` rows instead of autograd's two more products of the
        ``(b, t, tq, td)`` token similarities."""
        if state is None:
            state = self.scores_and_state(queries, documents)[1]
        q, q_mask = unpack_tokens(queries)
        c, c_mask = unpack_tokens(documents)
        b, tq, d = q.shape
        t, td = c.shape[:2]
        acc = accumulation_dtype(q)
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
        """Each query token's best similarity ``(..., tq)`` to scores ``(...)`` (masks as in `_reduce`)."""
        acc = accumulation_dtype(best)  # sums in fp32 (fp64 kept)
        scores = (best.to(acc) * q_mask).sum(-1)  # padded query tokens add 0
        scores = scores.masked_fill(~c_mask.any(-1).any(-1), EMPTY_DOCUMENT_SCORE)
        if self.length_normalize:
            scores = scores / q_mask.sum(-1).clamp(min=1).to(scores.dtype)
        return scores


#: bits of a retrieval key for the token position (the rest is the document's id): keys order as
#: ``(document, token)`` pairs, which is sentence-transformers' flat ``documents x tokens`` index order
_TOKEN_BITS = 20
#: the key of an empty slot or a padded token: after every real token in key order
_NO_KEY = torch.iinfo(torch.int64).max


def document_ids(documents: Tensor) -> Tensor:
    """``(n,)`` int64 ids of packed documents whose mask channel carries ``id + 1`` ([`XTR.with_column_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_column_data]);
    -1 for a document without any scored token."""
    return documents[..., -1].detach().amax(-1).to(torch.int64) - 1


def xtr_top_keys(
    queries: Tensor,
    columns: list[Tensor],
    top_k: int,
    memory_budget: int,
    state: tuple[Tensor, Tensor] | None = None,
    flat_ties: bool = False,
) -> tuple[Tensor, Tensor]:
    """The ``top_k`` document tokens each query token retrieves, as ``torch.topk`` picks them over
    sentence-transformers' flat ``documents x tokens`` layout: ``(values, keys)``, both ``(B, tq, top_k)``,
    of packed ``queries (B, tq, d + 1)`` over the scored tokens of the id-carrying document ``columns``
    ([`XTR.with_column_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_column_data], each ``(n, td_k, d + 1)``), merged with a running ``state`` from other
    columns (another process's documents). fp32 values (fp64 kept), no graph.

    Exactly ``top_k`` per query token (fewer when fewer tokens are scored: the empty slots have the key
    ``_NO_KEY``): every token whose similarity is above the ``top_k``-th largest, then, among the tokens
    equal to it, those of the lowest key ``(document id, token position)``, i.e. first in
    sentence-transformers' flat index. A rule of the tokens alone, so the same whatever the tiles, the
    processes or the ring's order. ``torch.topk`` on the CPU takes exactly ``top_k`` too, but picks among
    tied elements as its selection algorithm leaves them, an order of the whole row (its values, padding
    included, and their positions) that no streaming pass replays: on a hard negative shared by every row
    of the batch it kept the lowest-index copies in every tied query token in only 5 of 49 (batch, top_k)
    cases, 59 of 988 tied query tokens (``benchmarks/xtr_topk_ties.py``).

    With ``flat_ties`` (every column at hand, ``state`` None: one process, or the gathered columns), the
    pass keeps ``top_k + 1``; each scored query token whose ``top_k``-th and ``(top_k + 1)``-th values are
    equal or within ``_NEAR_TIE_ULPS`` relative ulps takes instead the keys ``torch.topk(sorted=False)``
    picks over sentence-transformers' flat row rebuilt (``_flat_topk_keys``: their layout, op and
    dtype, bitwise their values): 988 of 988 tied query tokens, 49 of 49 cases, theirs. Exact when the
    embeddings and the stacked width are bitwise theirs; only the tied tokens pay a full row (computed in
    blocks of ``_ROW_BLOCK`` query tokens), the others keep the streaming bound.

    Streaming: query rows in chunks, document rows in chunks, each chunk's candidates merged into the
    running top (`_merge_top`); the largest intermediate is one ``(rows, tq, top_k + docs * td)``
    block of values and of keys, sized from ``memory_budget`` bytes."""
    acc = accumulation_dtype(queries)
    q, q_mask = unpack_tokens(queries)
    b_all, tq = q.shape[:2]
    k = top_k + 1 if flat_ties else top_k  # one more: the (top_k + 1)-th value tells a tie at the boundary
    if flat_ties and state is not None:
        raise ValueError("flat_ties needs every column at once (state must be None).")
    if state is None:
        values = torch.full((b_all, tq, k), float("-inf"), dtype=acc, device=queries.device)
        keys = torch.full((b_all, tq, k), _NO_KEY, dtype=torch.int64, device=queries.device)
    else:
        values, keys = state
    td_max = max([c.shape[1] for c in columns], default=1)
    # per candidate: its value and key, their merged copies, the masked tie keys and the top-k's indices
    elems = max(1, memory_budget // 40)
    rb = max(1, min(b_all, elems // (tq * (2 * k + td_max))))
    out_v, out_k = torch.empty_like(values), torch.empty_like(keys)
    positions = torch.arange(td_max, device=queries.device)
    with torch.no_grad():
        for r0 in range(0, b_all, rb):
            qc = q[r0 : r0 + rb].to(acc)
            run_v, run_k = values[r0 : r0 + rb], keys[r0 : r0 + rb]
            for col in columns:
                c_all, m_all = unpack_tokens(col)
                ids_all = document_ids(col)
                n, td = c_all.shape[:2]
                cb = max(1, min(n, (elems // (qc.shape[0] * tq) - 2 * k) // max(td, 1)))
                for c0 in range(0, n, cb):
                    c, m = c_all[c0 : c0 + cb].to(acc), m_all[c0 : c0 + cb]
                    sim = torch.einsum("ash,bth->asbt", qc, c)  # (rb, tq, cb, td)
                    sim.masked_fill_(~m[None, None], float("-inf"))
                    tile_keys = (ids_all[c0 : c0 + cb, None] << _TOKEN_BITS) + positions[None, :td]
                    tile_keys = tile_keys.masked_fill(~m, _NO_KEY).flatten()  # (cb * td,)
                    run_v, run_k = _merge_top(
                        torch.cat([run_v, sim.flatten(2)], dim=-1),
                        torch.cat([run_k, tile_keys.expand(*run_k.shape[:2], -1)], dim=-1),
                        k,
                    )
            out_v[r0 : r0 + rb], out_k[r0 : r0 + rb] = run_v, run_k
    if not flat_ties:
        return out_v, out_k
    values, keys = out_v[..., :top_k].contiguous(), out_k[..., :top_k].contiguous()
    kth, next_v = out_v[..., top_k - 1], out_v[..., top_k]
    # exact ties, and near ones within rounding of a differently shaped product (ours against theirs)
    slack = _NEAR_TIE_ULPS * torch.finfo(q.dtype if q.is_floating_point() else acc).eps
    tied = (next_v > float("-inf")) & (kth - next_v <= slack * (kth.abs() + next_v.abs())) & q_mask
    if bool(tied.any()):
        keys[tied] = _flat_topk_keys(q, tied.flatten().nonzero().flatten(), columns, top_k)
    return values, keys


#: query tokens whose ``top_k``-th and ``(top_k + 1)``-th similarities are within this many ulps (relative)
#: of each other take sentence-transformers' own ``torch.topk`` over their flat row
_NEAR_TIE_ULPS = 16


def _flat_topk_keys(q: Tensor, rows: Tensor, columns: list[Tensor], top_k: int) -> Tensor:
    """``(len(rows), top_k)`` keys of the tokens ``torch.topk(sorted=False)`` picks for the query tokens
    ``rows`` (flat indices into ``q (B, tq, d)``) over sentence-transformers' flat row: every column's
    documents stacked query-major (``id = row * N + column``), each padded to the widest column's tokens,
    padding at the dtype's minimum, the product ``Q @ D.T`` of their ``(B * tq, d)`` queries in the queries'
    dtype (``xtr_scores``'s op, layout and values). A row of that product need not be bitwise the same
    computed alone: the BLAS (MKL on the CPU) computes rows in blocks and the last, ragged block by
    another kernel; each row is computed within its block of ``_ROW_BLOCK`` aligned rows of their queries,
    the last full block together with the tail, which reproduced every row of the whole product bitwise
    (the tests check it). Padding retrieved (``top_k`` beyond the scored tokens) gives ``_NO_KEY``."""
    out = torch.full((rows.shape[0], top_k), _NO_KEY, dtype=torch.int64, device=q.device)
    for sel, grid, mask, td in _flat_rows(q, rows, columns):
        idx = grid.topk(min(top_k, grid.shape[-1]), dim=-1, sorted=False).indices
        key = ((idx // td) << _TOKEN_BITS) + idx % td
        out[sel, : idx.shape[-1]] = torch.where(mask[idx], key, _NO_KEY)
    return out


def _flat_rows(
    q: Tensor, rows: Tensor, columns: list[Tensor]
) -> Iterator[tuple[Tensor, Tensor, Tensor, int]]:
    """Sentence-transformers' flat rows of the query tokens ``rows`` (``_flat_topk_keys``), one block of
    their queries at a time: ``(sel, grid, mask, td)``, the positions in ``rows`` of the block's tokens,
    their ``(len(sel), Db * Dt)`` rows, the flat document-token mask and ``Dt``."""
    dtype = q.dtype if q.is_floating_point() else torch.float32
    td = max(c.shape[1] for c in columns)
    embs = [pad_tokens(c, td).detach() for c in columns]
    docs = torch.stack([unpack_tokens(c)[0] for c in embs], dim=1).to(dtype)  # (n, N, td, d): exact casts
    mask = torch.stack([unpack_tokens(c)[1] for c in embs], dim=1).flatten()  # (n * N * td,)
    d_flat = docs.reshape(-1, docs.shape[-1]).T  # their (d, Db * Dt) view
    q_flat = q.detach().to(dtype).reshape(-1, q.shape[-1])  # their (Qb * Qt, d)
    m, g = q_flat.shape[0], _ROW_BLOCK
    last = max(0, m // g * g - g)  # the last full block goes with the tail
    starts = rows // g * g
    starts = torch.where(starts + 2 * g > m, last, starts)
    with torch.no_grad():
        for start in starts.unique().tolist():
            end = m if start == last else start + g
            grid = (q_flat[start:end] @ d_flat).masked_fill_(~mask[None], torch.finfo(dtype).min)
            sel = (starts == start).nonzero().flatten()
            yield sel, grid[rows[sel] - start], mask, td


#: rows of sentence-transformers' query-token product computed together to reproduce its values bitwise
_ROW_BLOCK = 16


def _merge_top(values: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first ``k`` of ``(..., n)`` candidates in the order (value descending, key ascending): every
    candidate above the ``k``-th largest value, then the lowest keys of those equal to it. ``(..., k)``
    values (descending) and keys; ``-inf`` candidates carry ``_NO_KEY``, so slots they fill stay empty."""
    top_v, top_i = values.topk(k, dim=-1)  # sorted, descending: the multiset is topk's whatever the ties
    kth = top_v[..., -1:]
    above = top_v > kth  # the first g slots, g = how many candidates beat the k-th value
    tie_keys = keys.masked_fill(values != kth, _NO_KEY).topk(k, dim=-1, largest=False).values  # ascending
    slot = torch.arange(k, device=values.device)
    ties_from = (slot - above.sum(-1, keepdim=True)).clamp(min=0)  # slot g takes the lowest tie key
    return top_v, torch.where(above, keys.gather(-1, top_i), tie_keys.gather(-1, ties_from))


@dataclass(unsafe_hash=True)
class XTR:
    """sentence-transformers' ``xtr_scores`` / ``XTRScores(top_k)`` (Lee et al. 2023) for every (query,
    document) pair, on packed documents that carry their ids ([`with_column_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_column_data], in
    sentence-transformers' query-major order) and packed queries that carry the document tokens each of
    their tokens retrieves ([`with_row_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_row_data], from a streaming pass over every column,
    [`xtr_top_keys`][st_cached_losses.functional.representations.multi_vector.xtr_top_keys]; the core calls both once per loss call, with every document column; in the ring,
    each visiting block of documents is merged into the running top-``k``, [`row_state`][st_cached_losses.functional.representations.multi_vector.XTR.row_state], before the rows
    take it, [`with_row_state`][st_cached_losses.functional.representations.multi_vector.XTR.with_row_state]).

    Per query token ``s`` and document ``j``: the retrieved tokens are those of the query token's ``top_k``
    over every in-batch document token ([`xtr_top_keys`][st_cached_losses.functional.representations.multi_vector.xtr_top_keys]: exactly ``top_k``; exact ties at the
    ``top_k``-th similarity resolved as ``ties`` says: by default the tied query tokens' flat rows are
    rebuilt as sentence-transformers lays them out and handed to ``torch.topk``, their choice, on one
    process or gathered; in the ring, and with ``ties="lowest"``, the lowest (document, token) index, which
    ``torch.topk`` often does not pick, see there) that belong to ``j``; ``m_s`` is the largest retrieved similarity, or 0 when none is
    retrieved (``alpha_s`` = whether one is). The score is ``sum_s m_s / max(1, sum_s alpha_s)`` over the
    query's scored tokens; a document without any scored token scores [`EMPTY_DOCUMENT_SCORE`][st_cached_losses.functional.representations.multi_vector.EMPTY_DOCUMENT_SCORE]. The
    retrieval is decided once, by the first pass, and looked up by key in every tile (never by comparing
    a tile's recomputed similarities with a threshold, which a different rounding in another tile shape
    could tip). The gradient is exact: through the max to the retrieved token that wins it (ties as
    ``torch.max`` resolves them), nothing through the retrieval itself or the count, as in
    sentence-transformers.

    Layouts: documents ``(t, td, d + 1)``, the mask channel ``id + 1`` on scored tokens and 0 on padding
    (fp32 at least: ids up to 2**24 documents); queries ``(b, tq, d + 2 top_k + 1)``: the embeddings, the
    retrieved tokens' document ids (-1 in empty slots), their positions, then the mask."""

    top_k: int = 256
    #: exact ties at the ``top_k``-th similarity: ``"topk"``, sentence-transformers' own choice (the tied
    #: query tokens' flat rows rebuilt and handed to ``torch.topk``, where every column is at hand: one
    #: process, or gathered); ``"lowest"``, the lowest (document, token) keys (always in the ring)
    ties: str = "topk"
    #: operands are packed token tensors (read by [`Score`][st_cached_losses.functional.score.Score])
    token_score = True

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}.")
        if self.ties not in ("topk", "lowest"):
            raise ValueError(f"ties must be 'topk' or 'lowest', got {self.ties!r}.")

    def with_column_data(
        self, columns: list[Tensor], row_offset: int = 0, n_rows: int | None = None
    ) -> list[Tensor]:
        """The packed document ``columns`` (each ``(n, td, d + 1)``) with each document's id in the mask
        channel (``id + 1`` on its scored tokens, 0 on padding): ``id = (row_offset + row) * N + column``
        for ``N`` columns, sentence-transformers' query-major document order over every process's rows
        (``row_offset``: this process's first row, ``n_rows``: the rows of every process, to check that the
        ids are exact in the columns' dtype). Half-precision columns come back in fp32 (ids beyond 256 /
        2048 are not exact in bf16 / fp16); the result keeps the columns' graph (the mask channel gets no
        gradient)."""
        n_cols = len(columns)
        total = n_rows if n_rows is not None else row_offset + max([c.shape[0] for c in columns], default=0)
        out = []
        for j, col in enumerate(columns):
            dtype = col.dtype if col.dtype in (torch.float32, torch.float64) else torch.float32
            exact = int(2 / torch.finfo(dtype).eps)  # every integer up to 2**24 (fp32), 2**53 (fp64)
            if n_cols * total >= exact:
                raise ValueError(
                    f"XTR numbers the batch's {n_cols * total} documents in the token rows' {dtype}, exact "
                    f"only below {exact}: use fewer rows per step."
                )
            rows = torch.arange(col.shape[0], device=col.device, dtype=dtype)
            ids = (rows + row_offset) * n_cols + (j + 1)  # id + 1: 0 stays padding
            mask = col[..., -1].detach().ne(0)
            out.append(torch.cat([col[..., :-1].to(dtype), (mask * ids[:, None]).unsqueeze(-1)], dim=-1))
        return out

    def with_row_data(self, queries: Tensor, columns: list[Tensor], memory_budget: int) -> Tensor:
        """Packed ``queries (B, tq, d + 1)`` as ``(B, tq, d + 2 top_k + 1)``: the embeddings, the ids and
        positions of the document tokens each query token retrieves from the id-carrying ``columns``
        ([`with_column_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_column_data]), then the mask; the result keeps ``queries``' graph (the retrieval
        channels get no gradient)."""
        state = xtr_top_keys(queries, columns, self.top_k, memory_budget, flat_ties=self.ties == "topk")
        return self.with_row_state(queries, state)

    def row_state(
        self,
        queries: Tensor,
        columns: list[Tensor],
        memory_budget: int,
        state: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """What the rows' data is made of, over the id-carrying ``columns`` and a previous ``state`` (other
        columns: the blocks of other processes visiting in a ring): each query token's running top-k
        values and keys ([`xtr_top_keys`][st_cached_losses.functional.representations.multi_vector.xtr_top_keys])."""
        return xtr_top_keys(queries, columns, self.top_k, memory_budget, state)

    def with_row_state(self, queries: Tensor, state: tuple[Tensor, Tensor]) -> Tensor:
        """[`with_row_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_row_data] from a finished [`row_state`][st_cached_losses.functional.representations.multi_vector.XTR.row_state] (every column of every process seen)."""
        keys = state[1]
        found = keys != _NO_KEY
        acc = accumulation_dtype(queries)  # ids and positions exact (fp32 at least)
        doc = torch.where(found, keys >> _TOKEN_BITS, -1).to(acc)
        pos = torch.where(found, keys & ((1 << _TOKEN_BITS) - 1), 0).to(acc)
        queries = queries.to(acc)
        return torch.cat([queries[..., :-1], doc, pos, queries[..., -1:]], dim=-1)

    def without_row_data(self, x: Tensor) -> Tensor:
        """A tensor laid out as [`with_row_data`][st_cached_losses.functional.representations.multi_vector.XTR.with_row_data]'s (rows or their gradient) back as ``(B, tq, d + 1)``:
        the retrieval channels dropped."""
        return torch.cat([x[..., : -2 * self.top_k - 1], x[..., -1:]], dim=-1)

    def _split(self, queries: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Embeddings ``(b, tq, d)``, retrieved document ids and positions ``(b, tq, top_k)`` (int64) and the
        mask ``(b, tq)`` of retrieval-carrying rows."""
        k = self.top_k
        data = queries[..., -2 * k - 1 : -1].detach().to(torch.int64)
        doc, pos = data[..., :k].contiguous(), data[..., k:]
        return queries[..., : -2 * k - 1], doc, pos, queries[..., -1].detach().ne(0)

    def __call__(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b, t)`` scores of retrieval-carrying ``queries`` against id-carrying ``documents (t, td, d + 1)``."""
        q, doc, pos, q_mask = self._split(queries)
        c, c_mask = unpack_tokens(documents)
        t, td = c.shape[:2]
        ids = document_ids(documents)
        # each retrieved token's document among this tile's, by id (a tile's documents need not be sorted)
        order = ids.argsort()
        at = torch.searchsorted(ids[order], doc).clamp(max=max(t - 1, 0))
        hit = (ids[order][at] == doc) & (doc >= 0) if t else torch.zeros_like(doc, dtype=torch.bool)
        flat = torch.where(hit, order[at] * td + pos, t * td)  # misses go to a spare slot
        b, tq = q.shape[:2]
        retrieved = torch.zeros(b, tq, t * td + 1, dtype=torch.bool, device=q.device)
        retrieved = retrieved.scatter_(-1, flat, True)[..., :-1].view(b, tq, t, td).transpose(1, 2)
        sim = torch.einsum("ash,bth->abst", q.to(c.dtype), c)  # (b, t, tq, td)
        return self._reduce(
            sim, retrieved & c_mask[None, :, None, :], q_mask[:, None, :], c_mask[None, :, None, :]
        )

    def pairwise(self, queries: Tensor, documents: Tensor) -> Tensor:
        """``(b,)`` scores of query ``i`` against document ``i``: a tile's diagonal alone."""
        q, doc, pos, q_mask = self._split(queries)
        c, c_mask = unpack_tokens(documents)
        b, tq = q.shape[:2]
        td = c.shape[1]
        hit = doc == document_ids(documents)[:, None, None]  # (b, tq, top_k)
        hit &= doc >= 0
        retrieved = torch.zeros(b, tq, td + 1, dtype=torch.bool, device=q.device)
        retrieved = retrieved.scatter_(-1, torch.where(hit, pos, td), True)[..., :-1]  # (b, tq, td)
        sim = torch.einsum("ash,ath->ast", q.to(c.dtype), c)  # (b, tq, td)
        return self._reduce(sim, retrieved & c_mask[:, None, :], q_mask, c_mask[:, None, :])

    @staticmethod
    def _reduce(sim: Tensor, retrieved: Tensor, q_mask: Tensor, c_mask: Tensor) -> Tensor:
        """Token similarities ``(..., tq, td)`` to scores ``(...)``; ``retrieved`` is theirs, the masks
        broadcast against ``(..., tq)`` (queries) and ``(..., tq, td)`` (documents)."""
        best = sim.masked_fill(~retrieved, float("-inf"))
        best = best.amax(-1) if not torch.is_grad_enabled() else best.max(-1).values  # (..., tq)
        alpha = retrieved.any(-1) & q_mask  # query tokens that retrieved one of the document's tokens
        acc = accumulation_dtype(best)
        # a token that retrieved nothing imputes 0 (where, not a product: its max is -inf)
        total = torch.where(alpha, best.to(acc), torch.zeros((), dtype=acc, device=best.device)).sum(-1)
        scores = total / alpha.sum(-1).clamp(min=1).to(acc)
        return scores.masked_fill(~c_mask.any(-1).any(-1), EMPTY_DOCUMENT_SCORE)
