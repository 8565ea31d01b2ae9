"""The sigmoid (SigLIP) loss across 2 and 3 gloo processes with unequal batches, gathered and on a ring: each
process's share, its gradients (embeddings, scale, bias) and, through a tiny encoder averaged as DDP averages,
the parameter gradients equal one process on the concatenated batch (with every process's share of a
negative bank)."""

from __future__ import annotations

import pytest
import torch

from tests.support.reference import reference_sigmoid

D_IN, D = 6, 5
SCALE, BIAS = 7.0, -4.0


def _batch(n: int, k: int, bank: int, dtype: torch.dtype, seed: int = 11):
    """Inputs of ``n`` rows for the anchors' and the candidates' encoders (``k`` columns), the encoders'
    weights and ``bank`` bank rows, all drawn on every process alike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    xs = [x + 0.5 * torch.randn(n, D_IN, generator=g, dtype=torch.float64)]
    xs += [torch.randn(n, D_IN, generator=g, dtype=torch.float64) for _ in range(k - 1)]
    w_a = torch.randn(D_IN, D, generator=g, dtype=torch.float64)
    w_c = w_a + 0.3 * torch.randn(D_IN, D, generator=g, dtype=torch.float64)
    bank_rows = torch.randn(bank, D, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (x, *xs)], w_a.to(dtype), w_c.to(dtype), bank_rows.to(dtype)


def _embed(xs, w_a, w_c):
    """The anchors' and the candidate columns' embeddings through two linear encoders."""
    return xs[0] @ w_a, [x @ w_c for x in xs[1:]]


def _worker(rank, world_size, sizes, shares, ring, path, dtype):
    import torch.distributed as dist

    from st_cached_losses.functional import sigmoid_loss, sigmoid_loss_and_grad
    from st_cached_losses.functional.distributed import STATS
    from st_cached_losses.functional.placement import agree_on_sizes

    assert dist.get_world_size() == len(sizes) == world_size
    own = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    xs, w_a, w_c, bank = _batch(sum(sizes), 3, sum(shares), dtype)
    my_bank = bank[sum(shares[:rank]) : sum(shares[: rank + 1])]
    xs = [x[own] for x in xs]
    kwargs = {"ring": ring, "path": path, "chunk_size": 2, "tile_size": 2, "bank": my_bank}

    # the loss stage's way: loss and gradients without a graph, scale and bias as tensors
    anchors, cols = _embed(xs, w_a, w_c)
    assert agree_on_sizes([anchors, *cols], True) == sizes
    scale = torch.tensor(SCALE, dtype=dtype, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=dtype, requires_grad=True)
    STATS.reset()
    out = sigmoid_loss_and_grad(anchors, cols, sizes=sizes, scale=scale, bias=bias, **kwargs)
    calls = dict(STATS.calls)

    # any training loop's way: autograd through two encoders, the scale learnt through its log; then the
    # parameters' gradients averaged over processes, as DDP does
    enc_a, enc_c = w_a.clone().requires_grad_(), w_c.clone().requires_grad_()
    log_scale = torch.tensor(SCALE, dtype=dtype).log().requires_grad_()
    bias2 = torch.tensor(BIAS, dtype=dtype, requires_grad=True)
    a2, c2 = _embed(xs, enc_a, enc_c)
    loss = sigmoid_loss(a2, c2, sizes=sizes, scale=log_scale.exp(), bias=bias2, **kwargs)
    loss.backward()
    for p in (enc_a, enc_c):  # DDP's average (the scale and bias were averaged by the loss)
        dist.all_reduce(p.grad)
        p.grad /= world_size
    return {
        "loss": out.loss,
        "grads": [out.grad_anchors, *out.grad_candidates],
        "scale": out.grad_scale,
        "bias": out.grad_bias,
        "autograd_loss": loss.detach(),
        "params": [enc_a.grad, enc_c.grad, log_scale.grad, bias2.grad],
        "calls": calls,
    }


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp64: entry by entry to 1e-10; fp32: one tolerance over the whole tensor, 1e-6 of its largest entry
    (the fp32 embeddings' own rounding); never against a zero reference."""
    top = ref.abs().max().item()
    assert top > 0, "vacuous comparison: the reference is zero"
    if dtype == torch.float64:
        torch.testing.assert_close(ours.double(), ref, rtol=1e-10, atol=1e-12 * top)
    else:
        err = (ours.double() - ref).abs().max().item()
        assert err <= 1e-6 * top, f"max error {err:.2e} > 1e-6 x {top:.2e}"


CONFIGS = [
    pytest.param([5, 3], [4, 2], False, "chunked", torch.float64, id="w2-gather"),
    pytest.param([5, 3], [4, 2], True, "tiled", torch.float64, id="w2-ring"),
    pytest.param([4, 1, 3], [2, 0, 3], False, "tiled", torch.float64, id="w3-gather"),
    pytest.param([4, 1, 3], [2, 0, 3], True, "chunked", torch.float64, id="w3-ring"),
    pytest.param([4, 1, 3], [2, 0, 3], False, "auto", torch.float32, id="w3-gather-fp32"),
    pytest.param([4, 1, 3], [2, 0, 3], True, "auto", torch.float32, id="w3-ring-fp32"),
]


@pytest.mark.parametrize(("sizes", "shares", "ring", "path", "dtype"), CONFIGS)
def test_each_process_share_equals_one_process_on_the_global_batch(sizes, shares, ring, path, dtype):
    """The processes' mean loss is the global loss; the embeddings' gradients (each process's, concatenated)
    are ``W`` times its gradients (DDP averages them); the scale's and the bias's, averaged by the loss, are
    its gradients on every process; through the encoders, DDP's average is the one-process gradient."""
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_worker, len(sizes), sizes, shares, ring, path, dtype, timeout=180)
    w = len(sizes)
    rtol = 1e-10 if dtype == torch.float64 else 1e-6

    xs, w_a, w_c, bank = _batch(sum(sizes), 3, sum(shares), dtype)  # what the processes hold, in float64:
    xs, w_a, w_c, bank = [x.double() for x in xs], w_a.double(), w_c.double(), bank.double()
    anchors, cols = _embed(xs, w_a, w_c)
    leaves = [anchors.requires_grad_(), *(c.requires_grad_() for c in cols)]
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    ref = reference_sigmoid(leaves[0], leaves[1:], scale=scale, bias=bias, bank=bank)
    ref_grads = torch.autograd.grad(ref, [*leaves, scale, bias])

    # the collectives of one call: gathered, the bank shares' sizes, the columns side by side and the bank,
    # then one all-reduce of every column's gradients and one of the scale's and bias's; the ring gathers
    # nothing but the bank shares' sizes, and sends each block W - 1 times, each gradient block W times
    for p in per_rank:
        if ring:
            hops = (w - 1) + w + (w - 1)  # the columns, their gradients, the bank
            assert p["calls"] == {"all_gather": 1, "ring_send": hops, "all_reduce_scale": 1}
        else:
            assert p["calls"] == {"all_gather": 3, "all_reduce_grad": 1, "all_reduce_scale": 1}
    for name in ("loss", "autograd_loss"):
        assert float(sum(p[name] for p in per_rank)) / w == pytest.approx(float(ref.detach()), rel=rtol)
    for k, g in enumerate(ref_grads[:-2]):
        _close(torch.cat([p["grads"][k] for p in per_rank]) / w, g, dtype)
    for p in per_rank:
        _close(p["scale"], ref_grads[-2], dtype)
        _close(p["bias"], ref_grads[-1], dtype)

    # the parameters: the encoders' gradients (DDP's average) and log_scale's and bias's
    enc_a, enc_c = w_a.clone().requires_grad_(), w_c.clone().requires_grad_()
    log_scale = torch.tensor(SCALE, dtype=torch.float64).log().requires_grad_()
    bias2 = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    a2, c2 = _embed(xs, enc_a, enc_c)
    ref2 = reference_sigmoid(a2, c2, scale=log_scale.exp(), bias=bias2, bank=bank)
    ref_params = torch.autograd.grad(ref2, [enc_a, enc_c, log_scale, bias2])
    for p in per_rank:
        for ours, g in zip(p["params"], ref_params):
            _close(ours, g, dtype)
