"""The listwise distillation kernel (``st_cached_losses.functional.distill.listwise``) against the dense float64
reference (``reference_listwise_kl``): values and gradients wrt the student's anchors and candidates, tiles that
do not divide the batch, B = 1, scales 1 to 100 (the teacher's softmax underflowing), cosines near 1, teacher
and student of different widths; fp64 gradcheck; the pointwise kernel against autograd."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses.functional.distill.embed import embed_distill_loss_and_grad
from st_cached_losses.functional.distill.listwise import listwise_kl_loss_and_grad, listwise_tile_size
from tests.support.reference import reference_listwise_kl


def _rows(b: int, d: int, seed: int, near: float = 0.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=dtype)
    if near:  # rows close to one direction: cosines near 1
        x = torch.randn(1, d, generator=g, dtype=dtype) + (1 - near) * x
    return x


def _case(b: int, n_cols: int, d_s: int, d_t: int, seed: int, near: float = 0.0, dtype=torch.float64):
    q = _rows(b, d_s, seed, near, dtype)
    c = _rows(b * n_cols, d_s, seed + 1, near, dtype)
    u = _rows(b, d_t, seed + 2, near, dtype)
    v = _rows(b * n_cols, d_t, seed + 3, near, dtype)
    return q, c, u, v


def _reference(q, c, u, v, scale, teacher_scale):
    q64 = q.detach().double().requires_grad_()
    c64 = c.detach().double().requires_grad_()
    loss = reference_listwise_kl(q64, c64, u.double(), v.double(), scale=scale, teacher_scale=teacher_scale)
    gq, gc = torch.autograd.grad(loss, [q64, c64])
    return loss.detach(), gq, gc


@pytest.mark.parametrize(("b", "n_cols"), [(1, 1), (1, 3), (5, 1), (13, 2)])
@pytest.mark.parametrize("tile", [1, 3, 4, 1024])
@pytest.mark.parametrize(("scale", "teacher_scale"), [(1.0, 1.0), (20.0, 50.0), (100.0, 100.0)])
def test_matches_the_dense_reference_in_float64(b, n_cols, tile, scale, teacher_scale):
    q, c, u, v = _case(b, n_cols, 8, 6, seed=b * 10 + n_cols)
    ref_loss, ref_q, ref_c = _reference(q, c, u, v, scale, teacher_scale)
    out = listwise_kl_loss_and_grad(q, c, u, v, scale=scale, teacher_scale=teacher_scale, tile_size=tile)
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    if b * n_cols > 1:
        assert ref_q.abs().max() > 0, "vacuous: zero reference gradient"
    torch.testing.assert_close(out.grad_anchors, ref_q, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(out.grad_candidates, ref_c, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("tile", [2, 7, 64])
@pytest.mark.parametrize("near", [0.0, 0.999])
def test_float32_against_float64(tile, near):
    """fp32 inputs at scale 100, the teacher at 100 (its softmax underflows for most candidates): the loss and
    gradients within 1e-5 (relative to the largest entry) of the float64 reference; with cosines near 1, where
    the fp32 inputs' own rounding moves the logits, no worse than twice the naive fp32 computation's error."""
    q, c, u, v = _case(11, 3, 16, 24, seed=3, near=near, dtype=torch.float32)
    ref_loss, ref_q, ref_c = _reference(q, c, u, v, 100.0, 100.0)
    out = listwise_kl_loss_and_grad(q, c, u, v, scale=100.0, teacher_scale=100.0, tile_size=tile)
    assert out.grad_anchors.dtype == torch.float32
    got = (out.loss.double(), out.grad_anchors.double(), out.grad_candidates.double())
    refs = (ref_loss, ref_q, ref_c)
    if not near:
        for a, r in zip(got, refs):
            assert r.abs().max() > 0
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())
        return
    q32, c32 = q.clone().requires_grad_(), c.clone().requires_grad_()
    naive = reference_listwise_kl(q32, c32, u, v, scale=100.0, teacher_scale=100.0)
    naive_q, naive_c = torch.autograd.grad(naive, [q32, c32])
    for a, n, r in zip(got, (naive.detach(), naive_q, naive_c), refs):
        ours_err = float((a - r).abs().max())
        naive_err = float((n.double() - r).abs().max())
        assert ours_err <= 2 * naive_err + 1e-7 * r.abs().max().item(), (ours_err, naive_err)


def test_equal_teacher_and_student_give_zero():
    """A student whose similarities are the teacher's (same rows, same scale) has KL 0 and gradient 0."""
    q, c, _, _ = _case(6, 2, 8, 8, seed=1)
    out = listwise_kl_loss_and_grad(q, c, q * 3.0, c * 0.5, scale=20.0, teacher_scale=20.0, tile_size=4)
    assert abs(float(out.loss)) < 1e-10
    assert out.grad_anchors.abs().max() < 1e-10 and out.grad_candidates.abs().max() < 1e-10


def test_gradcheck():
    q, c, u, v = _case(3, 2, 4, 5, seed=9)
    q.requires_grad_()
    c.requires_grad_()

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            out = listwise_kl_loss_and_grad(a, b, u, v, scale=5.0, teacher_scale=3.0, tile_size=2)
            ctx.save_for_backward(out.grad_anchors, out.grad_candidates)
            return out.loss.double()

        @staticmethod
        def backward(ctx, g):
            ga, gb = ctx.saved_tensors
            return g * ga, g * gb

    # the loss's gradient is exact: compare with finite differences of the loss itself
    assert torch.autograd.gradcheck(_Fn.apply, (q, c), eps=1e-6, atol=1e-6)


def test_without_grad_and_the_row_weight():
    q, c, u, v = _case(5, 2, 8, 6, seed=4)
    full = listwise_kl_loss_and_grad(q, c, u, v, scale=20.0, teacher_scale=20.0, tile_size=3)
    no_grad = listwise_kl_loss_and_grad(
        q, c, u, v, scale=20.0, teacher_scale=20.0, tile_size=3, with_grad=False
    )
    assert no_grad.grad_anchors is None and torch.equal(no_grad.loss, full.loss)
    weighted = listwise_kl_loss_and_grad(
        q, c, u, v, scale=20.0, teacher_scale=20.0, row_weight=0.5, tile_size=3
    )
    torch.testing.assert_close(weighted.loss, full.loss * 2.5)
    torch.testing.assert_close(weighted.grad_candidates, full.grad_candidates * 2.5)


def test_tile_size_from_the_budget():
    assert (
        listwise_tile_size(64 * 2**20) == 1672
        and listwise_tile_size(1) == 1
        and listwise_tile_size(2**40) == 2048
    )


@pytest.mark.parametrize("metric", ["cosine", "l2", "mse"])
@pytest.mark.parametrize("projection", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_pointwise_matches_autograd(metric, projection, chunk):
    """The pointwise kernel against the plain formula with autograd, two columns, chunks that do not divide
    the rows, in float64."""
    g = torch.Generator().manual_seed(0)
    students = [torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    d_t = 4 if projection else 5
    teachers = [torch.randn(7, d_t, generator=g, dtype=torch.float64) for _ in range(2)]
    weight = torch.randn(d_t, 5, generator=g, dtype=torch.float64, requires_grad=True) if projection else None
    bias = torch.randn(d_t, generator=g, dtype=torch.float64, requires_grad=True) if projection else None
    losses = []
    for s, t in zip(students, teachers):
        p = torch.nn.functional.linear(s, weight, bias) if projection else s
        if metric == "mse":
            losses.append(torch.nn.functional.mse_loss(p, t))
        elif metric == "l2":
            losses.append(torch.norm(p - t, dim=-1).mean())
        else:
            losses.append((1 - torch.nn.functional.cosine_similarity(p, t, dim=-1)).mean())
    ref = torch.stack(losses).mean()
    wrt = [*students, *((weight, bias) if projection else ())]
    ref_grads = torch.autograd.grad(ref, wrt)
    out = embed_distill_loss_and_grad(students, teachers, metric, weight=weight, bias=bias, chunk_rows=chunk)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-6, atol=1e-9)
    got = [*out.grads, *((out.grad_weight, out.grad_bias) if projection else ())]
    for a, r in zip(got, ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)


def test_memory_is_rows_plus_one_tile_not_the_matrix():
    """The peak of live tensor bytes (a dispatch mode, deterministic) is the rows' copies, gradients and one
    tile's blocks: at B = 1024 anchors against C = 2048 candidates with 128-wide tiles it stays under a third of
    one dense B x C fp32 matrix (the dense loss holds several), and from B = 256 to 1024 it grows about as the
    rows (x4), far from B x C (x16)."""
    from tests.support.memory import PeakMemory

    def peak(b: int) -> int:
        q, c, u, v = _case(b, 2, 16, 24, seed=b, dtype=torch.float32)
        with PeakMemory() as meter:
            listwise_kl_loss_and_grad(q, c, u, v, scale=20.0, teacher_scale=20.0, tile_size=128)
        return meter.peak_bytes

    small, large = peak(256), peak(1024)
    dense = 1024 * 2048 * 4
    assert large < dense / 3, (large, dense)
    assert large < 5 * small, (small, large)
