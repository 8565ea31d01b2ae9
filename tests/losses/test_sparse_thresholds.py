"""The sparse loss's regulariser thresholds are settings: readable, checked when set, and
effective: an assignment gives the loss of sentence-transformers' SpladeLoss built with that threshold."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sparse_encoder.losses import (
    FlopsLoss,
    SparseMultipleNegativesRankingLoss,
    SpladeLoss,
)

from st_cached_losses import CachedSparseLoss
from tests.support.tiny_model import make_tiny_splade, random_texts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_splade(tmp_path_factory.mktemp("thresholds") / "splade", bias=-0.05)


def _components(model, loss) -> dict[str, float]:
    texts = [random_texts(6, seed=1), random_texts(6, seed=2)]
    with torch.no_grad():
        return {k: float(v) for k, v in loss([model.preprocess(t) for t in texts], None).items()}


def _loss(model, **kwargs) -> CachedSparseLoss:
    base = SparseMultipleNegativesRankingLoss(model)
    return CachedSparseLoss(model, base, 3e-5, query_regularizer_weight=5e-5, mini_batch_size=2, **kwargs)


def test_thresholds_read_back(model):
    loss = _loss(model, document_regularizer_threshold=7, query_regularizer_threshold=3)
    assert (loss.document_regularizer_threshold, loss.query_regularizer_threshold) == (7, 3)
    assert _loss(model).document_regularizer_threshold is None


@pytest.mark.parametrize("kind", ["document", "query"])
def test_an_assigned_threshold_takes_effect(model, kind):
    model.eval()
    name = f"{kind}_regularizer_threshold"
    # a threshold among the rows' counts of non-zero entries, so that it drops some rows and keeps others
    with torch.no_grad():
        counts = (
            model.encode(
                random_texts(6, seed=1 if kind == "query" else 2),
                convert_to_tensor=True,
                convert_to_sparse_tensor=False,
            )
            > 0
        ).sum(1)
    threshold = int(counts.float().median())
    loss = _loss(model)
    before = _components(model, loss)
    setattr(loss, name, threshold)
    assert getattr(loss, name) == threshold
    assert getattr(loss, f"{kind}_regularizer").threshold == threshold
    after = _components(model, loss)
    theirs = SpladeLoss(
        model,
        SparseMultipleNegativesRankingLoss(model),
        3e-5,
        query_regularizer_weight=5e-5,
        **{name: threshold},
    )
    expected = _components(model, theirs)
    key = f"{kind}_regularizer_loss"
    assert after[key] == pytest.approx(expected[key], rel=1e-5)
    assert after[key] != pytest.approx(before[key], rel=1e-3)  # not vacuous: the threshold dropped rows
    assert loss.get_config_dict()[name] == threshold
    setattr(loss, name, None)
    assert _components(model, loss)[key] == pytest.approx(before[key], rel=1e-6)


@pytest.mark.parametrize("value", [-1, float("nan"), "10", True])
def test_invalid_thresholds_are_refused(model, value):
    loss = _loss(model)
    with pytest.raises(ValueError, match="document_regularizer_threshold must be"):
        loss.document_regularizer_threshold = value
    assert loss.document_regularizer_threshold is None


def test_query_threshold_needs_a_query_regularizer(model):
    base = SparseMultipleNegativesRankingLoss(model)
    loss = CachedSparseLoss(model, base, 3e-5, use_document_regularizer_only=True)
    assert loss.query_regularizer_threshold is None
    with pytest.raises(ValueError, match="use_document_regularizer_only"):
        loss.query_regularizer_threshold = 5


def test_a_regularizer_without_threshold_refuses_one(model):
    class Other(torch.nn.Module):
        def compute_loss_from_embeddings(self, embeddings):
            return embeddings.abs().sum()

    base = SparseMultipleNegativesRankingLoss(model)
    loss = CachedSparseLoss(
        model, base, 3e-5, document_regularizer=Other(), query_regularizer=FlopsLoss(model)
    )
    assert loss.document_regularizer_threshold is None
    with pytest.raises(ValueError, match="no threshold"):
        loss.document_regularizer_threshold = 5
