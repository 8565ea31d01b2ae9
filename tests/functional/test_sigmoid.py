"""The sigmoid (SigLIP) loss of the functional core against the naive dense reference, on one process: values
and every gradient (anchors, each candidate column, scale, bias) for every path and both entry points over
generated shapes, gradcheck, bf16, large scales, the learnable scale through its log, memory bounds, bad
input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from st_cached_losses.functional import SigmoidOptions, sigmoid_loss, sigmoid_loss_and_grad
from tests.support.memory import PeakMemory
from tests.support.reference import reference_sigmoid


def _embeddings(n: int, d: int, k: int, seed: int, bank: int = 0, spread: float = 0.7):
    """``n`` anchors, ``k`` candidate columns (positives near the anchors, then hard negatives) and ``bank``
    bank rows, float64."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randn(n, d, generator=g, dtype=torch.float64)
    cols = [anchors + spread * torch.randn(n, d, generator=g, dtype=torch.float64)]
    cols += [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(k - 1)]
    return anchors, cols, torch.randn(bank, d, generator=g, dtype=torch.float64) if bank else None


def _reference(anchors, cols, scale, bias, dtype=torch.float64, **kwargs):
    """The dense reference's loss and gradients (anchors, each column, then scale and bias), in ``dtype``."""
    leaves = [
        anchors.detach().to(dtype).requires_grad_(),
        *(c.detach().to(dtype).requires_grad_() for c in cols),
    ]
    s = torch.tensor(float(scale), dtype=dtype, requires_grad=True)
    b = torch.tensor(float(bias), dtype=dtype, requires_grad=True)
    bank = kwargs.pop("bank", None)
    loss = reference_sigmoid(
        leaves[0], leaves[1:], scale=s, bias=b, bank=bank.to(dtype) if bank is not None else None, **kwargs
    )
    return loss.detach(), torch.autograd.grad(loss, [*leaves, s, b])


def assert_close_global(ours, ref, rtol, naive=None, atol=0.0):
    """One tolerance over the whole vector, relative to its largest entry (or within 4x of the naive fp32
    computation's own error, or ``atol``); the reference must not be zero (no vacuous pass)."""
    ours, ref = ours.double().flatten(), ref.double().flatten()
    top = ref.abs().max().item()
    assert top > 0, "vacuous comparison: the reference is zero"
    err = (ours - ref).abs().max().item()
    floor = max(4 * (naive.double().flatten() - ref).abs().max().item() if naive is not None else 0.0, atol)
    assert err <= max(rtol * top, floor), f"max error {err:.3e} > {rtol:.1e} x {top:.3e} (floor {floor:.3e})"


CASES = st.fixed_dictionaries(
    {
        "b": st.integers(1, 13),
        "n_rank": st.integers(1, 3),  # columns gathered from this many "processes": N = n_rank * b
        "d": st.integers(2, 9),
        "k": st.integers(1, 4),  # positives + hard-negative columns
        "bank": st.sampled_from([0, 0, 5]),
        "scale": st.floats(1.0, 100.0),
        "bias": st.floats(-15.0, 5.0),
        "similarity": st.sampled_from(["cosine", "dot"]),
        "path": st.sampled_from(["chunked", "tiled", "auto"]),
        "block": st.integers(1, 7),
        "learnable": st.booleans(),
        "autograd": st.booleans(),
        "seed": st.integers(0, 10_000),
    }
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_values_and_gradients_match_reference(device, case):
    b, n_rank, d = case["b"], case["n_rank"], case["d"]
    anchors_all, cols64, bank64 = _embeddings(n_rank * b, d, case["k"], case["seed"], case["bank"])
    offset = (case["seed"] % n_rank) * b
    anchors64 = anchors_all[offset : offset + b]
    # dot products of random vectors are large: keep the logits in a sane range
    scale = case["scale"] if case["similarity"] == "cosine" else case["scale"] / (5 * d)
    ref_kwargs = {"similarity": case["similarity"], "row_offset": offset, "bank": bank64}
    ref_loss, ref_grads = _reference(anchors64, cols64, scale, case["bias"], **ref_kwargs)
    _, naive_grads = _reference(anchors64, cols64, scale, case["bias"], torch.float32, **ref_kwargs)

    anchors = anchors64.float().to(device).requires_grad_()
    cols = [c.float().to(device).requires_grad_() for c in cols64]
    learnable = case["learnable"]
    s = torch.tensor(scale, device=device, requires_grad=True) if learnable else scale
    bias = torch.tensor(case["bias"], device=device, requires_grad=True) if learnable else case["bias"]
    kwargs = {
        "scale": s,
        "bias": bias,
        "similarity": case["similarity"],
        "path": case["path"],
        "chunk_size": case["block"] if case["path"] == "chunked" else None,
        "tile_size": case["block"] if case["path"] == "tiled" else None,
        "row_offset": offset,
        "bank": bank64.float().to(device) if bank64 is not None else None,
    }
    if case["autograd"]:
        loss = sigmoid_loss(anchors, cols, **kwargs)
        grads = list(torch.autograd.grad(loss, [anchors, *cols, *([s, bias] if learnable else [])]))
    else:
        out = sigmoid_loss_and_grad(anchors, cols, **kwargs)
        loss, grads = out.loss, [out.grad_anchors, *out.grad_candidates]
        if learnable:
            grads += [out.grad_scale, out.grad_bias]
        else:
            assert out.grad_scale is None and out.grad_bias is None
    if not learnable:
        ref_grads, naive_grads = ref_grads[:-2], naive_grads[:-2]
    assert loss.dtype == torch.float32 and float(loss.detach()) > 0
    # the loss's error: fp32 rounding of logits of size up to |scale * sim| + |bias|
    magnitude = scale * (
        1 if case["similarity"] == "cosine" else float(max(anchors64.norm(dim=1).max(), 1)) ** 2
    )
    magnitude += abs(case["bias"])
    n_terms = len(cols64) * cols64[0].shape[0] + (bank64.shape[0] if bank64 is not None else 0)
    assert float(loss.detach()) == pytest.approx(
        float(ref_loss), rel=1e-5, abs=4 * 2**-24 * magnitude * n_terms
    )
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and g.shape == r.shape
    assert_close_global(
        torch.cat([g.flatten() for g in grads]).cpu(),
        torch.cat([r.flatten() for r in ref_grads]),
        1e-5,
        naive=torch.cat([r.flatten() for r in naive_grads]),
        # a batch whose every pair is saturated has gradients below fp32's normal range (sigmoid(-91) =
        # 3e-40): the loss stage flushes sigmoids under e^-64 (1.6e-28), and a GEMM may flush denormals
        atol=1e-25,
    )


@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_gradcheck_float64_with_the_scale_through_its_log(path, similarity, device):
    anchors_all, cols, bank = _embeddings(6, 4, 2, seed=1, bank=3)
    anchors = anchors_all[3:6].to(device).requires_grad_()  # rows 3..5 of the gathered columns
    cols = [c.to(device).requires_grad_() for c in cols]
    log_scale = torch.tensor(1.2, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, device=device, requires_grad=True)
    bank = bank.to(device)

    def fn(a, c0, c1, t, b):
        return sigmoid_loss(
            a, [c0, c1], scale=t.exp(), bias=b, similarity=similarity, row_offset=3, bank=bank, path=path,
            chunk_size=2, tile_size=2,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (anchors, *cols, log_scale, bias), eps=1e-6, atol=1e-7)


def test_log_scale_gradient_from_loss_and_grad_is_grad_scale_times_scale():
    """A caller without autograd (the loss stage) learns ``log_scale`` from ``grad_scale * scale``."""
    anchors, cols, _ = _embeddings(9, 6, 2, seed=4)
    log_scale = torch.tensor(2.3, dtype=torch.float64, requires_grad=True)
    scale = log_scale.exp()
    out = sigmoid_loss_and_grad(anchors, cols, scale=scale, bias=-5.0, chunk_size=4)
    (auto,) = torch.autograd.grad(sigmoid_loss(anchors, cols, scale=log_scale.exp(), bias=-5.0), [log_scale])
    assert out.grad_scale is not None and out.grad_bias is None  # a float bias has no gradient
    torch.testing.assert_close(out.grad_scale * scale.detach(), auto, rtol=1e-12, atol=0)
    assert float(auto) != 0.0


@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_bf16_error_no_worse_than_twice_naive(path, device):
    anchors, cols, _ = _embeddings(64, 32, 2, seed=5)
    inputs16 = [t.bfloat16().to(device).requires_grad_() for t in (anchors, *cols)]
    exact = [t.detach().double().cpu().requires_grad_() for t in inputs16]
    kwargs = {"scale": 10.0, "bias": -10.0}
    true_loss = reference_sigmoid(exact[0], exact[1:], **kwargs)
    true_grads = torch.autograd.grad(true_loss, exact)
    naive_loss = reference_sigmoid(inputs16[0], inputs16[1:], **kwargs)
    naive_grads = torch.autograd.grad(naive_loss, inputs16)
    ours = sigmoid_loss(inputs16[0], inputs16[1:], **kwargs, path=path, chunk_size=16, tile_size=16)
    ours_grads = torch.autograd.grad(ours, inputs16)
    assert ours.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in ours_grads)

    def err(gs):
        return max((g.double().cpu() - t).abs().max().item() for g, t in zip(gs, true_grads))

    naive_err = abs(naive_loss.double().cpu() - true_loss).item()
    assert abs(ours.double().cpu() - true_loss).item() <= max(2 * naive_err, 1e-6)
    assert err(ours_grads) <= 2 * err(naive_grads)
    assert max(g.abs().max().item() for g in true_grads) > 0


@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize(("scale", "bias"), [(1.0, 0.0), (10.0, -10.0), (100.0, -10.0), (100.0, -95.0)])
def test_large_scales_with_cosines_near_one(path, scale, bias, device):
    """Every cosine >= 0.999: logits up to 100, the positives' and the negatives' terms both far in the tails
    of the sigmoid. Loss and gradients (scale's and bias's too) equal float64 to 1e-5 of the largest, or
    within 4x of the naive fp32 computation's own error."""
    b, d = 96, 32
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(d, generator=g, dtype=torch.float64)
    anchors = direction + 0.02 * torch.randn(b, d, generator=g, dtype=torch.float64)
    positives = direction + 0.02 * torch.randn(b, d, generator=g, dtype=torch.float64)
    cos = torch.nn.functional.normalize(anchors, dim=1) @ torch.nn.functional.normalize(positives, dim=1).T
    assert cos.min() > 0.999
    anchors, positives = anchors.float().double(), positives.float().double()  # what fp32 inputs hold
    ref_loss, ref_grads = _reference(anchors, [positives], scale, bias)
    _, naive_grads = _reference(anchors, [positives], scale, bias, torch.float32)
    s = torch.tensor(scale, device=device, requires_grad=True)
    bb = torch.tensor(bias, device=device, requires_grad=True)
    out = sigmoid_loss_and_grad(
        anchors.float().to(device), positives.float().to(device), scale=s, bias=bb, path=path, chunk_size=40,
        tile_size=40,
    )  # fmt: skip
    assert float(out.loss) == pytest.approx(float(ref_loss), rel=1e-5)
    ours = [out.grad_anchors, out.grad_candidates[0], out.grad_scale, out.grad_bias]
    for g, ref, naive in zip(ours, ref_grads, naive_grads):
        assert torch.isfinite(g).all()
        # gradients wrt raw embeddings of cosines near 1 cancel in fp32 (g - x <g, x>): no better than naive
        assert_close_global(g.cpu(), ref, 1e-5, naive=naive)


def test_logits_below_the_flush_threshold_and_dot_products(device):
    """Dot logits far below -64 (sigmoids that would be denormal are flushed to 0) change nothing that fp32
    can see."""
    anchors, cols, _ = _embeddings(20, 8, 2, seed=9)
    ref_loss, ref_grads = _reference(anchors, cols, 8.0, -60.0, similarity="dot")
    s = torch.tensor(8.0, device=device, requires_grad=True)
    bb = torch.tensor(-60.0, device=device, requires_grad=True)
    out = sigmoid_loss_and_grad(
        anchors.float().to(device), [c.float().to(device) for c in cols], scale=s, bias=bb, similarity="dot",
        chunk_size=7,
    )  # fmt: skip
    assert float(out.loss) == pytest.approx(float(ref_loss), rel=1e-5)
    ours = [out.grad_anchors, *out.grad_candidates, out.grad_scale, out.grad_bias]
    assert_close_global(
        torch.cat([g.flatten().cpu() for g in ours]), torch.cat([r.flatten() for r in ref_grads]), 1e-5
    )


def test_a_similarity_function_is_scored_through_autograd():
    def neg_distance(a, c):
        return -torch.cdist(a, c)

    anchors, cols, bank = _embeddings(7, 5, 2, seed=3, bank=4)
    ref_loss, ref_grads = _reference(anchors, cols, 2.0, 3.0, similarity=neg_distance, bank=bank)
    s = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    bb = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    for path in ("chunked", "tiled"):
        out = sigmoid_loss_and_grad(
            anchors,
            cols,
            scale=s,
            bias=bb,
            similarity=neg_distance,
            bank=bank,
            path=path,
            chunk_size=3,
            tile_size=3,
        )
        torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=0)
        for ours, ref in zip(
            [out.grad_anchors, *out.grad_candidates, out.grad_scale, out.grad_bias], ref_grads
        ):
            torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("autograd", [False, True])
def test_grad_output_scales_every_gradient(autograd):
    anchors, cols, _ = _embeddings(7, 5, 3, seed=3)
    anchors = anchors.requires_grad_()
    s = torch.tensor(15.0, dtype=torch.float64, requires_grad=True)
    bb = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    kwargs = {"scale": s, "bias": bb, "chunk_size": 3}
    if autograd:
        one = torch.autograd.grad(sigmoid_loss(anchors, cols, **kwargs), [anchors, s, bb])
        many = torch.autograd.grad(sigmoid_loss(anchors, cols, **kwargs) * 3.7, [anchors, s, bb])
    else:
        o1 = sigmoid_loss_and_grad(anchors, cols, **kwargs)
        o2 = sigmoid_loss_and_grad(anchors, cols, **kwargs, grad_output=3.7)
        assert float(o1.loss) == float(o2.loss)
        one = (o1.grad_anchors, *o1.grad_candidates, o1.grad_scale, o1.grad_bias)
        many = (o2.grad_anchors, *o2.grad_candidates, o2.grad_scale, o2.grad_bias)
    for a, b in zip(one, many):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, 3.7 * a, rtol=1e-12, atol=1e-15)


def test_loss_only_paths_compute_no_gradient():
    anchors, cols, _ = _embeddings(5, 4, 2, seed=2)
    ref = reference_sigmoid(anchors, cols)
    out = sigmoid_loss_and_grad(anchors, cols, with_grad=False)
    assert out.grad_anchors is None and out.grad_candidates == [] and out.grad_scale is None
    torch.testing.assert_close(out.loss, ref)
    with torch.no_grad():
        loss = sigmoid_loss(anchors.requires_grad_(), cols, scale=torch.tensor(10.0, requires_grad=True))
    assert not loss.requires_grad and loss.grad_fn is None
    torch.testing.assert_close(loss, ref)


def test_options_object_and_keywords_agree():
    anchors, cols, _ = _embeddings(6, 4, 1, seed=8)
    options = SigmoidOptions(scale=5.0, bias=-2.0, path="tiled", tile_size=4)
    a = sigmoid_loss_and_grad(anchors, cols, options)
    b = sigmoid_loss_and_grad(anchors, cols, options, bias=-3.0)
    c = sigmoid_loss_and_grad(anchors, cols, scale=5.0, bias=-3.0)
    assert float(a.loss) == pytest.approx(
        float(reference_sigmoid(anchors, cols, scale=5.0, bias=-2.0)), rel=1e-12
    )
    assert float(b.loss) == pytest.approx(float(c.loss), rel=1e-12)
    with pytest.raises(TypeError, match="SigmoidOptions"):
        sigmoid_loss_and_grad(anchors, cols, {"scale": 5.0})  # type: ignore[arg-type]


def peak_bytes(fn) -> int:
    with PeakMemory() as mem:
        fn()
    return mem.peak_bytes


@pytest.mark.parametrize(("path", "block"), [("chunked", 32), ("tiled", 256)])
@pytest.mark.parametrize("b", [512, 2048])
def test_memory_is_the_embeddings_plus_two_blocks(path, block, b):
    """Never the B x C matrix: the returned gradients, fp32 normalised copies of the rows and of the column
    being scored (chunked only) and the norms, plus two blocks (the logits and their softplus / sigmoid); so,
    beyond O((B + C) d), flat in B."""
    d = 16
    anchors, positives = torch.randn(b, d), torch.randn(b, d)
    peak = peak_bytes(
        lambda: sigmoid_loss_and_grad(anchors, positives, path=path, chunk_size=block, tile_size=block)
    )
    n_block = block * (b if path == "chunked" else block)  # a chunk spans a whole column
    copies = 2 if path == "chunked" else 0
    if b >= 2048:  # the dense logits' 16 MiB, far out of reach
        assert peak < b * b * 4 / 8, f"{peak} bytes"
    assert peak < 2 * n_block * 4 + (2 + copies) * b * d * 4 + 64 * b + 2**16, f"{peak} bytes"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": 0.0}, "Scale must be a positive value"),
        ({"bias": float("nan")}, "bias must be a finite number"),
        ({"bias": torch.zeros(2)}, "one-element tensor"),
        ({"similarity": "euclidean"}, "similarity must be"),
        ({"path": "fast"}, "path must be"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"bank": torch.zeros(3, 5)}, r"bank must be \(rows, 4\)"),
        ({"row_offset": 3}, "row_offset=3"),
        ({"sizes": [5, 5]}, "sizes=.* every process's row count"),
    ],
)
def test_bad_input_raises_value_error_naming_the_fix(kwargs, match):
    anchors, cols, _ = _embeddings(5, 4, 1, seed=0)
    with pytest.raises(ValueError, match=match):
        sigmoid_loss_and_grad(anchors, cols, **kwargs)


def test_non_finite_embeddings_are_named():
    anchors, cols, _ = _embeddings(5, 4, 2, seed=0)
    cols[1][2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite .* candidates\[1\]"):
        sigmoid_loss(anchors, cols)
    with pytest.raises(ValueError, match=r"non-finite .* the bank"):
        sigmoid_loss_and_grad(anchors, cols[:1], bank=torch.full((2, 4), float("inf"), dtype=torch.float64))


@pytest.mark.parametrize("ring", [False, True])
def test_both_strategies_on_one_process_equal_the_local_loss(ring):
    """``sizes=[B]`` outside a process group: the strategies' code paths with one process."""
    anchors, cols, bank = _embeddings(6, 4, 2, seed=6, bank=3)
    s = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    kwargs = {"scale": s, "bias": -1.5, "bank": bank, "chunk_size": 4}
    local = sigmoid_loss_and_grad(anchors, cols, **kwargs)
    across = sigmoid_loss_and_grad(anchors, cols, sizes=[6], ring=ring, **kwargs)
    for a, b in zip(
        [local.loss, local.grad_anchors, *local.grad_candidates, local.grad_scale],
        [across.loss, across.grad_anchors, *across.grad_candidates, across.grad_scale],
    ):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)


def test_autograd_keeps_only_the_gradients_between_forward_and_backward():
    """Forward computes the gradients with the loss and keeps them (``O((B + C) d)``), nothing of the blocks;
    only those of inputs that require grad."""
    anchors, cols, _ = _embeddings(12, 5, 2, seed=7)
    anchors.requires_grad_()
    cols[0].requires_grad_()  # the hard negatives' column is frozen: its gradient is computed, not kept
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    loss = sigmoid_loss(anchors, cols, scale=5.0, bias=bias, chunk_size=5)
    kept = [tuple(t.shape) for t in loss.grad_fn.saved_tensors]
    assert kept == [(), (12, 5), (12, 5)]  # the bias's, the anchors', the positives'; nothing of a block
    g_a, g_p, g_b = torch.autograd.grad(loss, [anchors, cols[0], bias])
    ref = torch.autograd.grad(
        reference_sigmoid(anchors, cols, scale=5.0, bias=bias), [anchors, cols[0], bias]
    )
    for ours, r in zip((g_a, g_p, g_b), ref):
        torch.testing.assert_close(ours, r, rtol=1e-12, atol=1e-14)


def test_autocast_around_the_call_changes_nothing():
    """The loss stage computes in fp32 whatever the caller's autocast says (an fp32 product under bf16 autocast
    would lose the logits' low bits)."""
    anchors, cols, _ = _embeddings(32, 16, 2, seed=12)
    a, c = anchors.float().requires_grad_(), [x.float() for x in cols]
    plain = sigmoid_loss(a, c, scale=20.0, bias=-5.0)
    (g_plain,) = torch.autograd.grad(plain, [a])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = sigmoid_loss(a, c, scale=20.0, bias=-5.0)
        (g_cast,) = torch.autograd.grad(cast, [a])
    assert cast.dtype == torch.float32 and g_cast.dtype == torch.float32
    torch.testing.assert_close(cast, plain, rtol=0, atol=0)
    torch.testing.assert_close(g_cast, g_plain, rtol=0, atol=0)
