"""CachedEmbedDistillLoss across 2 and 3 gloo processes (spawned from pytest) with unequal batches and
``gather_across_devices`` (gathered, and on a ring with ``path="tiled"``, the InfoNCE term beside it): under DDP, the model's and the projection's gradients and the mean of the processes'
losses equal one process on the concatenated global batch under the naive loss (sentence-transformers'
EmbedDistillLoss plus the dense listwise reference over every process's candidates)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.dist_utils import run_distributed
from tests.support.reference import reference_infonce, reference_listwise_kl
from tests.support.tiny_model import make_tiny_model, random_texts

TEACHER_D = 12
#: name -> (our kwargs, text columns)
CONFIGS = {
    "pointwise+listwise+projection": (
        {"distance_metric": "l2", "projection_dim": TEACHER_D, "listwise_weight": 0.5, "tile_size": 2},
        2,
    ),
    "listwise-hard-negative": ({"pointwise_weight": 0.0, "listwise_weight": 1.0, "tile_size": 3}, 3),
    "ring-listwise+infonce": (
        {
            "distance_metric": "cosine",
            "projection_dim": TEACHER_D,
            "listwise_weight": 1.0,
            "infonce_weight": 0.3,
            "path": "tiled",
            "tile_size": 2,
        },
        3,
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("embed_distill_dist")
    make_tiny_model(base / "bert").save(str(base / "st"))
    return str(base / "st")


def load(path: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None  # unused by mean pooling: DDP sees every parameter used
    return model


def batch(n_rows: int, n_cols: int) -> tuple[list[list[str]], torch.Tensor]:
    texts = [random_texts(n_rows, seed=7 + 31 * k) for k in range(n_cols)]
    labels = torch.randn(n_rows, n_cols, TEACHER_D, generator=torch.Generator().manual_seed(n_rows))
    return texts, labels


def projection(path: str) -> torch.nn.Linear:
    torch.manual_seed(5)
    return torch.nn.Linear(load(path).get_embedding_dimension(), TEACHER_D)


def grads(model, proj: torch.nn.Module | None) -> torch.Tensor:
    params = [*model.parameters(), *(proj.parameters() if proj is not None else ())]
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _worker(rank: int, world: int, path: str, sizes: list[int]) -> dict:
    import st_cached_losses

    assert torch.distributed.get_world_size() == world
    results = {}
    for name, (kwargs, n_cols) in CONFIGS.items():
        model = load(path)
        ddp = DDP(model)
        loss = st_cached_losses.CachedEmbedDistillLoss(
            model, mini_batch_size=2, gather_across_devices=True, **kwargs
        )
        if loss.projection is not None:
            loss.projection.load_state_dict(projection(path).state_dict())
        loss.model = ddp  # what the trainer does with a wrapped model
        texts, labels = batch(sum(sizes), n_cols)
        start = sum(sizes[:rank])
        rows = slice(start, start + sizes[rank])
        value = loss([model.preprocess(t[rows]) for t in texts], labels[rows])
        value.backward()
        results[name] = {"loss": value.item(), "grads": grads(model, loss.projection)}
    return results


def _reference(path: str, name: str, n_rows: int) -> dict:
    from sentence_transformers.sentence_transformer import losses as st_losses

    kwargs, n_cols = CONFIGS[name]
    model = load(path)
    texts, labels = batch(n_rows, n_cols)
    embs = [model(model.preprocess(t))["sentence_embedding"] for t in texts]
    teachers = list(labels.unbind(1))
    value = torch.zeros(())
    proj = None
    if kwargs.get("pointwise_weight", 1.0):
        theirs = st_losses.EmbedDistillLoss(model, kwargs["distance_metric"], kwargs.get("projection_dim"))
        if theirs.projection is not None:
            theirs.projection.load_state_dict(projection(path).state_dict())
            proj = theirs.projection
        value = value + theirs.compute_loss_from_embeddings(embs, teachers)
    listwise = reference_listwise_kl(embs[0], torch.cat(embs[1:]), teachers[0], torch.cat(teachers[1:]))
    value = value + kwargs["listwise_weight"] * listwise
    if kwargs.get("infonce_weight"):
        value = value + kwargs["infonce_weight"] * reference_infonce(embs[0], embs[1:], similarity="cosine")
    value.backward()
    return {"loss": value.item(), "grads": grads(model, proj)}


@pytest.mark.parametrize("sizes", [[2, 4], [3, 1, 4]], ids=["2-processes", "3-processes"])
def test_processes_equal_one_process_global_batch(model_dir, sizes):
    world = len(sizes)
    per_rank = run_distributed(_worker, world, model_dir, sizes)
    for name in CONFIGS:
        ref = _reference(model_dir, name, sum(sizes))
        assert ref["grads"].abs().max() > 0
        tol = 1e-5 * ref["grads"].abs().max().item()
        losses = [r[name]["loss"] for r in per_rank]
        assert sum(losses) / world == pytest.approx(ref["loss"], rel=1e-5), name
        for rank, r in enumerate(per_rank):
            err = (r[name]["grads"] - ref["grads"]).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
