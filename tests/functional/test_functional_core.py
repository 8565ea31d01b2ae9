"""The functional core against the naive dense reference: values and gradients for every path and
entry point over generated shapes, gradcheck, bf16, overflow safety, memory bounds, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from st_cached_losses.functional import infonce, infonce_loss_and_grad
from tests.support.memory import PeakMemory
from tests.support.reference import reference_infonce, reference_infonce_blockwise_float64


def on(device, x):
    """``x`` (a tensor, or tuples / lists / dicts of them) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(on(device, v) for v in x)
    if isinstance(x, dict):
        return {k: on(device, v) for k, v in x.items()}
    return x


def make_inputs(b, n_rank, d, n_neg, rank, symmetric, seed, dtype=torch.float32, device="cpu"):
    """Anchors (b, d) of one rank out of n_rank; gathered candidate columns (n_rank * b, d), on
    ``device`` (drawn on the CPU: the same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    n = n_rank * b
    anchors_all = torch.randn(n, d, generator=g, dtype=torch.float64)
    positives = anchors_all + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)
    cols = [positives] + [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(n_neg)]
    off = rank * b
    anchors = anchors_all[off : off + b]
    to = lambda t: t.to(device=device, dtype=dtype).clone().requires_grad_()  # noqa: E731
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
def test_values_and_gradients_match_reference(device, case):
    symmetric = case["symmetric"]
    n_rank = case["n_rank"]
    rank = case["seed"] % n_rank
    inputs = make_inputs(
        case["b"], n_rank, case["d"], case["n_neg"], rank, symmetric, case["seed"], device=device
    )
    # dot products of random vectors with large scales are huge: keep the logits in a sane range
    scale_value = case["scale"] if case["similarity"] == "cosine" else case["scale"] / (10 * case["d"])
    scale = torch.tensor(scale_value, requires_grad=True, device=device) if case["learnable"] else scale_value
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
    magnitude = scale_value
    if case["similarity"] == "dot":
        norms = [t.detach().norm(dim=1).max() for t in [inputs["anchors"], *inputs["candidates"]]]
        magnitude = scale_value * float(max(norms)) ** 2
    assert loss.dtype == torch.float32
    # a loss is never negative (a saturated row's positive may round above its log-sum-exp: it counts 0);
    # its error is the fp32 rounding of logits of size up to `magnitude`
    assert float(loss.detach()) >= 0.0
    assert float(loss.detach()) == pytest.approx(
        float(ref_loss), rel=1e-5, abs=max(1e-5, 8 * 2**-24 * magnitude)
    )
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and g.shape == r.shape
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
def test_gradcheck_float64(path, symmetric, gathered, device):
    inputs = make_inputs(
        3,
        2 if gathered else 1,
        4,
        1,
        1 if gathered else 0,
        symmetric,
        seed=1,
        dtype=torch.float64,
        device=device,
    )
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True, device=device)
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
def test_bf16_error_no_worse_than_twice_naive(path, symmetric, device):
    inputs32 = make_inputs(64, 1, 32, 1, 0, symmetric, seed=5, device=device)
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
def test_grad_output_scales_gradients(fused, path, device):
    inputs = make_inputs(7, 1, 5, 2, 0, True, seed=3, device=device)
    scale = torch.tensor(15.0, requires_grad=True, device=device)
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
def test_finite_at_scale_100_with_cosines_near_one(path, symmetric, device):
    b, d = 256, 64
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(d, generator=g)
    # every pair of embeddings has cosine >= 0.999
    anchors = (direction + 0.02 * torch.randn(b, d, generator=g)).to(device)
    positives = (direction + 0.02 * torch.randn(b, d, generator=g)).to(device)
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


def test_equals_blockwise_float64_reference_at_moderate_batch(device):
    g = torch.Generator().manual_seed(2)
    anchors = torch.randn(3000, 16, generator=g)
    positives = anchors + torch.randn(3000, 16, generator=g)
    anchors, positives = anchors.to(device), positives.to(device)
    out = infonce_loss_and_grad(anchors, positives, symmetric=True, path="tiled", tile_size=512)
    exact = reference_infonce_blockwise_float64(anchors, positives, symmetric=True, block=700)
    assert float(out.loss) == pytest.approx(exact, rel=1e-5)
    assert math.isfinite(exact) and exact > 0


# The CUDA caching allocator rounds every block up to 512 bytes and reduction kernels take scratch
# space the dispatcher does not see: its peak may exceed the live tensor bytes by this much.
CUDA_ALLOCATOR_SLACK = 128 * 2**10


def peaks(device, fn):
    """Peak bytes of ``fn()``: live tensor bytes (the dispatcher's count, any device); on CUDA also the
    caching allocator's peak (``torch.cuda.max_memory_allocated``) less ``CUDA_ALLOCATOR_SLACK``, after
    a warm-up call that allocates the libraries' one-off workspaces."""
    if device != "cpu":
        fn()
    with PeakMemory(device) as mem:
        fn()
    if mem.cuda_peak_bytes is None:
        return [mem.peak_bytes]
    return [mem.peak_bytes, mem.cuda_peak_bytes - CUDA_ALLOCATOR_SLACK]


def test_tiled_memory_is_far_below_dense_logits(device):
    b, d = 2048, 32
    anchors, positives = torch.randn(b, d).to(device), torch.randn(b, d).to(device)
    dense = b * b * 4
    for peak in peaks(
        device, lambda: infonce_loss_and_grad(anchors, positives, symmetric=True, path="tiled", tile_size=128)
    ):
        assert peak < dense / 8, f"{peak} bytes"
        # the peak is the returned gradients, the normalisation vectors and a handful of tiles
        assert peak < 2 * b * d * 4 + 8 * 128 * 128 * 4 + 16 * b * 4 + 4 * b * d * 4


def test_chunked_memory_is_bounded_by_its_chunk(device):
    b, d, chunk = 2048, 32, 64
    anchors, positives = torch.randn(b, d).to(device), torch.randn(b, d).to(device)
    for peak in peaks(
        device, lambda: infonce_loss_and_grad(anchors, positives, path="chunked", chunk_size=chunk)
    ):
        assert peak < 3 * chunk * b * 4 + 8 * b * d * 4
        assert peak < b * b * 4 / 4


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
def test_bad_input_raises_value_error_naming_the_fix(entry, name, make, match, device):
    args, kwargs = on(device, make())
    with pytest.raises(ValueError, match=match) as info:
        entry(*args, **kwargs)
    assert len(str(info.value)) > 40, "the message must say what to do, not only what is wrong"


# --------------------------------------------------------------------------- duplicate masking
#
# Pairs i != j sharing an anchor or a positive are duplicates, in both directions: positive j is not a
# negative of anchor i, and (symmetric) anchor j is not a negative of positive i. A hard negative equal
# to a row's positive is not one of its negatives either.


def duplicate_case(n_rank: int, n_neg: int, b: int = 4, d: int = 6, seed: int = 3, device="cpu"):
    """Global float64 pairs and keys with false negatives, across ranks when ``n_rank > 1``: pairs 0 and
    N-1 share a positive, pairs 1 and N-2 share an anchor, a hard negative of pair N-3 repeats pair 0's
    positive. Identical inputs have identical embeddings, as from an encoder. Drawn on the CPU, returned
    on ``device``."""
    g = torch.Generator().manual_seed(seed)
    n = n_rank * b
    anchors = torch.randn(n, d, generator=g, dtype=torch.float64)
    a_keys = torch.arange(n)
    anchors[n - 2], a_keys[n - 2] = anchors[1], a_keys[1]
    # each positive near its anchor: a duplicate anchor's two positives are both close to it
    cols = [anchors + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)]
    cols += [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(n_neg)]
    c_keys = [torch.arange(n) + 1000 * (k + 1) for k in range(1 + n_neg)]
    cols[0][n - 1], c_keys[0][n - 1] = cols[0][0], c_keys[0][0]
    if n_neg:
        cols[1][n - 3], c_keys[1][n - 3] = cols[0][0], c_keys[0][0]
    return on(device, (anchors, cols, a_keys, c_keys))


def rank_problem(anchors, cols, a_keys, c_keys, n_rank, rank, symmetric):
    """One rank's arguments (fresh float64 leaves) for the core and the reference."""
    b = anchors.shape[0] // n_rank
    off = rank * b
    gathered = n_rank > 1
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    kwargs = {
        "anchors": leaf(anchors[off : off + b]),
        "candidates": [leaf(c) for c in cols],
        "anchors_all": leaf(anchors) if symmetric and gathered else None,
        "row_offset": off,
        "anchor_keys": a_keys[off : off + b],
        "candidate_keys": c_keys,
        "anchors_all_keys": a_keys if gathered else None,
    }
    return kwargs


def _grads_of(kwargs, loss, scale):
    out = [kwargs["anchors"], *kwargs["candidates"], scale]
    if kwargs["anchors_all"] is not None:
        out.append(kwargs["anchors_all"])
    return torch.autograd.grad(loss, out)


@pytest.mark.parametrize("entry", ["autograd", "fused"])
@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("n_rank", "rank"), [(1, 0), (2, 0), (2, 1)], ids=["one", "gathered0", "gathered1"])
@pytest.mark.parametrize("n_neg", [0, 1])
def test_duplicates_masked_in_both_directions_match_reference(
    entry, path, symmetric, n_rank, rank, n_neg, device
):
    data = duplicate_case(n_rank, n_neg, device=device)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True, device=device)
    ref_kwargs = rank_problem(*data, n_rank, rank, symmetric)
    ref_loss = reference_infonce(**ref_kwargs, scale=scale, symmetric=symmetric)
    ref_grads = _grads_of(ref_kwargs, ref_loss, scale)
    kwargs = rank_problem(*data, n_rank, rank, symmetric)
    # blocks of 3 split the 4 rows and 4 or 8 candidates unevenly: masks cross tile borders
    sizes = {"chunk_size": 3} if path == "chunked" else {"tile_size": 3}
    core = dict(kwargs, scale=scale, symmetric=symmetric, path=path, **sizes)
    if entry == "fused":
        out = infonce_loss_and_grad(**core)
        loss = out.loss
        grads = [out.grad_anchors, *out.grad_candidates, out.grad_scale]
        if out.grad_anchors_all is not None:
            grads.append(out.grad_anchors_all)
    else:
        loss = infonce(**core)
        grads = _grads_of(kwargs, loss, scale)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-12)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("n_rank", "rank"), [(1, 0), (2, 0), (2, 1)], ids=["one", "gathered0", "gathered1"])
def test_duplicate_masking_changes_each_direction(symmetric, n_rank, rank, device):
    """Non-vacuous: each clause of the rule moves the loss. The row direction masks the positive of a
    pair with the same anchor (not only candidates equal to the row's positive); the symmetric
    direction masks the anchor of a pair with the same positive (not only equal anchors)."""
    anchors, cols, a_keys, c_keys = duplicate_case(n_rank, 1, device=device)
    kw = rank_problem(anchors, cols, a_keys, c_keys, n_rank, rank, symmetric)
    masked = float(infonce(**kw, symmetric=symmetric, scale=7.0, path="tiled", tile_size=3))
    plain = {k: v for k, v in kw.items() if "keys" not in k}
    assert masked != pytest.approx(
        float(reference_infonce(**plain, symmetric=symmetric, scale=7.0)), abs=1e-3
    )
    if not symmetric:
        # the positives' keys alone leave duplicate anchors' positives among the negatives
        pos_only = dict(plain, candidate_keys=c_keys)
        assert masked != pytest.approx(float(reference_infonce(**pos_only, scale=7.0)), abs=1e-3)
        return
    # the anchor -> candidates direction masked, positive -> anchors left alone: the loss before the fix
    b = kw["anchors"].shape[0]
    off = kw["row_offset"]
    forward = reference_infonce(**{k: v for k, v in kw.items() if k != "anchors_all"}, scale=7.0)
    backward = reference_infonce(cols[0][off : off + b], [anchors], row_offset=off, scale=7.0)
    assert masked != pytest.approx(float((forward + backward) / 2), abs=1e-3)


def test_shared_positive_rule_spelled_out(device):
    """Rows 0 and 1 share a positive, by hand: row 0 does not see d0_1, row 1 not d0_0,
    positive 0 does not see anchor 1 and positive 1 not anchor 0; nothing else is masked."""
    g = torch.Generator().manual_seed(5)
    q = torch.nn.functional.normalize(torch.randn(4, 8, generator=g, dtype=torch.float64), dim=1)
    p = torch.nn.functional.normalize(q + torch.randn(4, 8, generator=g, dtype=torch.float64), dim=1)
    p[1] = p[0]
    s = 5.0
    a_keys, p_keys = torch.arange(4), torch.tensor([10, 10, 12, 13])
    logits = s * q @ p.T
    drop = {(0, 1), (1, 0)}
    keep = lambda i: [j for j in range(4) if (i, j) not in drop]  # noqa: E731
    fwd = [torch.logsumexp(logits[i, keep(i)], 0) - logits[i, i] for i in range(4)]
    bwd = [torch.logsumexp(logits[keep(i), i], 0) - logits[i, i] for i in range(4)]
    expected = float(sum(fwd) + sum(bwd)) / 8
    q, p, a_keys, p_keys = on(device, (q, p, a_keys, p_keys))
    for path in ("chunked", "tiled"):
        out = infonce_loss_and_grad(
            q, p, scale=s, symmetric=True, path=path, anchor_keys=a_keys, candidate_keys=[p_keys]
        )
        assert float(out.loss) == pytest.approx(expected, rel=1e-12)
    ref = reference_infonce(q, p, scale=s, symmetric=True, anchor_keys=a_keys, candidate_keys=[p_keys])
    assert float(ref) == pytest.approx(expected, rel=1e-12)


def test_gathered_anchor_keys_need_every_positives_anchor():
    anchors, cols, a_keys, c_keys = duplicate_case(2, 0)
    with pytest.raises(ValueError, match="anchors_all_keys"):
        infonce(anchors[4:], cols, row_offset=4, anchor_keys=a_keys[4:], candidate_keys=c_keys)


@pytest.mark.parametrize("symmetric", [False, True])
def test_ring_masks_duplicates_like_reference_one_process(symmetric, device):
    """The ring's own-block path (no process group: one visit) under the same rule."""
    from st_cached_losses.functional.softmax.parallel import ring_loss_and_grad

    anchors, cols, a_keys, c_keys = duplicate_case(1, 1, device=device)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True, device=device)
    kw = rank_problem(anchors, cols, a_keys, c_keys, 1, 0, symmetric)
    ref_loss = reference_infonce(**kw, scale=scale, symmetric=symmetric)
    ref_grads = _grads_of(kw, ref_loss, scale)
    b = anchors.shape[0]
    out = ring_loss_and_grad(
        anchors, cols, [b], scale=scale, symmetric=symmetric, tile_size=3, memory_budget=2**20,
        anchor_keys=a_keys, candidate_keys=c_keys,
    )  # fmt: skip
    assert float(out.loss) == pytest.approx(float(ref_loss), rel=1e-12)
    for g, r in zip([out.grad_anchors, *out.grad_candidates, out.grad_scale], ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def _ring_duplicates_worker(rank: int, world: int, symmetric: bool):
    from st_cached_losses.functional.softmax.parallel import ring_loss_and_grad

    anchors, cols, a_keys, c_keys = duplicate_case(world, 1)
    b = anchors.shape[0] // world
    own = slice(rank * b, (rank + 1) * b)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    out = ring_loss_and_grad(
        anchors[own], [c[own] for c in cols], [b] * world, scale=scale, symmetric=symmetric,
        tile_size=3, memory_budget=2**20, anchor_keys=a_keys[own], candidate_keys=[k[own] for k in c_keys],
    )  # fmt: skip
    return {
        "loss": out.loss,
        "anchors": out.grad_anchors,
        "cols": out.grad_candidates,
        "scale": out.grad_scale,
    }


@pytest.mark.parametrize("symmetric", [False, True])
def test_ring_masks_duplicates_across_processes(symmetric):
    """Two gloo processes; every duplicate of :func:`duplicate_case` spans the two ranks, so only the
    keys that travel around the ring can mask them."""
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_ring_duplicates_worker, 2, symmetric)
    # weight W / B_global as in the losses: the processes' losses and gradients sum to W times the
    # global ones (DDP averages them), the scale's gradient is already averaged
    anchors, cols, a_keys, c_keys = duplicate_case(2, 1)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    kw = rank_problem(anchors, cols, a_keys, c_keys, 1, 0, symmetric)  # the whole batch at once
    ref_loss = reference_infonce(**kw, scale=scale, symmetric=symmetric)
    ref_grads = _grads_of(kw, ref_loss, scale)
    assert float(sum(r["loss"] for r in per_rank)) / 2 == pytest.approx(float(ref_loss), rel=1e-12)
    ours = [
        torch.cat([r["anchors"] for r in per_rank]) / 2,
        *[torch.cat([r["cols"][k] for r in per_rank]) / 2 for k in range(len(cols))],
        per_rank[0]["scale"],
    ]
    assert len(ours) == len(ref_grads)
    for g, r in zip(ours, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    unmasked = reference_infonce(anchors, cols, scale=7.0, symmetric=symmetric)
    assert float(ref_loss) != pytest.approx(float(unmasked), abs=1e-3)


# --------------------------------------------------------------------------- autograd memory
#
# ``infonce`` saves the raw inputs (references) and O(B + N) statistics; backward renormalises the
# inputs and recomputes the logit tiles. Nothing derived from the embeddings (the chunked path's
# normalised fp32 copy of every matrix) may outlive the forward.

AUTOGRAD_PATHS = [("chunked", {"chunk_size": 32}), ("tiled", {"tile_size": 64})]


@pytest.mark.parametrize(("path", "sizes"), AUTOGRAD_PATHS, ids=[p for p, _ in AUTOGRAD_PATHS])
@pytest.mark.parametrize("symmetric", [False, True])
def test_autograd_memory_is_inputs_plus_lse_between_passes_and_bounded_by_blocks(path, sizes, symmetric):
    b, d, n_neg = 512, 32, 1
    g = torch.Generator().manual_seed(0)
    anchors = torch.randn(b, d, generator=g, requires_grad=True)
    cols = [torch.randn(b, d, generator=g, requires_grad=True) for _ in range(1 + n_neg)]
    with PeakMemory() as mem:
        loss = infonce(anchors, cols, symmetric=symmetric, path=path, **sizes)
        between = mem.live
        grads = torch.autograd.grad(loss, [anchors, *cols])
    assert all(gr.abs().max() > 0 for gr in grads)
    # held by the graph: positive logits (B,), row LSE as max and log-sum (2B), column LSE (2N) for the
    # symmetric loss, and the 0-d loss -- not one (B, d) matrix
    assert between <= 4 * (3 * b + (2 * b if symmetric else 0)) + 64, f"{between} bytes between passes"
    inputs = (1 + len(cols)) * b * d * 4
    dense = b * len(cols) * b * 4
    # three fp32 logit blocks, as the planner counts them: (chunk, K * N) or (tile, tile)
    block = sizes["chunk_size"] * len(cols) * b * 4 if path == "chunked" else sizes["tile_size"] ** 2 * 4
    # backward: the returned gradients, a normalised copy and fp32 gradients of every input, the blocks
    assert mem.peak_bytes <= 3 * inputs + 3 * block + 64 * (b + len(cols) * b), f"{mem.peak_bytes} bytes"
    assert mem.peak_bytes < dense / 2


def test_autograd_saves_nothing_without_grad():
    anchors, positives = torch.randn(256, 16), torch.randn(256, 16)
    with PeakMemory() as mem:
        loss = infonce(anchors, positives, symmetric=True, path="chunked", chunk_size=32)
        assert loss.grad_fn is None
        assert mem.live <= 64, f"{mem.live} bytes kept with the loss"
