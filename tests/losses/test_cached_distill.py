"""CachedDistillKLDivLoss / CachedMarginMSELoss against sentence-transformers' non-cached DistillKLDivLoss /
MarginMSELoss (the oracle) on a tiny random BERT: the same loss and parameter gradients for teacher scores
and margins, temperatures, similarities and mini-batches that do not divide the batch; the weighted
in-batch InfoNCE term (weight 0: the plain loss; weight w: a naive reference); evaluation; settings,
config and refusals."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.util import pairwise_cos_sim, pairwise_dot_score

from st_cached_losses import CachedDistillKLDivLoss, CachedMarginMSELoss
from tests.losses.test_losses import assert_grads_close, param_grads
from tests.support.reference import reference_infonce
from tests.support.tiny_model import make_tiny_model, random_texts

B = 7  # rows: mini-batch size 3 does not divide it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_distill") / "bert", dropout=0.0)


def columns(model, n_cols: int, b: int = B, seed: int = 0):
    return [model.preprocess(random_texts(b, seed=seed + 100 * k)) for k in range(n_cols)]


def teacher_scores(b: int, n: int, seed: int = 0, spread: float = 5.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, generator=g) * spread


@pytest.mark.parametrize("n_cols", [3, 5], ids=["1neg", "3neg"])
@pytest.mark.parametrize(
    ("temps", "similarity_fct"),
    [
        ({}, pairwise_dot_score),
        ({"temperature": 2.0}, pairwise_cos_sim),
        ({"temperature": 2.0, "student_temperature": 0.5, "teacher_temperature": 3.0}, pairwise_dot_score),
    ],
    ids=["default", "t2-cos", "student-teacher"],
)
@pytest.mark.parametrize("mini_batch_size", [3, 32], ids=["mb3", "one-mini-batch"])
def test_kl_matches_st(model, n_cols, temps, similarity_fct, mini_batch_size):
    feats = columns(model, n_cols)
    labels = teacher_scores(B, n_cols - 1)
    theirs = st_losses.DistillKLDivLoss(model, similarity_fct, **temps)
    ref_loss, ref = param_grads(model, lambda f: theirs(f, labels), feats)
    ours = CachedDistillKLDivLoss(model, similarity_fct, **temps, mini_batch_size=mini_batch_size)
    loss, got = param_grads(model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


@pytest.mark.parametrize("n_cols", [3, 5], ids=["1neg", "3neg"])
@pytest.mark.parametrize("labels_as", ["scores", "margins", "1d"])
@pytest.mark.parametrize("similarity_fct", [pairwise_dot_score, pairwise_cos_sim], ids=["dot", "cos"])
def test_margin_mse_matches_st(model, n_cols, labels_as, similarity_fct):
    if labels_as == "1d" and n_cols != 3:
        pytest.skip("1D margins: one negative only")
    feats = columns(model, n_cols, seed=3)
    scores = teacher_scores(B, n_cols - 1, seed=1)
    labels = {
        "scores": scores,
        "margins": scores[:, :1] - scores[:, 1:],
        "1d": scores[:, 0] - scores[:, 1],
    }[labels_as]
    theirs = st_losses.MarginMSELoss(model, similarity_fct)
    ref_loss, ref = param_grads(model, lambda f: theirs(f, labels), feats)
    ours = CachedMarginMSELoss(model, similarity_fct, mini_batch_size=3)
    loss, got = param_grads(model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def _naive_combined(model, objective, labels, weight, scale, similarity):
    """The non-cached sentence-transformers loss plus ``weight`` times the naive dense InfoNCE (positive:
    the first candidate column; every column of every row a candidate)."""
    st = (
        st_losses.DistillKLDivLoss(model, pairwise_dot_score if similarity == "dot" else pairwise_cos_sim)
        if objective == "kl"
        else st_losses.MarginMSELoss(model, pairwise_dot_score if similarity == "dot" else pairwise_cos_sim)
    )

    def fn(features):
        embs = [model(dict(f))["sentence_embedding"] for f in features]
        distill = st.compute_loss_from_embeddings(embs, labels)
        nce = reference_infonce(embs[0], embs[1:], scale=scale, similarity=similarity)
        return distill + weight * nce

    return fn


@pytest.mark.parametrize("cls", [CachedDistillKLDivLoss, CachedMarginMSELoss], ids=["kl", "margin"])
@pytest.mark.parametrize(("weight", "similarity"), [(0.3, "dot"), (1.0, "cosine")])
def test_weighted_infonce_matches_naive_reference(model, cls, weight, similarity):
    feats = columns(model, 4, seed=5)
    labels = teacher_scores(B, 3, seed=2)
    objective = "kl" if cls is CachedDistillKLDivLoss else "margin"
    scale = 0.5 if similarity == "dot" else 20.0
    ref_loss, ref = param_grads(
        model, _naive_combined(model, objective, labels, weight, scale, similarity), feats
    )
    fn = pairwise_dot_score if similarity == "dot" else pairwise_cos_sim
    ours = cls(model, fn, mini_batch_size=3, infonce_weight=weight, infonce_scale=scale)
    loss, got = param_grads(model, lambda f: ours(f, labels), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)
    # and the term changes something: the plain loss differs
    plain, _ = param_grads(model, lambda f: cls(model, fn, mini_batch_size=3)(f, labels), feats)
    assert abs(plain.item() - loss.item()) > 1e-3


@pytest.mark.parametrize("cls", [CachedDistillKLDivLoss, CachedMarginMSELoss], ids=["kl", "margin"])
def test_weight_zero_is_the_plain_loss_exactly(model, cls):
    feats = columns(model, 4, seed=6)
    labels = teacher_scores(B, 3, seed=4)
    plain, g_plain = param_grads(model, lambda f: cls(model, mini_batch_size=3)(f, labels), feats)
    zero = cls(model, mini_batch_size=3, infonce_weight=0.0, infonce_scale=50.0)
    loss, got = param_grads(model, lambda f: zero(f, labels), feats)
    assert loss.item() == plain.item()
    assert torch.equal(got, g_plain)


def test_evaluation_without_grad_is_the_same_loss(model):
    feats = columns(model, 4, seed=7)
    labels = teacher_scores(B, 3, seed=5)
    loss = CachedDistillKLDivLoss(model, mini_batch_size=3, infonce_weight=0.5, infonce_scale=1.0)
    with torch.no_grad():
        evaluated = loss(feats, labels)
    trained, _ = param_grads(model, lambda f: loss(f, labels), feats)
    torch.testing.assert_close(evaluated, trained, rtol=1e-6, atol=1e-7)


def test_many_columns_that_each_fit_in_one_mini_batch_are_cached(model):
    """Issue 44: a query, a positive and 31 hard negatives (33 columns) of 4 rows at mini_batch_size=4.
    Every column fits in one mini-batch, the batch (132 rows) does not: it is cached, one column's graph at
    a time (each stage-1 graph but the last dropped at once and its column replayed in backward: 65
    forwards), not every column's graph held at once as the non-cached loss does (33 forwards): less than
    half their peak memory. Still exactly theirs."""
    from tests.losses.test_losses import _count_forwards
    from tests.support.memory import PeakMemory

    n_cols, b = 33, 4
    feats = columns(model, n_cols, b=b, seed=11)
    labels = teacher_scores(b, n_cols - 1, seed=6)
    theirs = st_losses.DistillKLDivLoss(model)
    with PeakMemory() as their_mem:
        ref_loss, ref = param_grads(model, lambda f: theirs(f, labels), feats)
    ours = CachedDistillKLDivLoss(model, mini_batch_size=b)
    calls, handle = _count_forwards(model)
    try:
        with PeakMemory() as our_mem:
            loss, got = param_grads(model, lambda f: ours(f, labels), feats)
    finally:
        handle.remove()
    assert calls == {"no_grad": 0, "grad": n_cols + (n_cols - 1)}
    assert our_mem.peak_bytes < their_mem.peak_bytes / 2, (our_mem.peak_bytes, their_mem.peak_bytes)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_a_whole_batch_that_fits_in_one_mini_batch_is_not_cached(model):
    """3 columns x 2 rows at mini_batch_size 8: every forward keeps its graph (no replay), exactly theirs."""
    from tests.losses.test_losses import _count_forwards

    feats = columns(model, 3, b=2, seed=12)
    labels = teacher_scores(2, 2, seed=7)
    ref_loss, ref = param_grads(model, lambda f: st_losses.DistillKLDivLoss(model)(f, labels), feats)
    calls, handle = _count_forwards(model)
    try:
        loss, got = param_grads(
            model, lambda f: CachedDistillKLDivLoss(model, mini_batch_size=8)(f, labels), feats
        )
    finally:
        handle.remove()
    assert calls == {"no_grad": 0, "grad": 3}
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_settings_config_and_refusals(model):
    loss = CachedDistillKLDivLoss(model, temperature=2.0, teacher_temperature=4.0, mini_batch_size=4)
    assert (loss.student_temperature, loss.teacher_temperature) == (2.0, 4.0)
    assert loss.get_config_dict() == {
        "similarity_fct": "pairwise_dot_score",
        "temperature": 2.0,
        "teacher_temperature": 4.0,
    }
    loss.infonce_weight = 0.2
    assert loss.get_config_dict()["infonce_weight"] == 0.2
    assert loss.get_config_dict()["infonce_scale"] == 20.0
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        loss.temperature = 0.0
    with pytest.raises(ValueError, match="infonce_weight must be a finite number >= 0"):
        loss.infonce_weight = -1.0
    custom = CachedMarginMSELoss(model, lambda a, b: -(a - b).norm(dim=-1))
    with pytest.raises(ValueError, match=r"infonce_weight=0\.5 needs an in-batch score"):
        custom.infonce_weight = 0.5
    with pytest.raises(ValueError, match=r"expects teacher scores of shape \(batch_size, N\) = \(7, 3\)"):
        CachedDistillKLDivLoss(model)(columns(model, 4), teacher_scores(B, 4))
    with pytest.raises(ValueError, match=r"expected \(7, 2\) margins or \(7, 3\) scores"):
        CachedMarginMSELoss(model)(columns(model, 4), teacher_scores(B, 1))
    with pytest.raises(ValueError, match="at least 3 columns"):
        CachedMarginMSELoss(model)(columns(model, 2), teacher_scores(B, 1))
