"""Packed sparse rows (:mod:`st_cached_losses.functional.representations.sparse`): exact round trip, ``SparseDot`` against
the dense dot product (values, gradients on the kept entries, gradcheck), the core on packed rows against
the core on dense rows (chunked and tiled, blocks not dividing the batch), and the FLOPS regulariser from
packed rows against the dense one."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses.functional import infonce_loss_and_grad
from st_cached_losses.functional.representations.flops import flops_loss_and_grad
from st_cached_losses.functional.representations.sparse import (
    SparseDot,
    dense_rows,
    kept,
    pack_rows,
    scatter_columns,
)

V = 97


def sparse_rows(n: int, nnz: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """``(n, V)`` non-negative rows with varying numbers of non-zero entries (one row all zero)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, V, dtype=dtype)
    for i in range(n):
        k = int(torch.randint(0, nnz + 1, (1,), generator=gen)) if i else 0
        cols = torch.randperm(V, generator=gen)[:k]
        x[i, cols] = torch.rand(k, generator=gen, dtype=dtype) + 0.05
    return x


def test_pack_and_dense_rows_round_trip_exactly():
    x = sparse_rows(9, 12, seed=0)
    packed = pack_rows(x)
    assert packed.shape == (9, int((x != 0).sum(1).max()), 2)
    assert torch.equal(dense_rows(packed, V), x)
    assert torch.equal(kept(packed).sum(1), (x != 0).sum(1))
    idx = packed[..., 0]
    assert torch.equal(idx, idx.long().to(idx.dtype))  # integral indices
    torch.testing.assert_close(scatter_columns(packed, V), x.sum(0))
    w = torch.rand(9)
    torch.testing.assert_close(scatter_columns(packed, V, w), w @ x)
    assert pack_rows(torch.zeros(3, V)).shape == (3, 1, 2)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        pack_rows(torch.zeros(2, 3, 4))


def test_sparse_dot_values_and_gradients():
    a, c = sparse_rows(6, 20, seed=1, dtype=torch.float64), sparse_rows(8, 30, seed=2, dtype=torch.float64)
    pa, pc = pack_rows(a), pack_rows(c)
    f = SparseDot(V)
    s = f(pa, pc)
    torch.testing.assert_close(s, a @ c.T)
    g = torch.randn_like(s)
    ga, gc = f.vjp(g, pa, pc, True, True)
    ad, cd = a.clone().requires_grad_(), c.clone().requires_grad_()
    (ad @ cd.T).backward(g)
    # the gradient of each kept entry: the dense gradient on the non-zero entries
    assert ga.shape == pa.shape and gc.shape == pc.shape
    torch.testing.assert_close(dense_rows(pa, V, ga[..., 1]), ad.grad * (a != 0))
    torch.testing.assert_close(dense_rows(pc, V, gc[..., 1]), cd.grad * (c != 0))
    assert (ga[..., 0] == 0).all() and (gc[..., 0] == 0).all()
    assert (ga[..., 1][~kept(pa)] == 0).all()  # padding has none
    assert f.vjp(g, pa, pc, False, True)[0] is None and f.vjp(g, pa, pc, True, False)[1] is None
    torch.testing.assert_close(f.pairwise(pa, pack_rows(c[:6])), (a * c[:6]).sum(1))


@pytest.mark.parametrize(
    "options",
    [
        {"path": "chunked", "chunk_size": 4},
        {"path": "tiled", "tile_size": 3},
        {"path": "auto"},
        {"path": "tiled", "tile_size": 5, "symmetric": True},
        {"path": "chunked", "chunk_size": 7, "symmetric": True},
    ],
    ids=["chunked", "tiled", "auto", "tiled-symmetric", "chunked-symmetric"],
)
def test_core_on_packed_rows_equals_dense_dot(options):
    b = 11
    anchors = sparse_rows(b, 25, seed=3)
    cols = [sparse_rows(b, 25, seed=4 + k) for k in range(2)]
    dense = infonce_loss_and_grad(anchors, cols, scale=2.0, similarity="dot", **options)
    packed = [pack_rows(x) for x in (anchors, *cols)]
    got = infonce_loss_and_grad(packed[0], packed[1:], scale=2.0, similarity=SparseDot(V), **options)
    torch.testing.assert_close(got.loss, dense.loss, rtol=1e-5, atol=1e-7)
    want = [dense.grad_anchors, *dense.grad_candidates]
    for p, g, w, x in zip(packed, [got.grad_anchors, *got.grad_candidates], want, (anchors, *cols)):
        assert g.shape == p.shape
        assert w.abs().max() > 0
        torch.testing.assert_close(dense_rows(p, V, g[..., 1]), w * (x != 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threshold", [None, 6])
def test_flops_from_packed_rows(threshold):
    blocks = [sparse_rows(n, 15, seed=10 + n, dtype=torch.float64) for n in (5, 1, 7)]
    dense = flops_loss_and_grad(blocks, threshold, grad_output=0.3)
    packed = [pack_rows(b) for b in blocks]
    got = flops_loss_and_grad(packed, threshold, grad_output=0.3, dim=V)
    torch.testing.assert_close(got.loss, dense.loss)
    for p, g, w, b in zip(packed, got.grads, dense.grads, blocks):
        assert g.shape == p.shape
        torch.testing.assert_close(dense_rows(p, V, g[..., 1]), w * (b != 0))
    into = [torch.zeros_like(p) for p in packed]
    flops_loss_and_grad(packed, threshold, grad_output=0.3, dim=V, accumulate=into)
    for g, w in zip(into, got.grads):
        torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="dim"):
        flops_loss_and_grad(packed, threshold)
