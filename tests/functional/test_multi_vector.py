"""MaxSim / MeanMaxSim / XTR through the one core: tile by tile, against the dense ``(Q, N, tq, td)`` reference
(values and gradients, every path and several tile sizes), and against sentence-transformers' own
``colbert_scores``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from st_cached_losses.functional import infonce, infonce_loss_and_grad
from st_cached_losses.functional.representations.multi_vector import (
    XTR,
    MaxSim,
    pack_tokens,
    pad_tokens,
    unpack_tokens,
    xtr_top_keys,
)


def token_case(n: int, n_cols: int, tq: int = 5, td: int = 7, d: int = 4, seed: int = 0, dtype=torch.float64):
    """Packed queries ``(n, tq, d + 1)`` and ``n_cols`` packed document columns ``(n, td_k, d + 1)`` with
    ragged masks: some padded query tokens, some padded document tokens, one document without any
    token, one query without any; documents of column k have ``td + k`` tokens."""
    g = torch.Generator().manual_seed(seed)

    def rows(m: int, t: int, min_len: int) -> torch.Tensor:
        x = torch.randn(m, t, d, generator=g, dtype=dtype)
        lengths = torch.randint(min_len, t + 1, (m,), generator=g)
        mask = torch.arange(t)[None, :] < lengths[:, None]
        x = x.masked_fill(~mask[..., None], 0.0)
        return pack_tokens(x, mask)

    q = rows(n, tq, 1)
    cols = [rows(n, td + k, 1) for k in range(n_cols)]
    cols[-1][min(2, n - 1), :, -1] = 0.0  # a document without any scored token
    q[-1, :, -1] = 0.0  # a query without any scored token
    return q, cols


def dense_scores(q: torch.Tensor, docs: torch.Tensor, length_normalize: bool) -> torch.Tensor:
    """The full ``(Q, N, tq, td)`` MaxSim, written independently of the kernel."""
    qe, qm = q[..., :-1], q[..., -1] != 0
    de, dm = docs[..., :-1], docs[..., -1] != 0
    sim = torch.einsum("qsh,nth->qnst", qe, de)
    sim = sim.masked_fill(~dm[None, :, None, :], torch.finfo(sim.dtype).min)
    best = sim.max(-1).values * qm[:, None, :]
    scores = best.sum(-1)
    scores = scores.masked_fill(~dm.any(-1)[None, :], -1e9)
    if length_normalize:
        scores = scores / qm.sum(-1).clamp(min=1)[:, None]
    return scores


def dense_loss(q, cols, scale, length_normalize):
    width = max(c.shape[1] for c in cols)
    docs = torch.cat([pad_tokens(c, width) for c in cols])  # (K n, td, d + 1)
    logits = scale * dense_scores(q, docs, length_normalize)
    return F.cross_entropy(logits, torch.arange(q.shape[0]))


def leaves(q, cols):
    return q.clone().requires_grad_(), [c.clone().requires_grad_() for c in cols]


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize(
    "opts",
    [
        {"path": "chunked"},
        {"path": "chunked", "chunk_size": 3},
        {"path": "tiled", "tile_size": 1},
        {"path": "tiled", "tile_size": 4},
        {"path": "tiled", "tile_size": 64},
        {"memory_budget": 50_000},  # auto: the plan counts tq x td per logit
    ],
)
def test_maxsim_matches_dense_reference(length_normalize: bool, opts: dict) -> None:
    q, cols = token_case(9, 2)
    scale = 1.5  # exact in fp32 (infonce carries a float scale as an fp32 tensor)
    rq, rc = leaves(q, cols)
    ref = dense_loss(rq, rc, scale, length_normalize)
    ref.backward()
    sim = MaxSim(length_normalize)

    out = infonce_loss_and_grad(q, cols, scale=scale, similarity=sim, **opts)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.grad_anchors, rq.grad, rtol=1e-10, atol=1e-10)
    for g, r in zip(out.grad_candidates, rc):
        torch.testing.assert_close(g, r.grad, rtol=1e-10, atol=1e-10)
    # the mask channel gets no gradient
    assert out.grad_anchors is not None and not out.grad_anchors[..., -1].any()

    aq, ac = leaves(q, cols)
    loss = infonce(aq, ac, scale=scale, similarity=sim, **opts)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(aq.grad, rq.grad, rtol=1e-10, atol=1e-10)
    for a, r in zip(ac, rc):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-10, atol=1e-10)


def test_maxsim_gradient_through_ties_and_gradcheck() -> None:
    """Exact through the max: gradcheck on a small case, and tied document tokens (the same vector twice)
    route the gradient the way torch's max does in the dense reference."""
    q, cols = token_case(4, 1, tq=3, td=4, d=3, seed=3)
    cols[0][:, 1, :-1] = cols[0][:, 0, :-1]  # ties: tokens 0 and 1 identical
    cols[0][:, :2, -1] = 1.0
    rq, rc = leaves(q, cols)
    dense_loss(rq, rc, 1.0, False).backward()
    out = infonce_loss_and_grad(q, cols, scale=1.0, similarity=MaxSim(), path="tiled", tile_size=2)
    torch.testing.assert_close(out.grad_candidates[0], rc[0].grad, rtol=1e-10, atol=1e-10)

    emb = [q[..., :-1].clone().requires_grad_(), cols[0][..., :-1].clone().requires_grad_()]
    masks = [q[..., -1], cols[0][..., -1]]
    cols[0][:, 1, :-1] += 0.1  # away from the tie for the finite differences

    def fn(a, c):
        return infonce(pack_tokens(a, masks[0]), [pack_tokens(c, masks[1])], scale=1.0, similarity=MaxSim())

    emb[1] = emb[1].detach().clone().add_(torch.randn_like(emb[1]) * 0.1).requires_grad_()
    assert torch.autograd.gradcheck(fn, tuple(emb))


def test_maxsim_matches_sentence_transformers_colbert_scores() -> None:
    st_colbert = pytest.importorskip("sentence_transformers.multi_vector_encoder.scoring")
    q, cols = token_case(6, 2, dtype=torch.float32)
    width = max(c.shape[1] for c in cols)
    docs = [pad_tokens(c, width) for c in cols]
    qe, qm = unpack_tokens(q)
    stacked = torch.stack([unpack_tokens(c)[0] for c in docs], dim=1)  # (Q, N, td, d)
    smask = torch.stack([unpack_tokens(c)[1] for c in docs], dim=1)
    for fn, ours in [(st_colbert.colbert_scores, MaxSim()), (st_colbert.mean_colbert_scores, MaxSim(True))]:
        theirs = fn(qe, stacked, queries_mask=qm, documents_mask=smask)  # (Q, Q * N), query-major
        mine = torch.stack([ours(q, c) for c in docs], dim=2).reshape(q.shape[0], -1)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("wanted", [(True, True), (True, False), (False, True)])
def test_maxsim_closed_form_vjp_equals_autograd(length_normalize: bool, wanted: tuple[bool, bool]) -> None:
    """The core's tile gradient (:meth:`MaxSim.vjp`, from the winners kept by ``scores_and_state`` or found
    again) is autograd's through :meth:`MaxSim.__call__`: padded tokens, an empty document, a query without
    tokens, and tied document tokens (routed as torch's max routes them)."""
    q, cols = token_case(6, 1, tq=4, td=5, d=3, seed=5)
    docs = cols[0].clone()
    docs[:, 1, :-1] = docs[:, 0, :-1]  # ties between tokens 0 and 1 of every document
    docs[:, :2, -1] = 1.0
    docs[2, :, -1] = 0.0  # a document without any scored token
    sim = MaxSim(length_normalize)
    g = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    aq, ad = q.clone().requires_grad_(wanted[0]), docs.clone().requires_grad_(wanted[1])
    ref = torch.autograd.grad(sim(aq, ad), [x for x in (aq, ad) if x.requires_grad], g)
    scores, winners = sim.scores_and_state(q, docs)
    torch.testing.assert_close(scores, sim(q, docs), rtol=0, atol=0)
    for kept in ({"state": winners}, {}):
        got = [x for x in sim.vjp(g, q, docs, *wanted, **kept) if x is not None]
        assert len(got) == len(ref)
        for mine, theirs in zip(got, ref):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_maxsim_pairwise_is_the_diagonal(length_normalize: bool) -> None:
    q, cols = token_case(6, 1, td=5)
    sim = MaxSim(length_normalize)
    torch.testing.assert_close(sim.pairwise(q, cols[0]), sim(q, cols[0]).diagonal(), rtol=1e-12, atol=0.0)


def test_token_operands_are_checked() -> None:
    q, cols = token_case(4, 1)
    with pytest.raises(ValueError, match="packed token embeddings"):
        infonce(q[..., 0], cols, similarity=MaxSim())
    with pytest.raises(ValueError, match="2-D"):
        infonce(q, cols, similarity="dot")
    with pytest.raises(ValueError, match="embedding dim"):
        infonce(q, [cols[0][..., 1:]], similarity=MaxSim())


def test_maxsim_memory_is_one_tile() -> None:
    """The peak of the loss stage is bounded by the memory budget (tiles of ``(rows, docs, tq, td)``), a
    fraction of sentence-transformers' ``(Q, Q*N, tq, td)`` intermediate; the result does not change."""
    from tests.support.memory import PeakMemory

    q, cols = token_case(64, 2, tq=16, td=32, d=8, seed=7, dtype=torch.float32)
    full = 64 * 128 * 16 * 33 * 4  # the whole score intermediate in fp32, at the widest column
    ref = infonce_loss_and_grad(q, cols, scale=1.0, similarity=MaxSim(), memory_budget=2**30)
    with PeakMemory() as mem:
        out = infonce_loss_and_grad(q, cols, scale=1.0, similarity=MaxSim(), memory_budget=2**20)
    grads = sum(g.numel() * 4 for g in [out.grad_anchors, *out.grad_candidates] if g is not None)
    assert mem.peak_bytes < 2**20 + 3 * grads + 2**18, (mem.peak_bytes, full)
    assert mem.peak_bytes < full / 8
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.grad_anchors, ref.grad_anchors)


# --------------------------------------------------------------------------- XTR


def query_major(cols: list[torch.Tensor]) -> torch.Tensor:
    """The document columns as sentence-transformers stacks them for ``xtr_scores``: ``(n * K, td, d + 1)``,
    row ``i``'s ``K`` documents side by side (document ``i * K + k`` is column ``k``'s row ``i``)."""
    width = max(c.shape[1] for c in cols)
    return torch.stack([pad_tokens(c, width) for c in cols], dim=1).flatten(0, 1)


def dense_xtr_scores(q: torch.Tensor, docs: torch.Tensor, top_k: int, stable: bool = False) -> torch.Tensor:
    """XTR over the full ``(Q, N, tq, td)`` similarities, written independently of the kernel: each query
    token's ``top_k`` over every scored token of every document, as sentence-transformers' ``xtr_scores``
    picks them (``torch.topk(sorted=False)`` over their one-product flat grid), or with ``stable`` the ties
    taken in the flat ``documents x tokens`` index order (a stable sort: the ring's rule), the per-document max over the retrieved tokens (0 if none),
    divided by the query tokens that retrieved one of the document's tokens."""
    qe, qm = q[..., :-1], q[..., -1] != 0
    de, dm = docs[..., :-1], docs[..., -1] != 0
    sim = torch.einsum("qsh,nth->qsnt", qe, de)  # (Q, tq, N, td)
    if stable:
        flat = sim.masked_fill(~dm[None, None], float("-inf")).flatten(2)
        idx = flat.sort(dim=-1, descending=True, stable=True).indices[..., : min(top_k, int(dm.sum()))]
    else:  # their grid: one product of the flat query tokens, padding at the dtype minimum, their topk
        grid = qe.reshape(-1, qe.shape[-1]) @ de.reshape(-1, de.shape[-1]).T
        grid = grid.masked_fill(~dm.flatten()[None], torch.finfo(grid.dtype).min).view(*sim.shape[:2], -1)
        idx = grid.topk(min(top_k, grid.shape[-1]), dim=-1, sorted=False).indices
        idx = torch.where(dm.flatten()[idx], idx, idx[..., :1])  # a retrieved padding token retrieves nothing
    retrieved = torch.zeros_like(sim.flatten(2), dtype=torch.bool).scatter_(-1, idx, True).view(sim.shape)
    best = sim.masked_fill(~retrieved, float("-inf")).max(-1).values  # (Q, tq, N)
    alpha = retrieved.any(-1) & qm[:, :, None]
    scores = torch.where(alpha, best, torch.zeros_like(best)).sum(1) / alpha.sum(1).clamp(min=1)
    return scores.masked_fill(~dm.any(-1)[None, :], -1e9)


def dense_xtr_loss(q, cols, scale, top_k, stable=False):
    logits = scale * dense_xtr_scores(q, query_major(cols), top_k, stable)  # (Q, Q * K), query-major
    return F.cross_entropy(logits, torch.arange(q.shape[0]) * len(cols))


def tied_case(n: int, n_cols: int, seed: int = 0, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`token_case` with exact ties everywhere: token embeddings on a grid of quarters (every
    similarity is a multiple of 1/16, exact in any summation order) and one document repeated in
    several rows of the last column (a hard negative shared by several queries)."""
    q, cols = token_case(n, n_cols, seed=seed, **kw)
    quarter = [(x[..., :-1] * 4).round() / 4 for x in (q, *cols)]
    q = torch.cat([quarter[0], q[..., -1:]], dim=-1)
    cols = [torch.cat([e, c[..., -1:]], dim=-1) for e, c in zip(quarter[1:], cols)]
    last = cols[-1]
    widest = int(last[..., -1].ne(0).sum(1).argmax())  # copied: the column keeps its width
    last[[r for r in range(n) if r != widest][:4]] = last[widest].clone()  # a repeated document: exact ties
    return q, cols


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("top_k", [1, 5, 37, 10_000])
@pytest.mark.parametrize(
    "opts",
    [
        {"path": "chunked"},
        {"path": "chunked", "chunk_size": 4},
        {"path": "tiled", "tile_size": 1},
        {"path": "tiled", "tile_size": 4},
        {"memory_budget": 4_000},  # the retrieval pass streams in tiles of a few rows and documents
    ],
)
def test_xtr_matches_dense_reference(top_k: int, opts: dict, ties: bool) -> None:
    """Every path and tile shape equals the dense reference, values and gradients; with exact ties
    (grid embeddings, a repeated document) too: exactly ``top_k`` tokens per query token, the tied ones
    taken in the flat ``documents x tokens`` order."""
    q, cols = tied_case(9, 2) if ties else token_case(9, 2)
    scale = 1.5
    rq, rc = leaves(q, cols)
    ref = dense_xtr_loss(rq, rc, scale, top_k)
    ref.backward()
    sim = XTR(top_k)

    out = infonce_loss_and_grad(q, cols, scale=scale, similarity=sim, **opts)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-10, atol=1e-10)
    assert out.grad_anchors is not None and out.grad_anchors.shape == q.shape
    assert rq.grad is not None and rq.grad.abs().max() > 0 and all(r.grad.abs().max() > 0 for r in rc)
    torch.testing.assert_close(out.grad_anchors, rq.grad, rtol=1e-10, atol=1e-10)
    for g, r in zip(out.grad_candidates, rc):
        torch.testing.assert_close(g, r.grad, rtol=1e-10, atol=1e-10)
    assert not out.grad_anchors[..., -1].any()

    aq, ac = leaves(q, cols)
    loss = infonce(aq, ac, scale=scale, similarity=sim, **opts)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(aq.grad, rq.grad, rtol=1e-10, atol=1e-10)
    for a, r in zip(ac, rc):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-10, atol=1e-10)


def test_xtr_top_k_matters() -> None:
    """Not a MaxSim in disguise: the loss changes with top_k, and every top_k at least the pool of scored
    document tokens gives the same loss (all retrieved)."""
    q, cols = token_case(9, 2)
    losses = {k: infonce(q, cols, scale=1.0, similarity=XTR(k)).item() for k in (2, 8, 200, 10_000)}
    pool = sum(int(c[..., -1].sum()) for c in cols)
    assert pool < 200
    assert len({losses[2], losses[8], losses[200]}) == 3
    assert losses[200] == losses[10_000]


@pytest.mark.parametrize("top_k", [1, 3, 6, 40, 10_000])
def test_xtr_top_keys_stream_equals_dense_topk(top_k: int) -> None:
    """The streaming retrieval pass, whatever its tiles, keeps for each query token exactly the ``top_k``
    tokens of the stable dense order (value descending, then flat ``documents x tokens`` index): with exact
    ties (grid embeddings, a repeated document), and every scored token when there are fewer."""
    q, cols = tied_case(7, 3, tq=4, td=5, seed=4)
    xtr = XTR(top_k)
    ided = xtr.with_column_data(cols)
    docs = query_major(ided)
    td = docs.shape[1]
    sim = torch.einsum("qsh,nth->qsnt", q[..., :-1], docs[..., :-1])
    flat = sim.masked_fill(docs[..., -1][None, None] == 0, float("-inf")).flatten(2)
    pool = int((docs[..., -1] != 0).sum())
    k = min(top_k, pool)
    order = flat.sort(dim=-1, descending=True, stable=True)
    want_doc, want_pos = order.indices[..., :k] // td, order.indices[..., :k] % td
    # a key names (document, position); the query-major document number is sentence-transformers' own
    ties_at_boundary = 0
    for budget in (100, 3_000, 2**30):
        values, keys = xtr_top_keys(q, ided, top_k, budget)
        assert values.shape == keys.shape == (7, 4, top_k)
        got = xtr.with_row_state(q, (values, keys))[..., q.shape[-1] - 1 : -1]
        doc, pos = got[..., :top_k].long(), got[..., top_k:].long()
        assert (doc[..., k:] == -1).all()  # fewer scored tokens than top_k: empty slots
        key = lambda dd, pp: (dd * 64 + pp).sort(-1).values  # noqa: E731
        torch.testing.assert_close(key(doc[..., :k], pos[..., :k]), key(want_doc, want_pos), rtol=0, atol=0)
        torch.testing.assert_close(values[..., :k], order.values[..., :k], rtol=0, atol=0)
    if top_k < pool:
        ties_at_boundary = int((order.values[..., k - 1] == order.values[..., k]).sum())
        assert ties_at_boundary > 0  # the case holds ties the top-k must cut


def test_xtr_matches_sentence_transformers_xtr_scores() -> None:
    """The scores of sentence-transformers' xtr_scores on the same batch (their top-k over the same pool),
    from the id-carrying columns and the rows carrying each token's retrieved tokens."""
    scoring = pytest.importorskip("sentence_transformers.multi_vector_encoder.scoring")
    q, cols = token_case(6, 2, dtype=torch.float32)
    width = max(c.shape[1] for c in cols)
    qe, qm = unpack_tokens(q)
    stacked = torch.stack([unpack_tokens(pad_tokens(c, width))[0] for c in cols], dim=1)  # (Q, N, td, d)
    smask = torch.stack([unpack_tokens(pad_tokens(c, width))[1] for c in cols], dim=1)
    for top_k in (3, 20, 256):
        theirs = scoring.xtr_scores(qe, stacked, queries_mask=qm, documents_mask=smask, top_k=top_k)
        ours = XTR(top_k)
        docs = [pad_tokens(c, width) for c in ours.with_column_data(cols)]
        rows = ours.with_row_data(q, docs, 2**20)
        mine = torch.stack([ours(rows, c) for c in docs], dim=2).reshape(q.shape[0], -1)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-5)
        pair = ours.pairwise(rows, docs[0])
        torch.testing.assert_close(pair, ours(rows, docs[0]).diagonal(), rtol=1e-6, atol=1e-6)


def test_xtr_gradcheck() -> None:
    q, cols = token_case(4, 2, tq=3, td=4, d=3, seed=5)
    masks = [q[..., -1], *(c[..., -1] for c in cols)]
    emb = tuple(t[..., :-1].clone().requires_grad_() for t in (q, *cols))

    def fn(a, c0, c1):
        packed = [pack_tokens(a, masks[0]), pack_tokens(c0, masks[1]), pack_tokens(c1, masks[2])]
        return infonce(packed[0], packed[1:], scale=1.0, similarity=XTR(6), path="tiled", tile_size=3)

    assert torch.autograd.gradcheck(fn, emb)


def test_xtr_refuses_terms_against_anchors() -> None:
    """XTR's top-k runs over the documents' tokens: a term scoring documents against the anchors (the
    symmetric loss) is refused by name."""
    q, cols = token_case(4, 1)
    with pytest.raises(ValueError, match="query_to_doc"):
        infonce(q, cols, similarity=XTR(3), symmetric=True)
    with pytest.raises(ValueError, match="top_k"):
        XTR(0)


def test_xtr_memory_is_one_tile() -> None:
    """Both passes (thresholds, then scores) stay within the memory budget's tiles: a fraction of the
    ``(Q, Q*N, tq, td)`` similarities sentence-transformers' xtr_scores materialises."""
    from tests.support.memory import PeakMemory

    q, cols = token_case(64, 2, tq=16, td=32, d=8, seed=7, dtype=torch.float32)
    full = 64 * 128 * 16 * 33 * 4
    ref = infonce_loss_and_grad(q, cols, scale=1.0, similarity=XTR(20), memory_budget=2**30)
    with PeakMemory() as mem:
        out = infonce_loss_and_grad(q, cols, scale=1.0, similarity=XTR(20), memory_budget=2**20)
    grads = sum(g.numel() * 4 for g in [out.grad_anchors, *out.grad_candidates] if g is not None)
    assert mem.peak_bytes < 2 * 2**20 + 4 * grads + 2**18, (mem.peak_bytes, full)
    assert mem.peak_bytes < full / 8
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.grad_anchors, ref.grad_anchors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_xtr_half_inputs_score_in_fp32(dtype) -> None:
    """Half-precision token rows: thresholds and scores in fp32 (the rows' exact upcast), gradients back in the
    inputs' dtype, through both entry points."""
    q, cols = token_case(6, 2, dtype=torch.float32, seed=2)
    hq, hc = q.to(dtype), [c.to(dtype) for c in cols]
    ref = infonce_loss_and_grad(hq.float(), [c.float() for c in hc], scale=1.0, similarity=XTR(9))
    out = infonce_loss_and_grad(hq, hc, scale=1.0, similarity=XTR(9), path="tiled", tile_size=4)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert out.grad_anchors is not None and out.grad_anchors.dtype == dtype
    torch.testing.assert_close(out.grad_anchors, ref.grad_anchors.to(dtype))
    aq = hq.clone().requires_grad_()
    loss = infonce(aq, hc, scale=1.0, similarity=XTR(9))
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.loss, rtol=1e-6, atol=1e-6)
    assert aq.grad is not None and aq.grad.dtype == dtype
    torch.testing.assert_close(aq.grad, ref.grad_anchors.to(dtype))
