"""Duplicate masks and similarity functions in the core: duplicate masks compose with every option on every path,
and any similarity function sentence-transformers accepts is exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import util

from st_cached_losses.functional import infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.terms import mnrl_terms
from tests.functional.test_terms import _slices, grads_of, st_mnrl_loss

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def masked_case(n: int, d: int = 6, seed: int = 5):
    """Pairs with false negatives (identical inputs, identical embeddings, equal keys): pairs 0 and n-1
    share a positive, pairs 1 and n-2 an anchor, the hard negative of pair n-3 is pair 0's positive."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=torch.float64)
    cols = [
        q + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(n, d, generator=g, dtype=torch.float64),
    ]
    a_keys, c_keys = torch.arange(n), [torch.arange(n) + 1000, torch.arange(n) + 2000]
    q[n - 2], a_keys[n - 2] = q[1], a_keys[1]
    cols[0][n - 1], c_keys[0][n - 1] = cols[0][0], c_keys[0][0]
    cols[1][n - 3], c_keys[1][n - 3] = cols[0][0], c_keys[0][0]
    return q, cols, a_keys, c_keys


def dense_masked_mnrl(q, cols, a_keys, c_keys, scale=20.0, alpha=3.0):
    """Four directions in one softmax, ``all_negatives`` hardness, duplicates masked: the full matrices."""
    n = q.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    qn, cn = F.normalize(q, dim=-1), [F.normalize(c, dim=-1) for c in cols]
    pair_dup = ((c_keys[0][:, None] == c_keys[0][None, :]) | (a_keys[:, None] == a_keys[None, :])) & ~eye
    dup = [pair_dup] + [c_keys[0][:, None] == k[None, :] for k in c_keys[1:]]
    blocks = []
    for k, c in enumerate(cn):  # query_to_doc with the penalty on every entry but the positive
        sim = qn @ c.T
        pen = alpha * sim.detach()
        blocks.append(
            (scale * sim + (pen.masked_fill(eye, 0.0) if k == 0 else pen)).masked_fill(dup[k], -torch.inf)
        )
    blocks.append((scale * qn @ qn.T).masked_fill(eye | pair_dup, -torch.inf))  # query_to_query
    blocks.append((scale * cn[0] @ qn.T).masked_fill(pair_dup, -torch.inf))  # doc_to_query
    blocks += [(scale * cn[0] @ c.T).masked_fill(eye | dup[k], -torch.inf) for k, c in enumerate(cn)]
    return F.cross_entropy(torch.cat(blocks, dim=1), torch.arange(n))


@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_masks_compose_with_four_directions_and_hardness(path):
    q, cols, a_keys, c_keys = masked_case(9)
    emb = [t.clone().requires_grad_() for t in (q, *cols)]
    ref = dense_masked_mnrl(*emb[:1], emb[1:], a_keys, c_keys)
    ref_grads = grads_of(ref, emb)
    unmasked = st_mnrl_loss([e.detach() for e in emb], ALL, "joint", "all_negatives")
    assert abs(float(ref) - float(unmasked)) > 1e-3, "the case must have duplicates that change the loss"
    terms = mnrl_terms(ALL, "joint", "all_negatives", 3.0, 2)
    sizes = {"chunk_size": 4} if path == "chunked" else {"tile_size": 4}
    keys = {"anchor_keys": a_keys, "candidate_keys": c_keys}
    out = infonce_loss_and_grad(q, cols, scale=20.0, terms=terms, path=path, **keys, **sizes)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-12, atol=0)
    for g, r in zip([out.grad_anchors, *out.grad_candidates], ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    ours = infonce(emb[0], emb[1:], scale=20.0, terms=terms, path=path, **keys, **sizes)
    for g, r in zip(grads_of(ours, emb), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def _masked_worker(rank: int, world: int, sizes: list[int], ring: bool):
    from st_cached_losses.functional.softmax.parallel import gathered_loss_and_grad, ring_loss_and_grad

    own = _slices(sizes)[rank]
    q, cols, a_keys, c_keys = masked_case(sum(sizes))
    strategy = ring_loss_and_grad if ring else gathered_loss_and_grad
    out = strategy(
        q[own], [c[own] for c in cols], sizes, scale=20.0, terms=mnrl_terms(ALL, "joint", "all_negatives", 3.0, 2),
        tile_size=3, path="tiled" if ring else "auto", anchor_keys=a_keys[own], candidate_keys=[k[own] for k in c_keys],
    )  # fmt: skip
    return {"loss": out.loss, "grads": [out.grad_anchors, *out.grad_candidates]}


@pytest.mark.parametrize("ring", [False, True], ids=["gather", "ring"])
@pytest.mark.parametrize("sizes", [[5, 3], [3, 2, 4]], ids=["w2", "w3"])
def test_masks_compose_across_processes_with_unequal_rows(sizes, ring):
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_masked_worker, len(sizes), sizes, ring, timeout=180)
    q, cols, a_keys, c_keys = masked_case(sum(sizes))
    emb = [t.clone().requires_grad_() for t in (q, *cols)]
    ref = dense_masked_mnrl(emb[0], emb[1:], a_keys, c_keys)
    w = len(sizes)
    assert float(sum(r["loss"] for r in per_rank)) / w == pytest.approx(float(ref.detach()), rel=1e-12)
    for k, r in enumerate(grads_of(ref, emb)):
        torch.testing.assert_close(torch.cat([p["grads"][k] for p in per_rank]) / w, r, rtol=1e-9, atol=1e-12)


SIMILARITIES = {
    "euclidean": util.euclidean_sim,
    "manhattan": util.manhattan_sim,
    "lambda": lambda a, b: torch.tanh(a @ b.T / 4),
}


@pytest.mark.parametrize("name", list(SIMILARITIES))
@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize("directions", [("query_to_doc",), ("query_to_doc", "doc_to_query")])
def test_any_similarity_function_equals_sentence_transformers(name, path, directions):
    fn = SIMILARITIES[name]
    emb = [e.requires_grad_() for e in (torch.randn(7, 5, dtype=torch.float64) for _ in range(3))]
    ref = st_mnrl_loss(emb, directions, "per_direction", None, scale=2.0, similarity=fn)
    ref_grads = grads_of(ref, emb)
    terms = mnrl_terms(directions, "per_direction", None, 0.0, 2)
    sizes = {"chunk_size": 3} if path == "chunked" else {"tile_size": 3}
    ours = infonce(emb[0], emb[1:], scale=2.0, similarity=fn, terms=terms, path=path, **sizes)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=0)
    for g, r in zip(grads_of(ours, emb), ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["euclidean", "manhattan", "lambda"])
def test_losses_take_any_similarity_function_like_sentence_transformers(name):
    """Through the loss class and the cache: loss and parameter gradients equal sentence-transformers'
    MultipleNegativesRankingLoss with the same function."""
    import tempfile
    from pathlib import Path

    from sentence_transformers.sentence_transformer import losses as st_losses

    from st_cached_losses import CachedMNRLoss
    from tests.losses.test_losses import assert_grads_close, columns, param_grads
    from tests.support.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "bert")
    fn = SIMILARITIES[name]
    feats = columns(model, 2, seed=13)
    ref_loss, ref = param_grads(
        model, lambda f: st_losses.MultipleNegativesRankingLoss(model, 5.0, fn)(f, None), feats
    )
    ours_loss, ours = param_grads(
        model, lambda f: CachedMNRLoss(model, 5.0, fn, mini_batch_size=3)(f, None), feats
    )
    assert float(ours_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


def _positive_keys_worker(rank: int, world: int, sizes: list[int], ring: bool):
    from st_cached_losses.functional.softmax.parallel import gathered_loss_and_grad, ring_loss_and_grad

    own = _slices(sizes)[rank]
    q, cols, _, c_keys = masked_case(sum(sizes))
    strategy = ring_loss_and_grad if ring else gathered_loss_and_grad
    out = strategy(
        q[own], [c[own] for c in cols], sizes, scale=20.0, tile_size=3, path="tiled" if ring else "auto",
        candidate_keys=[k[own] for k in c_keys],
    )  # fmt: skip
    return {"loss": out.loss, "grads": [out.grad_anchors, *out.grad_candidates]}


@pytest.mark.parametrize("ring", [False, True], ids=["gather", "ring"])
def test_candidate_keys_without_anchor_keys_mask_on_every_path(ring):
    """``candidate_keys`` alone (pairs compared by their positives) masks across processes on the gathered
    path as on the ring and on one process (the gathered path used to drop the keys)."""
    from tests.support.dist_utils import run_distributed

    sizes = [5, 3]
    per_rank = run_distributed(_positive_keys_worker, len(sizes), sizes, ring, timeout=180)
    q, cols, _, c_keys = masked_case(sum(sizes))
    one = infonce_loss_and_grad(q, cols, scale=20.0, candidate_keys=c_keys)
    unmasked = infonce_loss_and_grad(q, cols, scale=20.0)
    assert abs(float(one.loss) - float(unmasked.loss)) > 1e-3, "vacuous: the keys mask nothing"
    w = len(sizes)
    assert float(sum(r["loss"] for r in per_rank)) / w == pytest.approx(float(one.loss), rel=1e-12)
    for k, r in enumerate([one.grad_anchors, *one.grad_candidates]):
        torch.testing.assert_close(torch.cat([p["grads"][k] for p in per_rank]) / w, r, rtol=1e-9, atol=1e-12)
