"""The functional core against the naive dense reference: values and gradients for every path and
entry point over generated shapes, gradcheck, bf16, overflow safety, memory bounds, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from st_cached_losses.functional import infonce, infonce_loss_and_grad
from st_cached_losses.memory import PeakMemory
from tests.reference import reference_infonce, reference_infonce_blockwise_float64


def make_inputs(b, n_rank, d, n_neg, rank, symmetric, seed, dtype=torch.float32):
    """Anchors (b, d) of one rank out of n_rank; gathered candidate columns (n_rank * b, d)."""
    g = torch.Generator().manual_seed(seed)
    n = n_rank * b
    anchors_all = torch.randn(n, d, generator=g, dtype=torch.float64)
    positives = anchors_all + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)
    cols = [positives] + [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(n_neg)]
    off = rank * b
    anchors = anchors_all[off : off + b]
    to = lambda t: t.to(dtype).clone().requires_grad_()  # noqa: E731
    inputs = {
        "anchors": to(anchors),
        "candidates": [to(c) for c in cols],
        "anchors_all": to(anchors_all) if symmetric and n_rank > 1 else None,
        "row_offset": off,
    }
    return inputs


def leaves(inputs, scale):
    out = [inputs["anchors"], *inputs["candidates"]]
    if inputs["anchors_all"] is not None:
        out.append(inputs["anchors_all"])
    if isinstance(scale, torch.Tensor):
        out.append(scale)
    return out


def reference_value_and_grads(inputs, scale, similarity, symmetric, dtype=torch.float64):
    """The dense reference in ``dtype`` from the same values."""
    ref_in = {
        k: (v.detach().to(dtype).requires_grad_() if isinstance(v, torch.Tensor) else v)
        for k, v in inputs.items()
    }
    ref_in["candidates"] = [c.detach().to(dtype).requires_grad_() for c in inputs["candidates"]]
    s = scale.detach().to(dtype).requires_grad_() if isinstance(scale, torch.Tensor) else scale
    loss = reference_infonce(**ref_in, scale=s, similarity=similarity, symmetric=symmetric)
    grads = torch.autograd.grad(loss, leaves(ref_in, s))
    return loss.detach(), grads


def assert_close_global(ours, ref, rtol, allow_zero=False, naive=None, atol=0.0):
    """One tolerance over the whole vector, relative to its largest entry. Where fp32 itself cannot
    reach ``rtol`` (a saturated softmax makes every gradient tiny next to the O(scale) logits it comes
    from), being within 4x of the naive fp32 computation's own error (``naive``) or within ``atol``
    (the rounding of those logits) is accepted."""
    ours, ref = ours.double().flatten(), ref.double().flatten()
    scale = ref.abs().max().item()
    if allow_zero and scale == 0:
        assert ours.abs().max().item() < 1e-6
        return
    assert scale > 0, "vacuous comparison: the reference is zero"
    err = (ours - ref).abs().max().item()
    floor = 4 * (naive.double().flatten() - ref).abs().max().item() if naive is not None else 0.0
    floor = max(floor, atol)
    assert err <= max(rtol * scale, floor), (
        f"max error {err:.3e} > {rtol:.1e} x {scale:.3e} (naive fp32: {floor / 4:.3e})"
    )


CASES = st.fixed_dictionaries(
    {
        "b": st.integers(1, 13),
        "n_rank": st.integers(1, 3),
        "d": st.integers(2, 9),  # cosine in 1-D has zero gradient everywhere
        "n_neg": st.integers(0, 3),
        "scale": st.floats(1.0, 100.0),
        "similarity": st.sampled_from(["cosine", "dot"]),
        "symmetric": st.booleans(),
        "path": st.sampled_from(["chunked", "tiled", "auto"]),
        "block": st.integers(1, 7),
        "learnable": st.booleans(),
        "fused": st.booleans(),
        "seed": st.integers(0, 10_000),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_values_and_gradients_match_reference(case):
    symmetric = case["symmetric"]
    n_rank = case["n_rank"]
    rank = case["seed"] % n_rank
    inputs = make_inputs(case["b"], n_rank, case["d"], case["n_neg"], rank, symmetric, case["seed"])
    # dot products of random vectors with large scales are huge: keep the logits in a sane range
    scale_value = case["scale"] if case["similarity"] == "cosine" else case["scale"] / (10 * case["d"])
    scale = torch.tensor(scale_value, requires_grad=True) if case["learnable"] else scale_value
    kwargs = {
        "scale": scale,
        "similarity": case["similarity"],
        "symmetric": symmetric,
        "path": case["path"],
        "chunk_size": case["block"] if case["path"] == "chunked" else None,
        "tile_size": case["block"] if case["path"] == "tiled" else None,
        **inputs,
    }
    ref_loss, ref_grads = reference_value_and_grads(inputs, scale, case["similarity"], symmetric)
    _, naive_grads = reference_value_and_grads(inputs, scale, case["similarity"], symmetric, torch.float32)
    if case["fused"]:
        out = infonce_loss_and_grad(**kwargs)
        loss = out.loss
        grads = [out.grad_anchors, *out.grad_candidates]
        if inputs["anchors_all"] is not None:
            grads.append(out.grad_anchors_all)
        if case["learnable"]:
            grads.append(out.grad_scale)
        else:
            assert out.grad_scale is None
    else:
        loss = infonce(**kwargs)
        grads = torch.autograd.grad(loss, leaves(inputs, scale))
    assert loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-5)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and g.shape == r.shape
    magnitude = scale_value
    if case["similarity"] == "dot":
        norms = [t.detach().norm(dim=1).max() for t in [inputs["anchors"], *inputs["candidates"]]]
        magnitude = scale_value * float(max(norms)) ** 2
    # a single candidate in all (one row, no negatives) has loss 0 and zero gradients
    single = case["b"] * n_rank * (1 + case["n_neg"]) == 1
    assert_close_global(
        torch.cat([g.flatten() for g in grads]),
        torch.cat([r.flatten() for r in ref_grads]),
        1e-5,
        allow_zero=single,
        naive=torch.cat([r.flatten() for r in naive_grads]),
        # fp32 rounding of logits of size up to `magnitude`, in a mean over b rows
        atol=8 * 2**-24 * max(magnitude, 1.0) / case["b"],
    )


@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
def test_gradcheck_float64(path, symmetric, gathered):
    inputs = make_inputs(
        3, 2 if gathered else 1, 4, 1, 1 if gathered else 0, symmetric, seed=1, dtype=torch.float64
    )
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    names = ["anchors", "candidates0", "candidates1"] + (
        ["anchors_all"] if inputs["anchors_all"] is not None else []
    )

    def fn(*args):
        a, c0, c1, *rest = args[:-1]
        return infonce(
            a,
            [c0, c1],
            scale=args[-1],
            symmetric=symmetric,
            anchors_all=rest[0] if rest else None,
            row_offset=inputs["row_offset"],
            path=path,
            chunk_size=2 if path == "chunked" else None,
            tile_size=2 if path == "tiled" else None,
        )

    args = [inputs["anchors"], *inputs["candidates"]]
    if len(names) == 4:
        args.append(inputs["anchors_all"])
    assert torch.autograd.gradcheck(fn, (*args, scale), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_bf16_error_no_worse_than_twice_naive(path, symmetric):
    inputs32 = make_inputs(64, 1, 32, 1, 0, symmetric, seed=5)
    inputs16 = {
        "anchors": inputs32["anchors"].detach().bfloat16().requires_grad_(),
        "candidates": [c.detach().bfloat16().requires_grad_() for c in inputs32["candidates"]],
        "anchors_all": None,
        "row_offset": 0,
    }
    exact = {
        "anchors": inputs16["anchors"].detach().double().requires_grad_(),
        "candidates": [c.detach().double().requires_grad_() for c in inputs16["candidates"]],
        "anchors_all": None,
        "row_offset": 0,
    }
    true_loss = reference_infonce(**exact, scale=20.0, symmetric=symmetric)
    true_grads = torch.autograd.grad(true_loss, leaves(exact, 20.0))
    naive_loss = reference_infonce(**inputs16, scale=20.0, symmetric=symmetric)
    naive_grads = torch.autograd.grad(naive_loss, leaves(inputs16, 20.0))
    ours_loss = infonce(**inputs16, scale=20.0, symmetric=symmetric, path=path, chunk_size=16, tile_size=16)
    ours_grads = torch.autograd.grad(ours_loss, leaves(inputs16, 20.0))
    assert all(g.dtype == torch.bfloat16 for g in ours_grads)

    def err(gs):
        return max((g.double() - t).abs().max().item() for g, t in zip(gs, true_grads))

    assert abs(ours_loss.double() - true_loss).item() <= max(
        2 * abs(naive_loss.double() - true_loss).item(), 1e-6
    )
    assert err(ours_grads) <= 2 * err(naive_grads)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_grad_output_scales_gradients(fused, path):
    inputs = make_inputs(7, 1, 5, 2, 0, True, seed=3)
    scale = torch.tensor(15.0, requires_grad=True)
    kwargs = {**inputs, "scale": scale, "symmetric": True, "path": path, "chunk_size": 3, "tile_size": 3}
    if path == "chunked":
        kwargs.pop("tile_size")
    else:
        kwargs.pop("chunk_size")
    if fused:
        one = infonce_loss_and_grad(**kwargs)
        many = infonce_loss_and_grad(**kwargs, grad_output=3.7)
        for a, b in zip(
            [one.grad_anchors, *one.grad_candidates, one.grad_scale],
            [many.grad_anchors, *many.grad_candidates, many.grad_scale],
        ):
            torch.testing.assert_close(b, 3.7 * a, rtol=1e-5, atol=1e-7)
        assert float(one.loss) == pytest.approx(float(many.loss))
    else:
        g1 = torch.autograd.grad(infonce(**kwargs), leaves(inputs, scale))
        g2 = torch.autograd.grad(infonce(**kwargs) * 3.7, leaves(inputs, scale))
        for a, b in zip(g1, g2):
            torch.testing.assert_close(b, 3.7 * a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_finite_at_scale_100_with_cosines_near_one(path, symmetric):
    b, d = 256, 64
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(d, generator=g)
    # every pair of embeddings has cosine >= 0.999
    anchors = direction + 0.02 * torch.randn(b, d, generator=g)
    positives = direction + 0.02 * torch.randn(b, d, generator=g)
    cos = torch.nn.functional.normalize(anchors, dim=1) @ torch.nn.functional.normalize(positives, dim=1).T
    assert cos.min() > 0.999
    # the naive computation without max-subtraction (Inf-CL's torch path) overflows in fp32 here
    logits = 100.0 * cos
    naive = torch.log(torch.exp(logits).sum(1)) - logits.diagonal()
    assert not torch.isfinite(naive).all()
    a, p = anchors.clone().requires_grad_(), positives.clone().requires_grad_()
    loss = infonce(a, p, scale=100.0, symmetric=symmetric, path=path, chunk_size=64, tile_size=64)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all() and torch.isfinite(p.grad).all()
    exact = reference_infonce(anchors.double(), positives.double(), scale=100.0, symmetric=symmetric)
    assert float(loss) == pytest.approx(float(exact), rel=1e-5)


def test_equals_blockwise_float64_reference_at_moderate_batch():
    g = torch.Generator().manual_seed(2)
    anchors = torch.randn(3000, 16, generator=g)
    positives = anchors + torch.randn(3000, 16, generator=g)
    out = infonce_loss_and_grad(anchors, positives, symmetric=True, path="tiled", tile_size=512)
    exact = reference_infonce_blockwise_float64(anchors, positives, symmetric=True, block=700)
    assert float(out.loss) == pytest.approx(exact, rel=1e-5)
    assert math.isfinite(exact) and exact > 0


def test_tiled_memory_is_far_below_dense_logits():
    b, d = 2048, 32
    anchors, positives = torch.randn(b, d), torch.randn(b, d)
    with PeakMemory() as mem:
        infonce_loss_and_grad(anchors, positives, symmetric=True, path="tiled", tile_size=128)
    dense = b * b * 4
    assert mem.peak_bytes < dense / 8, f"{mem.peak_bytes} bytes"
    # the peak is the returned gradients, the normalisation vectors and a handful of tiles
    assert mem.peak_bytes < 2 * b * d * 4 + 8 * 128 * 128 * 4 + 16 * b * 4 + 4 * b * d * 4


def test_chunked_memory_is_bounded_by_its_chunk():
    b, d, chunk = 2048, 32, 64
    anchors, positives = torch.randn(b, d), torch.randn(b, d)
    with PeakMemory() as mem:
        infonce_loss_and_grad(anchors, positives, path="chunked", chunk_size=chunk)
    assert mem.peak_bytes < 3 * chunk * b * 4 + 8 * b * d * 4
    assert mem.peak_bytes < b * b * 4 / 4


BAD = [
    ("mismatched embedding dims", lambda: ((torch.randn(4, 8), torch.randn(4, 7)), {}), "embedding dim"),
    (
        "columns of different lengths",
        lambda: ((torch.randn(4, 8), [torch.randn(4, 8), torch.randn(5, 8)]), {}),
        "rows but the positives have",
    ),
    ("empty batch", lambda: ((torch.randn(0, 8), torch.randn(0, 8)), {}), "empty"),
    (
        "offset out of range",
        lambda: ((torch.randn(4, 8), torch.randn(8, 8)), {"row_offset": 5}),
        "row_offset",
    ),
    ("negative offset", lambda: ((torch.randn(4, 8), torch.randn(8, 8)), {"row_offset": -1}), "row_offset"),
    ("nan", lambda: ((torch.full((4, 8), float("nan")), torch.randn(4, 8)), {}), "NaN or inf"),
    ("inf", lambda: ((torch.randn(4, 8), torch.full((4, 8), float("inf"))), {}), "NaN or inf"),
    ("zero scale", lambda: ((torch.randn(4, 8), torch.randn(4, 8)), {"scale": 0.0}), "scale"),
    ("negative scale", lambda: ((torch.randn(4, 8), torch.randn(4, 8)), {"scale": -1.0}), "scale"),
    (
        "tensor scale",
        lambda: ((torch.randn(4, 8), torch.randn(4, 8)), {"scale": torch.tensor(-2.0)}),
        "scale",
    ),
    ("zero chunk", lambda: ((torch.randn(4, 8), torch.randn(4, 8)), {"chunk_size": 0}), "chunk_size"),
    ("negative tile", lambda: ((torch.randn(4, 8), torch.randn(4, 8)), {"tile_size": -2}), "tile_size"),
    (
        "symmetric without anchors_all",
        lambda: ((torch.randn(4, 8), torch.randn(8, 8)), {"symmetric": True}),
        "anchors_all",
    ),
    ("bad similarity", lambda: ((torch.randn(4, 8), torch.randn(4, 8)), {"similarity": "l2"}), "similarity"),
]


@pytest.mark.parametrize("entry", [infonce, infonce_loss_and_grad], ids=["autograd", "fused"])
@pytest.mark.parametrize(("name", "make", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error_naming_the_fix(entry, name, make, match):
    args, kwargs = make()
    with pytest.raises(ValueError, match=match) as info:
        entry(*args, **kwargs)
    assert len(str(info.value)) > 40, "the message must say what to do, not only what is wrong"
