"""The sparse loss's compact cache across processes (gloo on CPU, spawned from pytest, unequal batches, 2 and
3 processes): without gathering, each process keeps its rows packed, and DDP's averaged gradients equal the
mean of each process's own ``SpladeLoss`` (as sentence-transformers under DDP); with
``gather_across_devices``, gathered and by ring (``path="tiled"``), the processes agree on the packed form
(each at a width of its own, padded to a common one by the loss stage) and reach the single-process
``SpladeLoss`` of the global batch; when one process's mini-batch is too dense, every process keeps the
dense form (one agreed decision), with the same values and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.losses.test_sparse_distributed import WEIGHTS, flat_grads
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_splade, random_texts

#: name: (gather_across_devices, loss options, compact expected)
VARIANTS = {
    "local": (False, {}, True),
    "gathered": (True, {}, True),
    "ring": (True, {"path": "tiled", "tile_size": 2}, True),
    # rank 1 finds its mini-batches too dense: every process keeps the dense form
    "gathered-one-dense": (True, {}, False),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sparse_compact_dist")
    model = make_tiny_splade(base / "bert", bias=-1.0)  # rows 4-9% non-zero
    model.save(str(base / "splade"))
    return str(base / "splade")


def _texts(sizes: list[int]) -> list[list[str]]:
    return [random_texts(sum(sizes), seed=7 + 31 * k) for k in range(3)]


def _worker(rank: int, world: int, path: str, sizes: list[int]) -> dict:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
    from torch.nn.parallel import DistributedDataParallel as DDP

    from st_cached_losses import CachedSparseLoss
    from st_cached_losses.distributed import STATS
    from st_cached_losses.functional.representations.sparse import pack_rows

    assert torch.distributed.get_world_size() == world == len(sizes)
    results = {}
    for name, (gather, options, _) in VARIANTS.items():
        model = SparseEncoder(path, device="cpu")
        ddp = DDP(model)
        base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=gather)
        loss = CachedSparseLoss(model, base, **WEIGHTS, mini_batch_size=2, **options)
        loss.model = ddp  # what the trainer does with a wrapped model
        if name == "gathered-one-dense" and rank == 1:
            loss.cache.form.max_density = 0.0  # every packed mini-batch of this process is "too dense"
        start = sum(sizes[:rank])
        feats = [model.preprocess(t[start : start + sizes[rank]]) for t in _texts(sizes)]
        if name == "local":  # each column's packed width on this process (its densest row)
            with torch.no_grad():
                embedded = [model(dict(f))["sentence_embedding"] for f in feats]
            results["widths"] = [int(pack_rows(e).shape[1]) for e in embedded]
        ddp.zero_grad(set_to_none=True)
        STATS.reset()
        parts = loss(feats, None)
        torch.stack(list(parts.values())).sum().backward()
        results[name] = {
            "parts": {k: float(v.detach()) for k, v in parts.items()},
            "grads": flat_grads(model),
            "compact": loss.cache.form.compact,
            "kinds": sorted(STATS.calls),
        }
    return results


def _reference(path: str, sizes: list[int], gather: bool) -> dict:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    model = SparseEncoder(path, device="cpu")
    loss = SpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **WEIGHTS)
    texts = _texts(sizes)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    shares = [texts] if gather else [[t[s : s + n] for t in texts] for s, n in zip(starts, sizes)]
    parts: dict[str, float] = {}
    for share in shares:
        out = loss([model.preprocess(t) for t in share], None)
        (torch.stack(list(out.values())).sum() / len(shares)).backward()
        for k, v in out.items():
            parts[k] = parts.get(k, 0.0) + float(v.detach()) / len(shares)
    return {"parts": parts, "grads": flat_grads(model)}


@pytest.mark.parametrize("sizes", [[3, 5], [2, 4, 3]], ids=["w2", "w3"])
def test_compact_cache_under_ddp(model_dir, sizes):
    per_rank = run_distributed(_worker, len(sizes), model_dir, sizes)
    refs = {gather: _reference(model_dir, sizes, gather) for gather in (False, True)}
    for name, (gather, options, compact) in VARIANTS.items():
        results = [r[name] for r in per_rank]
        assert all(r["compact"] is compact for r in results), name
        if gather:  # the ring sends blocks and gathers nothing; the gather the opposite
            ring = "path" in options
            assert all(("ring_send" in r["kinds"]) is ring for r in results), name
            assert all(("all_gather" in r["kinds"]) is not ring for r in results), name
            assert all("all_reduce_cache_form" in r["kinds"] for r in results), name
        ref = refs[gather]
        assert ref["grads"].abs().max() > 0
        for key, want in ref["parts"].items():
            got = sum(r["parts"][key] for r in results) / len(results)
            assert got == pytest.approx(want, rel=1e-5), f"{name}: {key}"
        tol = 1e-5 * ref["grads"].abs().max().item()
        for rank, r in enumerate(results):
            err = (r["grads"] - ref["grads"]).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
    # the compact and the dense form of the same gathered step: the same values and gradients
    for r in per_rank:
        torch.testing.assert_close(r["gathered"]["grads"], r["gathered-one-dense"]["grads"])
        for key, value in r["gathered"]["parts"].items():
            assert value == pytest.approx(r["gathered-one-dense"]["parts"][key], rel=1e-5)
    # the processes' packed rows had widths of their own (padded to a common one by the loss stage)
    assert len({tuple(r["widths"]) for r in per_rank}) > 1
