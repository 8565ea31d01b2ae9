"""CachedSparseLoss across processes (gloo on CPU, spawned from pytest), with ``gather_across_devices`` on
the base loss and unequal per-process batches: DDP's averaged parameter gradients and the mean of the
processes' losses equal the single-process ``SpladeLoss`` of the whole global batch (the FLOPS regularisers
of every process's rows together), through the gathered core and through the ring; without gathering, the
mean of each process's own ``SpladeLoss``, as sentence-transformers under DDP."""

from __future__ import annotations

import pytest
import torch

from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_splade, random_texts

WEIGHTS = {"document_regularizer_weight": 0.8, "query_regularizer_weight": 0.5}
OPTIONS = {
    "gathered": {},
    "ring": {"path": "tiled", "tile_size": 2},
    "thresholds": {"document_regularizer_threshold": 100, "query_regularizer_threshold": 95},
    # without gathering, each process's own SpladeLoss (as sentence-transformers): DDP averages them
    "local": {"gather_across_devices": False},
}
SIZES = [3, 5]  # unequal rows per process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sparse_dist")
    model = make_tiny_splade(base / "bert")
    model.save(str(base / "splade"))
    return str(base / "splade")


def global_texts(n_cols: int, seed: int) -> list[list[str]]:
    return [random_texts(sum(SIZES), seed=seed + 31 * k) for k in range(n_cols)]


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def _splade_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if "regulariz" in k}


def _worker(rank: int, world: int, path: str, n_cols: int) -> dict:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
    from torch.nn.parallel import DistributedDataParallel as DDP

    from st_cached_losses import CachedSparseLoss

    assert torch.distributed.get_world_size() == world == len(SIZES)
    results = {}
    for name, options in OPTIONS.items():
        model = SparseEncoder(path, device="cpu")
        ddp = DDP(model)
        extras = {k: v for k, v in options.items() if "regulariz" not in k and k != "gather_across_devices"}
        gather = options.get("gather_across_devices", True)
        base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=gather)
        loss = CachedSparseLoss(
            model, base, **WEIGHTS, **_splade_options(options), mini_batch_size=2, **extras
        )
        loss.model = ddp  # what the trainer does with a wrapped model
        texts = global_texts(n_cols, seed=len(name))
        start = sum(SIZES[:rank])
        feats = [model.preprocess(t[start : start + SIZES[rank]]) for t in texts]
        ddp.zero_grad(set_to_none=True)
        parts = loss(feats, None)
        torch.stack(list(parts.values())).sum().backward()
        results[name] = {
            "parts": {k: float(v.detach()) for k, v in parts.items()},
            "grads": flat_grads(model),
        }
    return results


def _reference(path: str, name: str, n_cols: int) -> dict:
    """The non-cached SpladeLoss on one process: of the global batch, or (``local``) the mean of each
    process's rows' own loss and gradient."""
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    model = SparseEncoder(path, device="cpu")
    loss = SpladeLoss(
        model, SparseMultipleNegativesRankingLoss(model), **WEIGHTS, **_splade_options(OPTIONS[name])
    )
    texts = global_texts(n_cols, seed=len(name))
    if OPTIONS[name].get("gather_across_devices", True):
        shares = [texts]
    else:
        starts = [sum(SIZES[:r]) for r in range(len(SIZES))]
        shares = [[t[s : s + n] for t in texts] for s, n in zip(starts, SIZES)]
    parts: dict[str, float] = {}
    for share in shares:
        out = loss([model.preprocess(t) for t in share], None)
        (torch.stack(list(out.values())).sum() / len(shares)).backward()
        for k, v in out.items():
            parts[k] = parts.get(k, 0.0) + float(v.detach()) / len(shares)
    return {"parts": parts, "grads": flat_grads(model)}


@pytest.mark.parametrize("n_cols", [2, 3], ids=["pairs", "triplets"])
def test_ddp_equals_single_process_splade_loss(model_dir, n_cols):
    per_rank = run_distributed(_worker, len(SIZES), model_dir, n_cols)
    for name in OPTIONS:
        ref = _reference(model_dir, name, n_cols)
        assert ref["grads"].abs().max() > 0
        results = [r[name] for r in per_rank]
        for key, want in ref["parts"].items():
            got = sum(r["parts"][key] for r in results) / len(results)
            assert got == pytest.approx(want, rel=1e-5), f"{name}: {key}"
        # DDP averaged the gradients: every process holds the global batch's gradient
        tol = 1e-5 * ref["grads"].abs().max().item()
        for rank, r in enumerate(results):
            err = (r["grads"] - ref["grads"]).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
