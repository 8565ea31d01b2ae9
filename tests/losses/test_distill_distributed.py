"""The cached distillation losses across 3 gloo processes (spawned from pytest): DDP parameter gradients equal
the single-process gradients of the concatenated global batch under sentence-transformers' non-cached loss
(plus, with the in-batch InfoNCE term gathered across processes, the naive InfoNCE of the global batch);
equal per-process batches, and unequal ones with ``gather_across_devices`` (each process's share of the
global mean)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.dist_utils import run_distributed
from tests.support.reference import reference_infonce
from tests.support.tiny_model import make_tiny_model, make_tiny_multi_vector, random_texts

WORLD = 3
#: name -> (our class, their class, kind, our kwargs, text columns)
CONFIGS = {
    "kl": ("CachedDistillKLDivLoss", "DistillKLDivLoss", "dense", {"temperature": 2.0}, 4),
    "kl_infonce": (
        "CachedDistillKLDivLoss",
        "DistillKLDivLoss",
        "dense",
        {"infonce_weight": 0.5, "infonce_scale": 0.5},
        4,
    ),
    "margin": ("CachedMarginMSELoss", "MarginMSELoss", "dense", {}, 3),
    "margin_infonce": ("CachedMarginMSELoss", "MarginMSELoss", "dense", {"infonce_weight": 0.3}, 4),
    "mv_kl": ("CachedMultiVectorDistillKLDivLoss", "MultiVectorDistillKLDivLoss", "mv", {}, 3),
    "mv_margin_infonce": (
        "CachedMultiVectorMarginMSELoss",
        "MultiVectorMarginMSELoss",
        "mv",
        {"infonce_weight": 0.4, "infonce_scale": 0.5},
        3,
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("distill_dist")
    dense = make_tiny_model(base / "bert")
    dense.save(str(base / "st"))
    mv = make_tiny_multi_vector(base / "mv_bert")
    mv.save(str(base / "mv"))
    return {"dense": str(base / "st"), "mv": str(base / "mv")}


def load(kind: str, path: str):
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer

    if kind == "mv":
        return MultiVectorEncoder(path, device="cpu")
    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None  # unused by mean pooling: DDP sees every parameter used
    return model


def batch(n_rows: int, n_cols: int, seed: int = 0) -> tuple[list[list[str]], torch.Tensor]:
    texts = [random_texts(n_rows, seed=seed + 31 * k) for k in range(n_cols)]
    labels = torch.randn(n_rows, n_cols - 1, generator=torch.Generator().manual_seed(seed)) * 3
    return texts, labels


def features(model, kind: str, texts: list[list[str]]) -> list[dict]:
    if kind == "mv":
        return [
            {**model.preprocess(t, task=task), "task": task}
            for t, task in zip(texts, ["query"] + ["document"] * (len(texts) - 1))
        ]
    return [model.preprocess(t) for t in texts]


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def _worker(rank: int, world: int, dirs: dict[str, str], names: list[str], sizes: list[int]) -> dict:
    import st_cached_losses

    assert torch.distributed.get_world_size() == world
    results = {}
    for name in names:
        ours, _, kind, kwargs, n_cols = CONFIGS[name]
        model = load(kind, dirs[kind])
        ddp = DDP(model, find_unused_parameters=kind == "mv")
        loss = getattr(st_cached_losses, ours)(model, mini_batch_size=2, gather_across_devices=True, **kwargs)
        loss.model = ddp  # what the trainer does with a wrapped model
        texts, labels = batch(sum(sizes), n_cols)
        start = sum(sizes[:rank])
        rows = slice(start, start + sizes[rank])
        value = loss(features(model, kind, [t[rows] for t in texts]), labels[rows])
        value.backward()
        results[name] = {"loss": value.item(), "grads": flat_grads(model)}
    return results


def _reference(dirs: dict[str, str], name: str, n_rows: int) -> dict:
    """One process, the global batch: their non-cached loss (+ the naive InfoNCE term)."""
    from sentence_transformers.multi_vector_encoder import losses as mv_losses
    from sentence_transformers.sentence_transformer import losses as st_losses

    _, theirs, kind, kwargs, n_cols = CONFIGS[name]
    model = load(kind, dirs[kind])
    texts, labels = batch(n_rows, n_cols)
    feats = features(model, kind, texts)
    temps = {k: v for k, v in kwargs.items() if "temperature" in k}
    weight, scale = (
        kwargs.get("infonce_weight", 0.0),
        kwargs.get("infonce_scale", 20.0 if kind == "dense" else 1.0),
    )
    if kind == "dense":
        st = getattr(st_losses, theirs)(model, **temps)
        embs = [model(dict(f))["sentence_embedding"] for f in feats]
        value = st.compute_loss_from_embeddings(embs, labels)
        if weight:
            value = value + weight * reference_infonce(embs[0], embs[1:], scale=scale, similarity="dot")
    else:
        value = getattr(mv_losses, theirs)(model, **temps)(feats, labels)
        if weight:
            value = value + weight * mv_losses.MultiVectorMultipleNegativesRankingLoss(model, scale=scale)(
                feats, None
            )
    value.backward()
    return {"loss": value.item(), "grads": flat_grads(model)}


@pytest.mark.parametrize("sizes", [[3, 3, 3], [2, 3, 4]], ids=["equal", "unequal"])
def test_three_processes_equal_one_process_global_batch(model_dirs, sizes):
    names = list(CONFIGS)
    per_rank = run_distributed(_worker, WORLD, model_dirs, names, sizes)
    for name in names:
        ref = _reference(model_dirs, name, sum(sizes))
        assert ref["grads"].abs().max() > 0
        tol = 1e-5 * ref["grads"].abs().max().item()
        losses = [r[name]["loss"] for r in per_rank]
        assert sum(losses) / WORLD == pytest.approx(ref["loss"], rel=1e-5), name
        for rank, r in enumerate(per_rank):
            err = (r[name]["grads"] - ref["grads"]).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
