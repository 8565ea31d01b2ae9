"""The negative bank of the core ([`Bank`][st_cached_losses.functional.softmax.options.Bank]): earlier rows' embeddings
scored as extra negative columns, without gradient. Against the naive reference that concatenates them as
extra columns (``tests/support/reference.py``), in fp64: one process (chunked, tiled, autograd and
loss-and-gradient entry points, one- and two-directional, a learnable scale), and across 2 and 3 gloo
processes with unequal batches and unequal bank shares (gathered and ring). No bank, or an empty one, is
bit for bit the loss without the option."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses.functional import infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import Bank
from st_cached_losses.functional.softmax.terms import mnrl_terms
from tests.support.reference import reference_infonce


def _emb(b: int, n_cols: int, d: int = 6, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, generator=gen, dtype=torch.float64) for _ in range(1 + n_cols)]


def _bank(n_c: int, n_q: int | None, d: int = 6, seed: int = 1) -> Bank:
    gen = torch.Generator().manual_seed(seed)
    cands = torch.randn(n_c, d, generator=gen, dtype=torch.float64)
    anchors = torch.randn(n_q, d, generator=gen, dtype=torch.float64) if n_q is not None else None
    return Bank(cands, anchors)


@pytest.mark.parametrize("symmetric", [False, True], ids=["one", "sym"])
@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_empty_bank_is_bit_identical(symmetric, path):
    """An empty bank adds no term: the loss and every gradient are those without the option, exactly."""
    a, p, n = (e.float() for e in _emb(9, 2))
    kw = {"symmetric": symmetric, "path": path, "tile_size": 4}
    plain = infonce_loss_and_grad(a, [p, n], **kw)
    empty = infonce_loss_and_grad(a, [p, n], bank=Bank(p[:0], a[:0] if symmetric else None), **kw)
    assert torch.equal(plain.loss, empty.loss)
    assert torch.equal(plain.grad_anchors, empty.grad_anchors)
    for x, y in zip(plain.grad_candidates, empty.grad_candidates):
        assert torch.equal(x, y)


@pytest.mark.parametrize("symmetric", [False, True], ids=["one", "sym"])
@pytest.mark.parametrize("path", ["chunked", "tiled"])
@pytest.mark.parametrize(("b", "n_bank"), [(7, 11), (1, 3), (5, 1)])
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_bank_equals_extra_negative_columns(symmetric, path, b, n_bank, similarity):
    emb = [e.requires_grad_() for e in _emb(b, 2)]
    scale = torch.tensor(20.0 if similarity == "cosine" else 0.5, dtype=torch.float64, requires_grad=True)
    bank = _bank(n_bank, n_bank + 2 if symmetric else None)
    ref = reference_infonce(
        emb[0], emb[1:], scale=scale, similarity=similarity, symmetric=symmetric,
        bank_candidates=bank.candidates, bank_anchors=bank.anchors,
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, [*emb, scale])
    assert all(bool(g.abs().sum() > 0) for g in ref_grads)
    kw = {"scale": scale, "similarity": similarity, "symmetric": symmetric, "path": path, "tile_size": 3}
    out = infonce_loss_and_grad(*(lambda e: (e[0], e[1:]))([e.detach() for e in emb]), bank=bank, **kw)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for ours, theirs in zip([out.grad_anchors, *out.grad_candidates, out.grad_scale], ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    # the autograd entry point: the same, and no gradient reaches the bank
    loss = infonce(emb[0], emb[1:], bank=bank, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(torch.autograd.grad(loss, [*emb, scale]), ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_bank_changes_the_loss_and_takes_the_hardness_penalty():
    """A bank is not vacuous (the loss rises with more negatives), and a bank entry takes the off-diagonal
    hardness penalty of the term it extends: under ``all_negatives`` (every entry of a hard-negative column
    penalised), a bank of that column's rows equals the column."""
    a, p, n = _emb(6, 2)
    plain = infonce_loss_and_grad(a, [p, n]).loss
    assert float(infonce_loss_and_grad(a, [p, n], bank=_bank(8, None)).loss) > float(plain)
    terms = mnrl_terms(("query_to_doc",), "joint", "all_negatives", 3.0, 2)
    as_column = infonce_loss_and_grad(a, [p, n], terms=terms)
    terms1 = mnrl_terms(("query_to_doc",), "joint", "all_negatives", 3.0, 1)
    as_bank = infonce_loss_and_grad(a, [p], terms=terms1, bank=Bank(n))
    torch.testing.assert_close(as_bank.loss, as_column.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(as_bank.grad_anchors, as_column.grad_anchors, rtol=1e-10, atol=1e-12)


def test_bank_refusals():
    a, p = _emb(4, 1)
    with pytest.raises(ValueError, match=r"bank\.candidates must be"):
        infonce_loss_and_grad(a, [p], bank=Bank(torch.randn(3, 5, dtype=torch.float64)))
    with pytest.raises(ValueError, match="duplicate keys"):
        keys = torch.arange(4)
        infonce_loss_and_grad(a, [p], bank=Bank(p), anchor_keys=keys, candidate_keys=[keys])


def _bank_worker(rank, world_size, sizes, shares_c, shares_q, symmetric, ring):
    import torch.distributed as dist

    from st_cached_losses.functional.softmax.parallel import gathered_loss_and_grad, ring_loss_and_grad

    assert dist.get_world_size() == len(sizes)
    r = dist.get_rank()
    own = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    emb = _emb(sum(sizes), 2)
    bank = _bank(sum(shares_c), sum(shares_q) if symmetric else None)
    mine_c = bank.candidates[sum(shares_c[:r]) : sum(shares_c[: r + 1])]
    mine_q = bank.anchors[sum(shares_q[:r]) : sum(shares_q[: r + 1])] if symmetric else None
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    strategy = ring_loss_and_grad if ring else gathered_loss_and_grad
    out = strategy(
        emb[0][own], [c[own] for c in emb[1:]], sizes, scale=scale, symmetric=symmetric, tile_size=3,
        path="tiled" if ring else "auto", bank=Bank(mine_c, mine_q),
    )  # fmt: skip
    return {"loss": out.loss, "grads": [out.grad_anchors, *out.grad_candidates], "scale": out.grad_scale}


@pytest.mark.parametrize("ring", [False, True], ids=["gather", "ring"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["one", "sym"])
@pytest.mark.parametrize(
    ("sizes", "shares_c", "shares_q"),
    [([4, 2], [5, 3], [2, 6]), ([3, 1, 4], [2, 0, 5], [4, 3, 1])],
    ids=["w2", "w3"],
)
def test_across_processes_equals_one_process_with_the_whole_bank(sizes, shares_c, shares_q, symmetric, ring):
    """Each process holds its share of the bank; the shares' mean loss is the one-process loss of the
    global batch against the whole bank (every share, rank order), and the gradients sum to ``W`` times its
    gradients (DDP averages them). A process whose share is empty (w3) still scores every other share."""
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(
        _bank_worker, len(sizes), sizes, shares_c, shares_q, symmetric, ring, timeout=180
    )
    w = len(sizes)
    emb = [e.requires_grad_() for e in _emb(sum(sizes), 2)]
    bank = _bank(sum(shares_c), sum(shares_q) if symmetric else None)
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    ref = reference_infonce(
        emb[0], emb[1:], scale=scale, symmetric=symmetric, bank_candidates=bank.candidates,
        bank_anchors=bank.anchors,
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, [*emb, scale])
    assert float(sum(p["loss"] for p in per_rank)) / w == pytest.approx(float(ref.detach()), rel=1e-12)
    for k, g in enumerate(ref_grads[:-1]):
        ours = torch.cat([p["grads"][k] for p in per_rank]) / w
        torch.testing.assert_close(ours, g, rtol=1e-9, atol=1e-12)
    for p in per_rank:
        torch.testing.assert_close(p["scale"], ref_grads[-1], rtol=1e-9, atol=1e-12)
