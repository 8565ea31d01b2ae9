"""Packed rows across processes (gloo on CPU, spawned from pytest): token rows (MaxSim, MeanMaxSim, XTR) and
sparse rows (SparseDot, one direction and symmetric) by ring exchange and gathered, each process holding a
different number of rows at a width of its own (its own longest row), equal the single-process loss of the
global batch, values and gradients; the gradients come back at each process's own width. The FLOPS
regulariser of packed rows across processes (``dim=``, ``across_processes=True``, with and without a
threshold) equals the single-process one of the global dense rows, in the same spawn."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses.functional import infonce_loss_and_grad
from st_cached_losses.functional.representations.flops import flops_loss_and_grad
from st_cached_losses.functional.representations.multi_vector import XTR, MaxSim
from st_cached_losses.functional.representations.sparse import SparseDot, dense_rows, pack_rows
from tests.functional.test_multi_vector import tied_case, token_case
from tests.functional.test_sparse_rows import V, sparse_rows

CASES = {
    "maxsim": {"similarity": MaxSim()},
    "meanmaxsim": {"similarity": MaxSim(length_normalize=True)},
    "xtr": {"similarity": XTR(5)},
    # exact ties (grid embeddings, a document repeated across processes): exactly top_k, the same tokens
    "xtr-ties": {"similarity": XTR(5)},
    "sparse": {"similarity": "sparse"},
    "sparse-symmetric": {"similarity": "sparse", "symmetric": True},
}
SCALE = 1.5
FLOPS_THRESHOLDS = [None, 4]


def _own(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _token_global(n: int, case: str = "") -> tuple[torch.Tensor, list[torch.Tensor]]:
    return (tied_case if case.endswith("ties") else token_case)(n, 2, tq=6, td=8, seed=3)


def _trim(packed: torch.Tensor) -> torch.Tensor:
    """Token rows cut to their own longest row (at least 1 token): a process's own width."""
    used = packed[..., -1].ne(0).any(0).nonzero()
    return packed[:, : max(int(used.max()) + 1 if used.numel() else 1, 1)]


def _sparse_global(n: int) -> list[torch.Tensor]:
    return [sparse_rows(n, 6 + 5 * k, seed=11 + k, dtype=torch.float64) for k in range(3)]


def _inputs(case: str, sizes: list[int], rank: int) -> tuple[list[torch.Tensor], dict]:
    """This process's rows (packed at its own width) and the call's options."""
    own = _own(sizes, rank)
    opts = dict(CASES[case])
    if opts["similarity"] == "sparse":
        opts["similarity"] = SparseDot(V)
        return [pack_rows(x[own]) for x in _sparse_global(sum(sizes))], opts
    q, cols = _token_global(sum(sizes), case)
    return [_trim(x[own]) for x in (q, *cols)], opts


def _worker(rank: int, world: int, sizes: list[int]) -> dict:
    from st_cached_losses.functional.softmax.parallel import gathered_loss_and_grad, ring_loss_and_grad

    out = {}
    for case in CASES:
        rows, opts = _inputs(case, sizes, rank)
        for name, strategy, extra in (
            ("ring", ring_loss_and_grad, {"path": "tiled", "tile_size": 2}),
            ("gathered", gathered_loss_and_grad, {}),
        ):
            if isinstance(opts["similarity"], SparseDot):
                opts["similarity"] = SparseDot(V)  # a fresh instance per call, as the loss makes one
            res = strategy(rows[0], rows[1:], sizes, scale=SCALE, **opts, **extra)
            out[(case, name)] = {
                "loss": res.loss,
                "grads": [res.grad_anchors, *res.grad_candidates],
                "widths": [int(r.shape[1]) for r in rows],
            }
    packed = [pack_rows(x[_own(sizes, rank)]) for x in _sparse_global(sum(sizes))]
    for threshold in FLOPS_THRESHOLDS:
        res = flops_loss_and_grad(packed, threshold, grad_output=0.7, across_processes=True, dim=V)
        out[("flops", threshold)] = {"loss": res.loss, "grads": res.grads}
    return out


def _reference(
    case: str, n: int, name: str = "gathered"
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The single-process loss of the global batch and its gradients (dense rows for the sparse cases),
    with the global rows; XTR's ties in the ring are the lowest keys (no process holds a whole flat row)."""
    opts = dict(CASES[case])
    if name == "ring" and isinstance(opts["similarity"], XTR):
        opts["similarity"] = XTR(opts["similarity"].top_k, ties="lowest")
    if opts["similarity"] == "sparse":
        rows = _sparse_global(n)
        opts["similarity"] = "dot"
    else:
        q, cols = _token_global(n, case)
        if isinstance(opts["similarity"], XTR) and name == "gathered":
            # torch.topk's choice among ties depends on the flat row's padding too: the columns as wide as
            # the gathered ones (every process's widest), as sentence-transformers pads them across processes
            cols = [_trim(c) for c in cols]
        rows = [q, *cols]
    out = infonce_loss_and_grad(rows[0], rows[1:], scale=SCALE, **opts)
    return out.loss, [out.grad_anchors, *out.grad_candidates], rows  # type: ignore[list-item]


@pytest.mark.parametrize("sizes", [[3, 5], [4, 2, 3]], ids=["w2", "w3"])
def test_packed_ring_and_gather_equal_single_process(sizes):
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_worker, len(sizes), sizes, timeout=240)
    w = len(sizes)
    for case in CASES:
        sparse = CASES[case]["similarity"] == "sparse"
        if not sparse:  # the processes really hold token rows of different widths
            assert len({tuple(r[(case, "ring")]["widths"]) for r in per_rank}) > 1, case
        for name in ("ring", "gathered"):
            ref_loss, ref_grads, rows = _reference(case, sum(sizes), name)
            results = [r[(case, name)] for r in per_rank]
            got = float(sum(r["loss"] for r in results)) / w
            assert got == pytest.approx(float(ref_loss), rel=1e-10), (case, name)
            for k, ref in enumerate(ref_grads):
                assert ref.abs().max() > 0, (case, k)
                for rank, r in enumerate(results):
                    g, own = r["grads"][k] / w, _own(sizes, rank)
                    if sparse:  # the gradient on the kept entries; an index has none
                        packed = pack_rows(rows[k][own])
                        assert g.shape == packed.shape and not g[..., 0].any()
                        want = ref[own] * (rows[k][own] != 0)
                        g = dense_rows(packed, V, values=g[..., 1])
                    else:  # at the process's own width; the padding beyond it has no gradient
                        want = ref[own][:, : g.shape[1]]
                        assert not ref[own][:, g.shape[1] :].any()
                    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12, msg=f"{case} {name} {k}")
    for threshold in FLOPS_THRESHOLDS:
        rows = _sparse_global(sum(sizes))
        ref = flops_loss_and_grad(rows, threshold, grad_output=0.7)
        if threshold is not None:  # the threshold masks some rows, not all
            counted = sum(int(((r != 0).sum(1) > threshold).sum()) for r in rows)
            assert 0 < counted < 3 * sum(sizes)
        assert all(g.abs().max() > 0 for g in ref.grads)
        for rank, r in enumerate(per_rank):  # every process: the global value
            torch.testing.assert_close(r[("flops", threshold)]["loss"], ref.loss, rtol=1e-12, atol=0)
            own = _own(sizes, rank)
            for g, want, x in zip(r[("flops", threshold)]["grads"], ref.grads, rows):
                # each process's gradient is W times its rows' share (DDP averages), on the kept entries
                packed = pack_rows(x[own])
                assert not g[..., 0].any()
                got = dense_rows(packed, V, values=g[..., 1]) / w
                torch.testing.assert_close(got, want[own] * (x[own] != 0), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("case", list(CASES))
def test_ring_of_one_process_equals_the_local_loss(case):
    """Without a process group the ring is one visit of this process's own block: the local core's loss
    and gradients, at each column's own width (the columns differ in width: padded to one, cut back)."""
    from st_cached_losses.functional.softmax.parallel import ring_loss_and_grad

    rows, opts = _inputs(case, [7], 0)
    assert len({r.shape[1] for r in rows[1:]}) > 1
    local = dict(opts)
    if isinstance(opts["similarity"], XTR):  # the ring's ties: the lowest keys
        local["similarity"] = XTR(opts["similarity"].top_k, ties="lowest")
    ref = infonce_loss_and_grad(rows[0], rows[1:], scale=SCALE, **local)
    if isinstance(opts["similarity"], SparseDot):
        opts["similarity"] = SparseDot(V)
    out = ring_loss_and_grad(rows[0], rows[1:], [7], scale=SCALE, tile_size=3, **opts)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)
    for g, want in zip([out.grad_anchors, *out.grad_candidates], [ref.grad_anchors, *ref.grad_candidates]):
        assert g is not None and want is not None and g.shape == want.shape
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


def test_xtr_ring_refuses_terms_that_score_documents_against_anchors():
    from st_cached_losses.functional.softmax.parallel import ring_loss_and_grad

    rows, _ = _inputs("xtr", [5], 0)
    with pytest.raises(ValueError, match="scores queries against documents only"):
        ring_loss_and_grad(rows[0], rows[1:], [5], scale=SCALE, similarity=XTR(5), symmetric=True)
