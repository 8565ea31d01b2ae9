"""Sparse distillation: CachedSparseLoss with sentence-transformers' SparseDistillKLDivLoss / SparseMarginMSELoss as
its base loss against their non-cached SpladeLoss with the same base loss (the oracle): the loss's components and
the parameter gradients on a tiny random SPLADE model, teacher scores and margins, temperatures, on one process
and on 3 gloo processes (DDP, equal batches) against one process on the global batch."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sparse_encoder import losses as sparse_losses
from torch.nn.parallel import DistributedDataParallel as DDP

from st_cached_losses import CachedSparseLoss
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_splade, random_texts

B = 7
WEIGHTS = {"document_regularizer_weight": 0.8, "query_regularizer_weight": 0.5}
BASES = {
    "kl": (sparse_losses.SparseDistillKLDivLoss, {}),
    "kl_temps": (
        sparse_losses.SparseDistillKLDivLoss,
        {"student_temperature": 0.5, "teacher_temperature": 3.0},
    ),
    "margin": (sparse_losses.SparseMarginMSELoss, {}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sparse_distill")
    model = make_tiny_splade(base / "bert")
    model.save(str(base / "splade"))
    return str(base / "splade")


def load(path: str):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(path, device="cpu")


def batch(n_rows: int, n_cols: int, seed: int = 0) -> tuple[list[list[str]], torch.Tensor]:
    texts = [random_texts(n_rows, seed=seed + 17 * k) for k in range(n_cols)]
    return texts, torch.randn(n_rows, n_cols - 1, generator=torch.Generator().manual_seed(seed)) * 3


def run(model, loss_fn, features, labels):
    model.zero_grad(set_to_none=True)
    parts = loss_fn(features, labels)
    torch.stack(list(parts.values())).sum().backward()
    return {k: v.detach() for k, v in parts.items()}, flat_grads(model).clone()


@pytest.mark.parametrize("labels_as", ["scores", "margins"])
@pytest.mark.parametrize("base", list(BASES))
def test_matches_splade_loss(model_dir, base, labels_as):
    if labels_as == "margins" and base != "margin":
        pytest.skip("margins are the margin loss's")
    model = load(model_dir)
    cls, kwargs = BASES[base]
    texts, labels = batch(B, 4)
    if labels_as == "margins":
        labels = labels[:, :1] - labels[:, 1:]
    features = [model.preprocess(t) for t in texts]
    ref_parts, ref = run(
        model, sparse_losses.SpladeLoss(model, cls(model, **kwargs), **WEIGHTS), features, labels
    )
    ours = CachedSparseLoss(model, cls(model, **kwargs), **WEIGHTS, mini_batch_size=3)
    parts, got = run(model, ours, features, labels)
    assert parts.keys() == ref_parts.keys()
    for key in ref_parts:
        torch.testing.assert_close(parts[key], ref_parts[key], rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def _worker(rank: int, world: int, path: str, names: list[str], sizes: list[int]) -> dict:
    assert torch.distributed.get_world_size() == world
    out = {}
    for name in names:
        cls, kwargs = BASES[name]
        model = load(path)
        ddp = DDP(model)
        loss = CachedSparseLoss(model, cls(model, **kwargs), **WEIGHTS, mini_batch_size=2)
        loss.model = ddp
        texts, labels = batch(sum(sizes), 3, seed=1)
        rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        parts = loss([model.preprocess(t[rows]) for t in texts], labels[rows])
        torch.stack(list(parts.values())).sum().backward()
        out[name] = {"loss": sum(v.item() for v in parts.values()), "grads": flat_grads(model)}
    return out


def test_three_processes_equal_their_loss_under_ddp(model_dir):
    """Their SpladeLoss under DDP (without gathering) is each process's loss of its own rows, gradients averaged:
    the reference is that average, computed in one process, rank by rank."""
    sizes = [3, 3, 3]
    names = list(BASES)
    per_rank = run_distributed(_worker, 3, model_dir, names, sizes)
    for name in names:
        cls, kwargs = BASES[name]
        model = load(model_dir)
        texts, labels = batch(sum(sizes), 3, seed=1)
        losses, grads = [], []
        for rank in range(3):
            rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            parts, g = run(
                model,
                sparse_losses.SpladeLoss(model, cls(model, **kwargs), **WEIGHTS),
                [model.preprocess(t[rows]) for t in texts],
                labels[rows],
            )
            losses.append(sum(v.item() for v in parts.values()))
            grads.append(g)
        ref = torch.stack(grads).mean(0)
        assert ref.abs().max() > 0
        tol = 1e-5 * ref.abs().max().item()
        for rank, r in enumerate(per_rank):
            assert r[name]["loss"] == pytest.approx(losses[rank], rel=1e-5), f"{name} rank {rank}"
            err = (r[name]["grads"] - ref).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
