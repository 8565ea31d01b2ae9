"""CachedMultiVectorDistillKLDivLoss / CachedMultiVectorMarginMSELoss against sentence-transformers' non-cached
MultiVectorDistillKLDivLoss / MultiVectorMarginMSELoss (the oracle) on a tiny random multi-vector model: the
same loss and parameter gradients for MaxSim, MeanMaxSim and XTR, teacher scores and margins, temperatures,
mini-batches that do not divide the batch; the in-batch InfoNCE term against a naive reference."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sentence_transformers import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.losses import (
    MultiVectorDistillKLDivLoss,
    MultiVectorMarginMSELoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import (
    XTRKDScores,
    colbert_scores_pairwise,
    mean_colbert_kd_scores,
    mean_colbert_scores_pairwise,
    xtr_kd_scores,
    xtr_scores_pairwise,
)

from st_cached_losses import CachedMultiVectorDistillKLDivLoss, CachedMultiVectorMarginMSELoss
from tests.losses.test_cached_multi_vector import mv_features
from tests.losses.test_losses import assert_grads_close, param_grads
from tests.support.st_version import ST_6_3
from tests.support.tiny_model import make_tiny_multi_vector

B = 5


@pytest.fixture(scope="module")
def mv_model(tmp_path_factory) -> MultiVectorEncoder:
    return make_tiny_multi_vector(tmp_path_factory.mktemp("mv_distill") / "bert")


def teacher_scores(b: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, n, generator=torch.Generator().manual_seed(seed)) * 3.0


@pytest.mark.parametrize(
    ("similarity_fct", "temps"),
    [
        (None, {}),
        (mean_colbert_kd_scores, {"temperature": 0.5}),
        (partial(xtr_kd_scores, top_k=6), {"student_temperature": 2.0, "teacher_temperature": 0.7}),
        (XTRKDScores(top_k=4), {}),
    ],
    ids=["maxsim", "meanmaxsim", "xtr-partial", "xtr-kd-class"],
)
@pytest.mark.parametrize("n_cols", [3, 4])
def test_kl_matches_st(mv_model, similarity_fct, temps, n_cols):
    feats = mv_features(mv_model, B, n_cols, seed=1)
    labels = teacher_scores(B, n_cols - 1)
    theirs = MultiVectorDistillKLDivLoss(mv_model, similarity_fct=similarity_fct, **temps)
    ref_loss, ref = param_grads(mv_model, lambda f: theirs(f, labels), feats)
    ours = CachedMultiVectorDistillKLDivLoss(
        mv_model, similarity_fct=similarity_fct, **temps, mini_batch_size=2
    )
    loss, got = param_grads(mv_model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


@pytest.mark.parametrize(
    "similarity_fct",
    [None, mean_colbert_scores_pairwise, partial(xtr_scores_pairwise, top_k=5)],
    ids=["maxsim", "meanmaxsim", "xtr"],
)
@pytest.mark.parametrize("labels_as", ["scores", "margins"])
def test_margin_mse_matches_st(mv_model, similarity_fct, labels_as):
    feats = mv_features(mv_model, B, 4, seed=2)
    scores = teacher_scores(B, 3, seed=3)
    labels = scores if labels_as == "scores" else scores[:, :1] - scores[:, 1:]
    theirs = MultiVectorMarginMSELoss(mv_model, similarity_fct=similarity_fct)
    ref_loss, ref = param_grads(mv_model, lambda f: theirs(f, labels), feats)
    ours = CachedMultiVectorMarginMSELoss(mv_model, similarity_fct=similarity_fct, mini_batch_size=2)
    loss, got = param_grads(mv_model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_margin_mse_one_negative_1d_margins(mv_model):
    feats = mv_features(mv_model, B, 3, seed=4)
    labels = teacher_scores(B, 1, seed=5)[:, 0]
    theirs = MultiVectorMarginMSELoss(mv_model, similarity_fct=colbert_scores_pairwise)
    ref_loss, ref = param_grads(mv_model, lambda f: theirs(f, labels), feats)
    ours = CachedMultiVectorMarginMSELoss(mv_model, mini_batch_size=2)
    loss, got = param_grads(mv_model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


@pytest.mark.parametrize(
    "cls", [CachedMultiVectorDistillKLDivLoss, CachedMultiVectorMarginMSELoss], ids=["kl", "margin"]
)
def test_weighted_infonce_matches_naive_reference(mv_model, cls):
    """The distillation loss plus ``w`` times sentence-transformers' own in-batch MaxSim InfoNCE."""
    feats = mv_features(mv_model, B, 4, seed=6)
    labels = teacher_scores(B, 3, seed=7)
    weight, scale = 0.4, 0.5
    theirs = (
        MultiVectorDistillKLDivLoss(mv_model)
        if cls is CachedMultiVectorDistillKLDivLoss
        else MultiVectorMarginMSELoss(mv_model)
    )
    nce = MultiVectorMultipleNegativesRankingLoss(mv_model, scale=scale)
    ref_loss, ref = param_grads(mv_model, lambda f: theirs(f, labels) + weight * nce(f, None), feats)
    ours = cls(mv_model, mini_batch_size=2, infonce_weight=weight, infonce_scale=scale)
    loss, got = param_grads(mv_model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)
    plain = cls(mv_model, mini_batch_size=2, infonce_weight=0.0, infonce_scale=scale)
    plain_loss, plain_grads = param_grads(mv_model, lambda f: plain(f, labels), feats)
    base_loss, base_grads = param_grads(mv_model, lambda f: theirs(f, labels), feats)
    torch.testing.assert_close(plain_loss, base_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(plain_grads, base_grads)


def test_config_and_refusals(mv_model):
    loss = CachedMultiVectorDistillKLDivLoss(mv_model, temperature=2.0, mini_batch_size=4)
    assert loss.get_config_dict() == {
        # the installed release's default, as theirs writes it: None from 6.3 (model.similarity_pairwise)
        "similarity_fct": None if ST_6_3 else "colbert_kd_scores",
        "temperature": 2.0,
        "mini_batch_size": 4,
    }
    margin = CachedMultiVectorMarginMSELoss(mv_model, similarity_fct=partial(xtr_scores_pairwise, top_k=3))
    assert margin.score.top_k == 3
    with pytest.raises(ValueError, match="is not supported"):
        CachedMultiVectorMarginMSELoss(mv_model, similarity_fct=xtr_kd_scores)
