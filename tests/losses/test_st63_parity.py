"""sentence-transformers 6.3's semantics, with ours: a row is never its own negative in GIST (self-guided and
with a guide, both margin strategies, inside ``MatryoshkaLoss``), the multi-vector losses' default score is the
model's own (``model.similarity``), and the cached losses inside 6.3's ``MatryoshkaLoss`` (dense, bf16, behind a
``.loss`` wrapper) and ``MultiVectorMatryoshkaLoss``: loss and parameter gradients against 6.3's own classes.

The GIST cases take a negative margin, where the guide's mask keeps a row's own anchor-anchor and
positive-positive entries, so that 6.2's semantics (which kept them) and 6.3's differ there; each such test
also checks ours against a dense reference of 6.3's rule written here, and that 6.2's rule gives another loss
(so the comparison can fail), whichever release is installed. The comparisons with 6.3's classes run with 6.3
installed (skipped with 6.2, the floor, whose classes hold the other semantics). Two processes: see
tests/losses/test_gist.py::test_two_processes_own_rows_are_not_negatives and
tests/losses/test_cached_multi_vector.py's process tests (against the installed release's loss)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from torch import nn

from st_cached_losses import CachedGISTLoss, CachedMNRLoss, CachedMultiVectorLoss
from st_cached_losses.functional.representations.multi_vector import MaxSim
from tests.losses.test_losses import assert_grads_close, param_grads
from tests.support.st_version import ST_6_3, ST_VERSION
from tests.support.tiny_model import make_tiny_model, make_tiny_multi_vector, random_texts

NEEDS_6_3 = pytest.mark.skipif(
    not ST_6_3, reason=f"compares with sentence-transformers 6.3's classes; {ST_VERSION} is installed"
)
B = 7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("st63")
    model = make_tiny_model(base / "model", dropout=0.0, seed=0)
    guide = make_tiny_model(base / "guide", dropout=0.0, seed=5, hidden=24)
    return model, guide


def _features(model, n_cols: int, seed: int = 0) -> list[dict]:
    return [model.preprocess(random_texts(B, seed=seed + 13 * k, max_words=8)) for k in range(n_cols)]


def _naive_gist(embs, guide_embs, temperature, strategy, margin, own_rows_removed: bool) -> torch.Tensor:
    """GISTEmbedLoss on one process, dense: anchor-positive, anchor-anchor, positive-positive and
    anchor-negative blocks, entries the guide rates above the row's positive (less the margin) removed, never
    the positive; ``own_rows_removed``: 6.3's rule (a row's own anchor-anchor / positive-positive entry
    removed), else 6.2's (kept unless the guide's mask removes it)."""
    a, p, *negs = (F.normalize(e, dim=-1) for e in embs)
    ga, gp, *gn = (F.normalize(e, dim=-1).detach() for e in guide_embs)
    g_pos = (ga * gp).sum(-1, keepdim=True)
    thr = g_pos - margin if strategy == "absolute" else g_pos - g_pos.abs() * margin
    eye = torch.eye(len(a), dtype=torch.bool)
    own = eye if own_rows_removed else torch.zeros_like(eye)
    blocks = [(a @ p.T, ((ga @ gp.T) > thr) & ~eye)]
    blocks.append((a @ a.T, ((ga @ ga.T) > thr) | own))
    blocks.append((p @ p.T, ((gp @ gp.T) > thr) | own))
    blocks += [(a @ n.T, (ga @ g.T) > thr) for n, g in zip(negs, gn)]
    scores = torch.cat([s.masked_fill(m, -torch.inf) for s, m in blocks], dim=1) / temperature
    return F.cross_entropy(scores, torch.arange(len(a)))


def _naive_fn(model, guide, strategy, margin, own_rows_removed):
    def fn(features):
        embs = [model(dict(f))["sentence_embedding"] for f in features]
        with torch.no_grad():
            guide_embs = (
                [guide(dict(f))["sentence_embedding"] for f in features] if guide is not model else embs
            )
        return _naive_gist(embs, guide_embs, 0.05, strategy, margin, own_rows_removed)

    return fn


CASES = [("absolute", -0.1), ("relative", -0.1)]


@pytest.mark.parametrize("guided", [True, False], ids=["guide", "self_guided"])
@pytest.mark.parametrize(("strategy", "margin"), CASES, ids=["absolute", "relative"])
@pytest.mark.parametrize("n_cols", [2, 3])
def test_gist_rows_are_never_their_own_negatives(models, guided, strategy, margin, n_cols):
    """Ours (chunked, mini-batches of 3 of 7 rows) equals 6.3's rule, written densely, in loss and parameter
    gradients; 6.2's rule gives another loss here."""
    model, guide = models
    feats = _features(model, n_cols, seed=n_cols)
    options = {"margin_strategy": strategy, "margin": margin}
    ours_fn = CachedGISTLoss(model, guide if guided else None, 0.05, 3, **options)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    reference = model if not guided else guide
    ref_loss, ref = param_grads(model, _naive_fn(model, reference, strategy, margin, True), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)
    with torch.no_grad():
        old = float(_naive_fn(model, reference, strategy, margin, False)(feats))
    assert old != pytest.approx(float(ref_loss), rel=1e-3), "the case does not tell 6.2's rule from 6.3's"
    model.zero_grad(set_to_none=True)


@NEEDS_6_3
@pytest.mark.parametrize("guided", [True, False], ids=["guide", "self_guided"])
@pytest.mark.parametrize(
    ("strategy", "margin"), [*CASES, ("absolute", 0.03)], ids=["absolute", "relative", "abs+"]
)
@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_gist_equals_63s_gist_losses(models, guided, strategy, margin, path):
    """Against 6.3's GISTEmbedLoss and CachedGISTEmbedLoss (self-guided: theirs with a frozen copy of the
    model as the guide, equal on a model without dropout)."""
    model, guide = models
    their_guide = guide if guided else copy.deepcopy(model)
    feats = _features(model, 3, seed=5)
    options = {"margin_strategy": strategy, "margin": margin}
    ours_fn = CachedGISTLoss(model, guide if guided else None, 0.05, 3, **options, path=path, tile_size=4)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    for theirs_fn in (
        GISTEmbedLoss(model, their_guide, 0.05, **options),
        CachedGISTEmbedLoss(model, their_guide, 0.05, mini_batch_size=3, **options),
    ):
        ref_loss, ref = param_grads(model, lambda f, fn=theirs_fn: fn(f, None), feats)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5), type(theirs_fn).__name__
        assert_grads_close(ours, ref)


class _Wrapper(nn.Module):
    """A loss behind a ``.loss`` attribute (a user's wrapper, as 6.3's ``resolve_gradient_cache_loss``
    follows): it reports the inner loss's gradient caching and calls it."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss
        self.uses_gradient_cache = getattr(loss, "uses_gradient_cache", False)

    def forward(self, features, labels=None):
        return self.loss(features, labels)


DIMS, WEIGHTS = [32, 16, 8], [1.0, 0.5, 2.0]


@NEEDS_6_3
@pytest.mark.parametrize("guided", [True, False], ids=["guide", "self_guided"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "behind_loss"])
def test_gist_inside_63s_matryoshka(models, guided, wrapped):
    """MatryoshkaLoss(CachedGISTLoss) equals MatryoshkaLoss(GISTEmbedLoss) (6.3), margin -0.1: every width
    with its own rows removed; also with ours behind a ``.loss`` wrapper (6.3 finds ``calculate_loss``)."""
    model, guide = models
    their_guide = guide if guided else copy.deepcopy(model)
    feats = _features(model, 3, seed=8)
    ours_loss = CachedGISTLoss(model, guide if guided else None, 0.05, 3, margin=-0.1)
    ours_fn = MatryoshkaLoss(model, _Wrapper(ours_loss) if wrapped else ours_loss, DIMS, WEIGHTS)
    theirs_fn = MatryoshkaLoss(model, GISTEmbedLoss(model, their_guide, 0.05, margin=-0.1), DIMS, WEIGHTS)
    ref_loss, ref = param_grads(model, lambda f: theirs_fn(f, None), feats)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


@NEEDS_6_3
@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "behind_loss"])
def test_mnrl_inside_63s_matryoshka_behind_a_wrapper(models, wrapped):
    model, _ = models
    feats = _features(model, 3, seed=9)
    ours_loss = CachedMNRLoss(model, mini_batch_size=3)
    ours_fn = MatryoshkaLoss(model, _Wrapper(ours_loss) if wrapped else ours_loss, DIMS, WEIGHTS)
    theirs_fn = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), DIMS, WEIGHTS)
    ref_loss, ref = param_grads(model, lambda f: theirs_fn(f, None), feats)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


@NEEDS_6_3
def test_bf16_matryoshka_is_as_close_as_theirs(models):
    """A bf16 model inside 6.3's MatryoshkaLoss (which normalises bf16 truncations in fp32): ours is no
    further from the fp32 loss and gradients than 6.3's non-cached loss on the same bf16 model is (x2)."""
    model, _ = models
    feats = _features(model, 3, seed=10)
    ref_model = copy.deepcopy(model)
    ref_loss, ref = param_grads(
        ref_model,
        lambda f: MatryoshkaLoss(ref_model, MultipleNegativesRankingLoss(ref_model), DIMS)(f, None),
        feats,
    )
    low = copy.deepcopy(model).to(torch.bfloat16)
    their_loss, theirs = param_grads(
        low, lambda f: MatryoshkaLoss(low, MultipleNegativesRankingLoss(low), DIMS)(f, None), feats
    )
    ours_fn = MatryoshkaLoss(low, CachedMNRLoss(low, mini_batch_size=3), DIMS)
    loss, ours = param_grads(low, lambda f: ours_fn(f, None), feats)
    assert torch.isfinite(loss) and ours.abs().max() > 0
    their_err = abs(float(their_loss) - float(ref_loss))
    assert abs(float(loss) - float(ref_loss)) <= 2 * their_err + 1e-3
    their_grad_err = (theirs.float() - ref).norm() / ref.norm()
    our_grad_err = (ours.float() - ref).norm() / ref.norm()
    assert our_grad_err <= 2 * their_grad_err + 1e-3, (float(our_grad_err), float(their_grad_err))


# --------------------------------------------------------------------------- multi-vector


@pytest.fixture(scope="module")
def mv_model(tmp_path_factory):
    return make_tiny_multi_vector(tmp_path_factory.mktemp("st63mv") / "bert")


def _mv_features(model, n: int, n_cols: int, seed: int = 0) -> list[dict]:
    return [
        {
            **model.preprocess(random_texts(n, seed=seed + k, min_words=1, max_words=20), task=task),
            "task": task,
        }
        for k, task in enumerate(["query"] + ["document"] * (n_cols - 1))
    ]


def test_multi_vector_default_score_follows_the_model(mv_model):
    """similarity_fct=None: MeanMaxSim for a "meanmaxsim" model with 6.3 (MaxSim with 6.2, its default),
    followed when the model's similarity_fn_name changes after the loss was built."""
    model = copy.deepcopy(mv_model)
    loss = CachedMultiVectorLoss(model, mini_batch_size=3)
    assert model.similarity_fn_name == "maxsim" and loss.similarity == MaxSim(False)
    model.similarity_fn_name = "meanmaxsim"
    assert loss.similarity == MaxSim(ST_6_3)
    feats = _mv_features(model, 5, 2, seed=1)
    value, grads = param_grads(model, lambda f: loss(f), feats)
    explicit = CachedMultiVectorLoss(
        model, similarity_fct="meanmaxsim" if ST_6_3 else "maxsim", mini_batch_size=3
    )
    want, want_grads = param_grads(model, lambda f: explicit(f), feats)
    torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7)
    assert_grads_close(grads, want_grads)
    model.similarity_fn_name = "maxsim"
    plain = CachedMultiVectorLoss(model, similarity_fct="maxsim", mini_batch_size=3)
    with torch.no_grad():
        torch.testing.assert_close(loss(feats), plain(feats), rtol=1e-6, atol=1e-7)
        if ST_6_3:
            assert float(loss(feats)) != pytest.approx(float(want), rel=1e-3)


@NEEDS_6_3
@pytest.mark.parametrize("similarity_fn_name", ["maxsim", "meanmaxsim"])
@pytest.mark.parametrize("expansion", [False, True], ids=["plain", "expansion"])
def test_multi_vector_default_equals_63s_cached_loss(mv_model, similarity_fn_name, expansion):
    """The default score (model.similarity) with query expansion and ragged widths, against 6.3's
    CachedMultiVectorMultipleNegativesRankingLoss and non-cached loss; the config reads as theirs."""
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
        MultiVectorMultipleNegativesRankingLoss,
    )

    model = copy.deepcopy(mv_model)
    model.similarity_fn_name = similarity_fn_name
    if expansion:
        model[0].query_expansion = {"strategy": "fixed", "attend": False, "length": 24}
    feats = _mv_features(model, 7, 3, seed=4)
    ours_fn = CachedMultiVectorLoss(model, scale=5.0, mini_batch_size=3)
    loss, ours = param_grads(model, lambda f: ours_fn(f), feats)
    for theirs_fn in (
        CachedMultiVectorMultipleNegativesRankingLoss(model, scale=5.0, mini_batch_size=3),
        MultiVectorMultipleNegativesRankingLoss(model, scale=5.0),
    ):
        ref_loss, ref = param_grads(model, lambda f, fn=theirs_fn: fn(f), feats)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_close(ours, ref)
    theirs_config = CachedMultiVectorMultipleNegativesRankingLoss(model, scale=5.0, mini_batch_size=3)
    assert ours_fn.get_config_dict() == theirs_config.get_config_dict()


@NEEDS_6_3
@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "behind_loss"])
def test_multi_vector_inside_63s_multi_vector_matryoshka(mv_model, wrapped):
    """MultiVectorMatryoshkaLoss (new in 6.3) over ours equals it over 6.3's cached and non-cached losses:
    each width's token embeddings truncated and normalised (ours hands the wrapper the token embeddings, the
    masks kept aside)."""
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
        MultiVectorMatryoshkaLoss,
        MultiVectorMultipleNegativesRankingLoss,
    )

    model = copy.deepcopy(mv_model)
    dim = (
        model[0].get_word_embedding_dimension() if hasattr(model[0], "get_word_embedding_dimension") else None
    )
    dims = [d for d in (32, 16, 8) if dim is None or d <= dim]
    feats = _mv_features(model, 7, 3, seed=6)
    ours_loss = CachedMultiVectorLoss(model, mini_batch_size=3)
    ours_fn = MultiVectorMatryoshkaLoss(
        model, _Wrapper(ours_loss) if wrapped else ours_loss, dims, [1.0, 0.5, 2.0]
    )
    loss, ours = param_grads(model, lambda f: ours_fn(f), feats)
    for inner in (
        CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=3),
        MultiVectorMultipleNegativesRankingLoss(model),
    ):
        theirs_fn = MultiVectorMatryoshkaLoss(model, inner, dims, [1.0, 0.5, 2.0])
        ref_loss, ref = param_grads(model, lambda f, fn=theirs_fn: fn(f), feats)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_close(ours, ref)
