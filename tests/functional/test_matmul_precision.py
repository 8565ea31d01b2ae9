"""``matmul_precision`` on the torch path (CPU): "highest" is the exact path bit for bit, "medium" (bf16
operands, fp32 sums and statistics) stays within the issue's bounds against float64 on the bf16-rounded
embeddings, the default follows torch's global setting, and the losses that keep fp32 products keep them."""

from __future__ import annotations

import contextlib

import pytest
import torch

from st_cached_losses.functional import InfoNCEOptions, infonce, infonce_loss_and_grad
from st_cached_losses.functional.precision import Products, global_matmul_precision
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.sigmoid.loss import SigmoidOptions, sigmoid_loss_and_grad
from st_cached_losses.functional.softmax.terms import mnrl_terms
from tests.support.reference import reference_infonce, reference_sigmoid


@contextlib.contextmanager
def torch_precision(name: str):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(name)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _emb(b: int, d: int, k: int = 2, seed: int = 0, near: float = 1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    cols = [q + near * torch.randn(b, d, generator=g) for _ in range(k)]
    return q.to(dtype), [c.to(dtype) for c in cols]


def _solve(q, cols, **kw):
    out = infonce_loss_and_grad(q, cols, **kw)
    return out.loss, [out.grad_anchors, *out.grad_candidates], out.grad_scale


def _float64(q, cols, scale, symmetric):
    """The loss and gradients in float64 on the embeddings as given (bf16 ones: their values exactly)."""
    q64 = q.double().requires_grad_()
    c64 = [c.double().requires_grad_() for c in cols]
    s = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    loss = reference_infonce(q64, c64, scale=s, symmetric=symmetric)
    grads = torch.autograd.grad(loss, [q64, *c64, s])
    return float(loss), list(grads[:-1]), float(grads[-1])


CASES = [
    pytest.param({}, id="one"),
    pytest.param({"symmetric": True}, id="sym"),
    pytest.param({"path": "tiled", "tile_size": 96}, id="one-tiled"),
    pytest.param({"symmetric": True, "path": "tiled", "tile_size": 96}, id="sym-tiled"),
]


@pytest.mark.parametrize("kw", CASES)
def test_highest_is_the_exact_path_bit_for_bit(kw):
    """Explicit "highest" runs the code path the default ran before the setting existed (torch's global
    precision "highest"), bit for bit, also when torch's global setting says otherwise."""
    q, cols = _emb(300, 48)
    scale = torch.tensor(20.0, requires_grad=True)
    base = _solve(q, cols, scale=scale, **kw)
    for ours in (
        _solve(q, cols, scale=scale, matmul_precision="highest", **kw),
        _solve(q, cols, scale=scale, matmul_precision="high", **kw),  # no TF32 on a CPU: fp32
    ):
        assert torch.equal(ours[0], base[0]) and torch.equal(ours[2], base[2])
        for a, b in zip(ours[1], base[1]):
            assert torch.equal(a, b)
    with torch_precision("medium"):
        pinned = _solve(q, cols, scale=scale, matmul_precision="highest", **kw)
    assert torch.equal(pinned[0], base[0]) and all(torch.equal(a, b) for a, b in zip(pinned[1], base[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["one", "sym"])
def test_medium_within_the_bounds_at_2048(dtype, symmetric):
    """B = 2,048, d = 384: the loss within 1e-3 relative and every gradient entry within 2e-2 of the
    largest, against float64 on the embeddings rounded to bf16 (the issue's bounds); not the fp32 result
    (the products really are bf16's), and no gradient is zero."""
    q, cols = _emb(2048, 384, k=1, near=3.0)  # the loss stage benchmark's data: a loss near 3
    q, cols = q.to(torch.bfloat16).to(dtype), [c.to(torch.bfloat16).to(dtype) for c in cols]
    scale = torch.tensor(20.0, requires_grad=True)
    loss, grads, g_s = _solve(q, cols, scale=scale, symmetric=symmetric,
                              matmul_precision="medium")  # fmt: skip
    ref_loss, ref_grads, ref_s = _float64(q, cols, 20.0, symmetric)
    assert abs(float(loss) - ref_loss) <= 1e-3 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert float(r.abs().max()) > 0
        assert float((g.double() - r).abs().max()) <= 2e-2 * float(r.abs().max())
    assert float(g_s) == pytest.approx(ref_s, rel=2e-2, abs=2e-2 * abs(ref_s))
    exact = _solve(q, cols, scale=20.0, symmetric=symmetric, matmul_precision="highest")
    assert not torch.equal(grads[0], exact[1][0])


@pytest.mark.parametrize(
    ("b", "scale", "near", "kw", "tol"),
    [
        (1, 20.0, 1.0, {}, (5e-3, 2e-2)),
        (5, 20.0, 1.0, {"symmetric": True, "path": "tiled", "tile_size": 2}, (5e-3, 2e-2)),
        (37, 20.0, 1.0, {"symmetric": True, "path": "tiled", "tile_size": 16}, (5e-3, 2e-2)),
        # cosines near 1 at scale 100: a bf16 operand moves a logit by up to ~scale * 2^-8, so the
        # bounds are looser; what matters here is that nothing overflows or turns NaN
        (37, 100.0, 0.05, {}, (2e-2, 0.2)),
        (37, 100.0, 0.05, {"symmetric": True}, (2e-2, 0.2)),
    ],
)
def test_medium_small_shapes(b, scale, near, kw, tol):
    """Uneven tiles, B = 1, scale 100 with cosines near 1: finite, and near float64. Few rows (nothing
    averages a logit's rounding out) and d = 64 (a bf16 rounding of a normalised row weighs more than at
    384) make the loss's bound 5e-3 here, against 1e-3 at B = 2,048, d = 384."""
    q, cols = _emb(b, 64, k=2, near=near, seed=b)
    q, cols = q.to(torch.bfloat16), [c.to(torch.bfloat16) for c in cols]
    loss, grads, _ = _solve(q, cols, scale=scale, matmul_precision="medium", **kw)
    ref_loss, ref_grads, _ = _float64(q, cols, scale, kw.get("symmetric", False))
    assert torch.isfinite(loss)
    assert abs(float(loss) - ref_loss) <= tol[0] * max(abs(ref_loss), 1e-3)
    top = max(float(r.abs().max()) for r in ref_grads)
    assert top > 0
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert float((g.double() - r).abs().max()) <= tol[1] * top


def test_autograd_entry_point_follows_the_setting():
    q, cols = _emb(64, 32)
    leaves = [x.clone().requires_grad_() for x in (q, *cols)]
    loss = infonce(leaves[0], leaves[1:], scale=20.0, symmetric=True, matmul_precision="medium")
    grads = torch.autograd.grad(loss, leaves)
    direct = _solve(q, cols, scale=20.0, symmetric=True, matmul_precision="medium")
    torch.testing.assert_close(loss, direct[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, direct[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_default_reads_torchs_global_setting():
    q, cols = _emb(48, 32)
    with torch_precision("medium"):
        assert global_matmul_precision("cpu") == "medium"
        default = _solve(q, cols, scale=20.0)
    medium = _solve(q, cols, scale=20.0, matmul_precision="medium")
    assert torch.equal(default[1][0], medium[1][0])


def _products(q, cols, **kw) -> Products:
    opts = InfoNCEOptions(matmul_precision="medium", **kw)
    return opts.spec(q, cols, Score(opts.similarity)).score.products


def test_the_losses_that_keep_fp32_products():
    q, cols = _emb(8, 16)
    assert _products(q, cols).precision == "medium"
    keys = [torch.arange(8)] * 2
    assert _products(q, cols, anchor_keys=torch.arange(8), candidate_keys=keys).precision == "highest"
    penalised = mnrl_terms(("query_to_doc",), "joint", "all_negatives", 0.5, 2)
    assert _products(q, cols, terms=penalised).precision == "highest"
    assert _products(q, cols, similarity=lambda a, c: a @ c.T).precision == "highest"
    assert _products(q.double(), [c.double() for c in cols]).precision == "highest"
    # a removed diagonal (query_to_query) keeps bf16 products on the torch tiles, not the kernels
    q2q = mnrl_terms(("query_to_doc", "query_to_query"), "joint", None, 0.0, 2)
    assert _products(q, cols, terms=q2q) == Products("medium", kernels=False)


def test_a_wrong_precision_is_refused():
    with pytest.raises(ValueError, match="matmul_precision must be"):
        InfoNCEOptions(matmul_precision="low")  # type: ignore[arg-type]


def _ring_worker(rank, world_size, sizes, symmetric, ring):
    import torch.distributed as dist

    from st_cached_losses.functional.softmax.parallel import gathered_loss_and_grad, ring_loss_and_grad

    assert dist.get_world_size() == len(sizes)
    r = dist.get_rank()
    own = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    q, cols = _emb(sum(sizes), 32)
    strategy = ring_loss_and_grad if ring else gathered_loss_and_grad
    out = strategy(
        q[own], [c[own] for c in cols], sizes, scale=20.0, symmetric=symmetric, tile_size=5,
        path="tiled" if ring else "auto", matmul_precision="medium",
    )  # fmt: skip
    return {"loss": out.loss, "grads": [out.grad_anchors, *out.grad_candidates]}


@pytest.mark.parametrize("ring", [False, True], ids=["gather", "ring"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["one", "sym"])
def test_across_processes_medium_equals_one_process(symmetric, ring):
    """Gathered and ring at "medium": the operands are rounded row by row as on one process, so the shares'
    mean loss and gradients are the one-process "medium" ones up to the order of fp32 sums; except the
    gathered symmetric loss, which scores its two directions in tiles of their own where one process (and
    the ring) shares them, so that each direction's probabilities are rounded to bf16 apart (bf16 noise)."""
    from tests.support.dist_utils import run_distributed

    sizes = [7, 4]
    per_rank = run_distributed(_ring_worker, len(sizes), sizes, symmetric, ring, timeout=180)
    q, cols = _emb(sum(sizes), 32)
    loss, grads, _ = _solve(q, cols, scale=20.0, symmetric=symmetric, matmul_precision="medium")
    w = len(sizes)
    assert float(sum(p["loss"] for p in per_rank)) / w == pytest.approx(float(loss), rel=1e-5)
    for k, g in enumerate(grads):
        ours = torch.cat([p["grads"][k] for p in per_rank]) / w
        noise = 1e-2 if symmetric and not ring else 1e-5
        torch.testing.assert_close(ours, g, rtol=0, atol=noise * float(g.abs().max()))


# --------------------------------------------------------------------------- the sigmoid loss (issue 58)


def _sigmoid(q, cols, **kw):
    out = sigmoid_loss_and_grad(q, cols, **kw)
    return out.loss, [out.grad_anchors, *out.grad_candidates], out.grad_scale, out.grad_bias


SIGMOID_CASES = [
    pytest.param({}, id="chunked"),
    pytest.param({"path": "tiled", "tile_size": 96}, id="tiled"),
    pytest.param({"similarity": "dot", "scale": 0.05, "bias": -2.0}, id="dot"),
]


@pytest.mark.parametrize("kw", SIGMOID_CASES)
def test_sigmoid_highest_is_the_exact_path_bit_for_bit(kw):
    """The sigmoid loss's "highest" (and "high" on a CPU) is the path its default took under torch's global
    "highest", bit for bit, also when torch's global setting is "medium" (before issue 58 the setting was not
    read and the products followed the global setting, which on a CPU with bf16 support rounds them)."""
    q, cols = _emb(300, 48)
    kw = {
        "scale": torch.tensor(10.0, requires_grad=True),
        "bias": torch.tensor(-10.0, requires_grad=True),
        **kw,
    }
    with torch_precision("highest"):
        base = _sigmoid(q, cols, **kw)
    with torch_precision("medium"):
        runs = [_sigmoid(q, cols, matmul_precision=p, **kw) for p in ("highest", "high")]
    for ours in runs:
        assert torch.equal(ours[0], base[0])
        assert all(torch.equal(a, b) for a, b in zip(ours[1], base[1]))
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ours[2:], base[2:]))


def _sigmoid_float64(q, cols, scale, bias, similarity="cosine"):
    q64 = q.double().requires_grad_()
    c64 = [c.double().requires_grad_() for c in cols]
    s = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    b = torch.tensor(float(bias), dtype=torch.float64, requires_grad=True)
    loss = reference_sigmoid(q64, c64, scale=s, bias=b, similarity=similarity)
    grads = torch.autograd.grad(loss, [q64, *c64, s, b])
    return float(loss.detach()), list(grads[:-2]), float(grads[-2]), float(grads[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_sigmoid_medium_rounds_its_products_like_bf16(dtype, path):
    """B = 1,024, d = 384, cosine, SigLIP's scale 10 and bias -10 (and a looser batch, bias -3): "medium"
    is not the fp32 result (the products are bf16's): its gradients are off float64's by bf16's rounding (above
    1e-3 and within 2e-2 of the largest entry; fp32 products: below 1e-5), its loss within 1e-3 relative
    (more than ten times fp32's error), the scale's and bias's gradients within 2e-2, in the embeddings'
    dtype."""
    q, cols = _emb(1024, 384, k=2, near=3.0)
    q, cols = q.to(torch.bfloat16).to(dtype), [c.to(torch.bfloat16).to(dtype) for c in cols]
    for scale, bias in ((10.0, -10.0), (10.0, -3.0)):
        s = torch.tensor(scale, requires_grad=True)
        b = torch.tensor(bias, requires_grad=True)
        loss, grads, g_s, g_b = _sigmoid(q, cols, scale=s, bias=b, path=path, matmul_precision="medium")
        exact = _sigmoid(q, cols, scale=s, bias=b, path=path, matmul_precision="highest")
        ref_loss, ref_grads, ref_s, ref_b = _sigmoid_float64(q, cols, scale, bias)
        exact_error = abs(float(exact[0]) - ref_loss) / abs(ref_loss)
        medium_error = abs(float(loss) - ref_loss) / abs(ref_loss)
        assert exact_error <= 1e-6 and 10 * exact_error < medium_error <= 1e-3, (exact_error, medium_error)
        assert not torch.equal(grads[0], exact[1][0]) and not torch.equal(loss, exact[0])
        for g, e, r in zip(grads, exact[1], ref_grads):
            assert g.dtype == dtype and float(r.abs().max()) > 0
            # bf16's rounding (2^-8 of a product) against fp32's: measured 4e-3 to 5e-3, and 1e-6 (bf16
            # embeddings get their gradients in bf16: the exact path's rounded too)
            worst = float((g.double() - r).abs().max() / r.abs().max())
            exact_worst = float((e.double() - r).abs().max() / r.abs().max())
            assert 1e-3 < worst <= 2e-2 and exact_worst < (1e-5 if dtype == torch.float32 else 4e-3), worst
        assert float(g_s) == pytest.approx(ref_s, rel=2e-2, abs=2e-2 * abs(ref_s))
        assert float(g_b) == pytest.approx(ref_b, rel=2e-2, abs=2e-2 * abs(ref_b))


def test_sigmoid_products_follow_the_setting_and_the_global_default():
    q, cols = _emb(8, 16)
    assert SigmoidOptions(matmul_precision="medium").products(q) == Products("medium")
    assert SigmoidOptions(matmul_precision="high").products(q) == Products()  # no TF32 on a CPU
    assert SigmoidOptions(matmul_precision="medium").products(q.double()) == Products()
    assert (
        SigmoidOptions(similarity=lambda a, c: a @ c.T, matmul_precision="medium").products(q) == Products()
    )
    with torch_precision("medium"):
        assert SigmoidOptions().products(q) == Products("medium")
        default = _sigmoid(q, cols)
    assert torch.equal(default[0], _sigmoid(q, cols, matmul_precision="medium")[0])
    with pytest.raises(ValueError, match="matmul_precision"):
        SigmoidOptions(matmul_precision="bf16")
