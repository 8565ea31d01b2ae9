"""The sparse loss's compact cache across processes (gloo on CPU, spawned from pytest, unequal batches):
without gathering, each process keeps its rows packed, and DDP's averaged gradients equal the mean of each
process's own ``SpladeLoss`` (as sentence-transformers under DDP); with ``gather_across_devices`` the cache
stays dense (the processes would have to agree on one form), with the single-process gradient of the
global batch."""

from __future__ import annotations

import pytest
import torch

from tests.losses.test_sparse_distributed import SIZES, WEIGHTS, flat_grads, global_texts
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_splade

GATHER = {"local": False, "gathered": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sparse_compact_dist")
    model = make_tiny_splade(base / "bert", bias=-1.0)  # rows 4-9% non-zero
    model.save(str(base / "splade"))
    return str(base / "splade")


def _worker(rank: int, world: int, path: str) -> dict:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
    from torch.nn.parallel import DistributedDataParallel as DDP

    from st_cached_losses import CachedSparseLoss

    assert torch.distributed.get_world_size() == world == len(SIZES)
    results = {}
    for name, gather in GATHER.items():
        model = SparseEncoder(path, device="cpu")
        ddp = DDP(model)
        base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=gather)
        loss = CachedSparseLoss(model, base, **WEIGHTS, mini_batch_size=2)
        loss.model = ddp  # what the trainer does with a wrapped model
        texts = global_texts(3, seed=7)
        start = sum(SIZES[:rank])
        feats = [model.preprocess(t[start : start + SIZES[rank]]) for t in texts]
        ddp.zero_grad(set_to_none=True)
        parts = loss(feats, None)
        torch.stack(list(parts.values())).sum().backward()
        results[name] = {
            "parts": {k: float(v.detach()) for k, v in parts.items()},
            "grads": flat_grads(model),
            "compact": loss.cache.form.compact,
        }
    return results


def _reference(path: str, gather: bool) -> dict:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    model = SparseEncoder(path, device="cpu")
    loss = SpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **WEIGHTS)
    texts = global_texts(3, seed=7)
    starts = [sum(SIZES[:r]) for r in range(len(SIZES))]
    shares = [texts] if gather else [[t[s : s + n] for t in texts] for s, n in zip(starts, SIZES)]
    parts: dict[str, float] = {}
    for share in shares:
        out = loss([model.preprocess(t) for t in share], None)
        (torch.stack(list(out.values())).sum() / len(shares)).backward()
        for k, v in out.items():
            parts[k] = parts.get(k, 0.0) + float(v.detach()) / len(shares)
    return {"parts": parts, "grads": flat_grads(model)}


def test_compact_cache_under_ddp(model_dir):
    per_rank = run_distributed(_worker, len(SIZES), model_dir)
    for name, gather in GATHER.items():
        results = [r[name] for r in per_rank]
        assert all(r["compact"] is (not gather) for r in results), name
        ref = _reference(model_dir, gather)
        assert ref["grads"].abs().max() > 0
        for key, want in ref["parts"].items():
            got = sum(r["parts"][key] for r in results) / len(results)
            assert got == pytest.approx(want, rel=1e-5), f"{name}: {key}"
        tol = 1e-5 * ref["grads"].abs().max().item()
        for rank, r in enumerate(results):
            err = (r["grads"] - ref["grads"]).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
