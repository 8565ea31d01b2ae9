"""``in_batch_negatives=False``: each anchor scored against its own positive and its own hard negatives only
(FlagEmbedding's ``no_in_batch_neg_flag``), on ``CachedMNRLoss``, ``CachedTiledLoss`` and ``CachedGISTLoss``.

Against a naive reference (``(B, K)`` logits with autograd) in loss and gradients: the functional entry points
(cosine, dot, a similarity function, a hardness penalty, duplicate keys, a guide, a tensor scale), the losses
on a tiny BERT, 2 gloo processes (unequal batches) against one process on the whole batch; no tile of the
in-batch drivers is computed; the settings' checks, the config and the arguments' route."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.util import euclidean_sim

from st_cached_losses import CachedCLIPLoss, CachedGISTLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.functional import InfoNCEOptions, infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import Guide
from st_cached_losses.functional.softmax.parallel import loss_and_grad
from st_cached_losses.functional.softmax.terms import gist_terms, mnrl_terms
from tests.losses.test_losses import assert_grads_close, flat_grads, param_grads
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_model, random_texts

B = 9

pytestmark = pytest.mark.filterwarnings("ignore:.*no LossStateCallback")


def naive(anchors, cols, scale, similarity="cosine", penalty=None, mask=None):
    """Row i's softmax over its own entries c_k[i]: ``(B, K)`` logits, cross-entropy with target 0."""
    a, cs = anchors, list(cols)
    if similarity == "cosine":
        a, cs = F.normalize(a, dim=-1), [F.normalize(c, dim=-1) for c in cs]
    if callable(similarity):
        sim = torch.stack(
            [torch.stack([similarity(a[i : i + 1], c[i : i + 1])[0, 0] for i in range(len(a))]) for c in cs],
            1,
        )
    else:
        sim = torch.stack([(a * c).sum(-1) for c in cs], dim=1)
    logits = sim * scale
    if penalty is not None:
        logits = logits + sim.detach() * torch.tensor(penalty)
    if mask is not None:
        logits = logits.masked_fill(mask, -torch.inf)
    return F.cross_entropy(logits, torch.zeros(len(a), dtype=torch.long))


def _inputs(b=7, k=3, d=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b, d, generator=g, dtype=dtype)
    cols = [torch.randn(b, d, generator=g, dtype=dtype) for _ in range(k)]
    return a, cols


@pytest.mark.parametrize("similarity", ["cosine", "dot", "fn"])
@pytest.mark.parametrize("hardness", [None, "hard_negatives"])
def test_functional_equals_the_naive_loss_and_gradients(similarity, hardness):
    a, cols = _inputs()
    sim = euclidean_sim if similarity == "fn" else similarity
    terms = mnrl_terms(("query_to_doc",), "joint", hardness, 2.0, len(cols), in_batch_negatives=False)
    assert not terms.in_batch and len(terms.terms) == len(cols)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    out = infonce_loss_and_grad(a, cols, InfoNCEOptions(scale=scale, similarity=sim, terms=terms))
    leaves = [a.clone().requires_grad_(), *(c.clone().requires_grad_() for c in cols)]
    s = scale.detach().clone().requires_grad_()
    penalty = [0.0, 2.0, 2.0] if hardness else None
    ref = naive(leaves[0], leaves[1:], s, similarity=sim, penalty=penalty)
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    torch.testing.assert_close(out.grad_anchors, leaves[0].grad)
    for got, want in zip(out.grad_candidates, leaves[1:]):
        torch.testing.assert_close(got, want.grad)
    torch.testing.assert_close(out.grad_scale, s.grad)
    assert leaves[0].grad.abs().max() > 0 and s.grad != 0
    # the autograd entry point: the same loss and gradients
    leaves2 = [a.clone().requires_grad_(), *(c.clone().requires_grad_() for c in cols)]
    loss = infonce(leaves2[0], leaves2[1:], InfoNCEOptions(scale=7.0, similarity=sim, terms=terms))
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(leaves2[1].grad, leaves[1].grad)


def test_functional_keys_and_guide_masks():
    a, cols = _inputs(b=6, k=4, seed=1)
    g_a, g_cols = _inputs(b=6, k=4, d=3, seed=2)
    keys = [torch.arange(6), torch.arange(10, 16), torch.arange(20, 26), torch.arange(30, 36)]
    keys[2][3] = keys[0][3]  # row 3's first hard negative is its own positive: masked
    terms = gist_terms(True, True, 4, "absolute", -0.1, in_batch_negatives=False)
    opts = InfoNCEOptions(scale=20.0, terms=terms, guide=Guide(g_a, g_cols), candidate_keys=keys)
    out = infonce_loss_and_grad(a, cols, opts)
    ga, gc = F.normalize(g_a, dim=-1), [F.normalize(c, dim=-1) for c in g_cols]
    rated = torch.stack([(ga * c).sum(-1) for c in gc], 1)
    mask = rated > rated[:, :1] + 0.1
    mask[:, 0] = False
    mask[3, 2] = True
    assert 0 < int(mask[:, 1:].sum()) < mask[:, 1:].numel(), "vacuous: the guide masks none or all"
    leaves = [a.clone().requires_grad_(), *(c.clone().requires_grad_() for c in cols)]
    ref = naive(leaves[0], leaves[1:], 20.0, mask=mask)
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    torch.testing.assert_close(out.grad_anchors, leaves[0].grad)
    for got, want in zip(out.grad_candidates, leaves[1:]):
        torch.testing.assert_close(got, want.grad)


def test_no_tile_of_the_in_batch_drivers_is_computed(monkeypatch):
    """Cheap: the loss stage never reaches the tile drivers (no B x B block), on any path."""
    import importlib

    from st_cached_losses.functional.score import Score

    infonce_module = importlib.import_module("st_cached_losses.functional.softmax.loss")

    def refuse(*args, **kwargs):
        raise AssertionError("a B x C tile driver ran")

    monkeypatch.setattr(infonce_module, "terms_solve", refuse)
    a, cols = _inputs(b=50, k=3, dtype=torch.float32)
    terms = mnrl_terms(("query_to_doc",), "joint", None, 0.0, 3, in_batch_negatives=False)
    for path in ("chunked", "tiled"):
        out = loss_and_grad(a, cols, None, InfoNCEOptions(terms=terms, path=path))
        assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="in_batch=False"):  # a driver given such terms refuses them
        InfoNCEOptions(terms=terms).spec(a, cols, Score("cosine"))


# --------------------------------------------------------------------------- the losses


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("own_negs") / "model", dropout=0.0, seed=2)


def texts(n_cols: int, b: int = B, seed: int = 0) -> list[list[str]]:
    return [random_texts(b, seed=seed + 13 * k, max_words=8) for k in range(n_cols)]


def _naive_model_loss(model, scale, mask_fn=None):
    def fn(features):
        embs = [model(dict(f))["sentence_embedding"] for f in features]
        mask = mask_fn(embs) if mask_fn is not None else None
        return naive(embs[0], embs[1:], scale, mask=mask)

    return fn


@pytest.mark.parametrize("cls", [CachedMNRLoss, CachedTiledLoss])
@pytest.mark.parametrize("n_cols", [3, 4])
def test_ranking_losses_equal_the_naive_reference(model, cls, n_cols):
    feats = [model.preprocess(t) for t in texts(n_cols, seed=n_cols)]
    ref_loss, ref = param_grads(model, _naive_model_loss(model, 20.0), feats)
    loss_fn = cls(model, mini_batch_size=4, in_batch_negatives=False)
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)
    with torch.no_grad():  # evaluation
        assert float(loss_fn(feats, None)) == pytest.approx(float(ref_loss), rel=1e-5)
    # not the in-batch loss
    with torch.no_grad():
        assert float(cls(model, mini_batch_size=4)(feats, None)) > float(ref_loss) + 1e-3


@pytest.mark.parametrize("guided", ["self", "copy"])
def test_gist_own_hard_negatives_equal_the_naive_reference(model, guided):
    feats = [model.preprocess(t) for t in texts(4, seed=5)]
    frozen = copy.deepcopy(model)
    guide = None if guided == "self" else frozen

    def mask_fn(embs):
        with torch.no_grad():
            g = [F.normalize(frozen(dict(f))["sentence_embedding"], dim=-1) for f in feats]
        rated = torch.stack([(g[0] * c).sum(-1) for c in g[1:]], 1)
        mask = rated > rated[:, :1] - 0.01
        mask[:, 0] = False
        assert 0 < int(mask.sum()) < mask[:, 1:].numel(), "vacuous: the guide masks none or all"
        return mask

    ref_loss, ref = param_grads(model, _naive_model_loss(model, 20.0, mask_fn), feats)
    loss_fn = CachedGISTLoss(model, guide, 0.05, 4, margin=0.01, in_batch_negatives=False)
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


def test_learnable_scale_gradient(model):
    feats = [model.preprocess(t) for t in texts(3, seed=9)]
    loss_fn = CachedMNRLoss(model, mini_batch_size=4, in_batch_negatives=False, learnable_scale=True)
    s = torch.tensor(20.0, requires_grad=True)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        embs = [model(dict(f))["sentence_embedding"] for f in feats]
    naive(embs[0], embs[1:], s).backward()
    loss_fn(feats, None).backward()
    # d loss / d log(scale) = scale * d loss / d scale
    assert float(loss_fn.logit_scale.grad) == pytest.approx(float(s.grad) * 20.0, rel=1e-4)
    assert float(s.grad) != 0


def test_settings_checks_config_and_refusals(model):
    loss = CachedMNRLoss(model, in_batch_negatives=False)
    assert loss.get_config_dict()["in_batch_negatives"] is False
    assert "in_batch_negatives" not in CachedMNRLoss(model).get_config_dict()
    with pytest.raises(ValueError, match="directions must be"):
        loss.directions = ("query_to_doc", "doc_to_query")
    with pytest.raises(ValueError, match="directions must be"):
        loss.symmetric = True
    with pytest.raises(ValueError, match="hard_negatives"):
        CachedMNRLoss(
            model, hardness_mode="in_batch_negatives", hardness_strength=1.0, in_batch_negatives=False
        )
    with pytest.raises(ValueError, match="directions must be"):
        CachedCLIPLoss(model).in_batch_negatives = False
    with pytest.raises(ValueError, match="in_batch_negatives must be True or False"):
        CachedGISTLoss(model, in_batch_negatives="no")
    pairs = [model.preprocess(t) for t in texts(2)]
    for fn in (loss, CachedGISTLoss(model, in_batch_negatives=False)):
        with pytest.raises(ValueError, match="no hard negative"):
            fn(pairs, None)
    rebuilt = CachedMNRLoss(model, **loss.get_config_dict())
    assert rebuilt.in_batch_negatives is False


def test_arguments_route(model, tmp_path):
    from st_cached_losses import CachedLossTrainingArguments, build_loss

    base = {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "mini_batch_size": 4}
    for name, cls in (("mnr", CachedMNRLoss), ("tiled", CachedTiledLoss), ("gist", CachedGISTLoss)):
        args = CachedLossTrainingArguments(**base, loss=name, in_batch_negatives=False)
        loss = build_loss(model, args)
        assert isinstance(loss, cls) and loss.in_batch_negatives is False
    with pytest.raises(ValueError, match="in_batch_negatives"):
        CachedLossTrainingArguments(**base, loss="clip", in_batch_negatives=False)


# --------------------------------------------------------------------------- two processes


def _worker(rank: int, world: int, path: str, sizes: list[int], kind: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    start = sum(sizes[:rank])
    feats = [model.preprocess(c[start : start + sizes[rank]]) for c in texts(3, b=sum(sizes), seed=21)]
    if kind == "gist":
        loss_fn = CachedGISTLoss(
            model, None, 0.05, 2, margin=0.01, gather_across_devices=True, in_batch_negatives=False
        )
    else:
        cls = CachedTiledLoss if kind == "tiled" else CachedMNRLoss
        loss_fn = cls(
            model,
            mini_batch_size=2,
            gather_across_devices=True,
            in_batch_negatives=False,
            learnable_scale=True,
        )
    model.zero_grad(set_to_none=True)
    loss = loss_fn(feats, None)
    loss.backward()
    scale_grad = float(loss_fn.logit_scale.grad) if kind != "gist" else 0.0
    return {"loss": float(loss), "grads": flat_grads(model), "scale_grad": scale_grad}


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("own_negs_saved") / "model")
    model.save(path)
    return path


@pytest.mark.parametrize("kind", ["mnr", "tiled", "gist"])
def test_two_processes_unequal_batches_equal_one_process(model, saved, kind):
    per_rank = run_distributed(_worker, 2, saved, [6, 2], kind, timeout=180)
    feats = [model.preprocess(c) for c in texts(3, b=8, seed=21)]
    if kind == "gist":
        one = CachedGISTLoss(model, None, 0.05, 2, margin=0.01, in_batch_negatives=False)
    else:
        one = CachedMNRLoss(model, mini_batch_size=2, in_batch_negatives=False, learnable_scale=True)
    ref_loss, ref = param_grads(model, lambda f: one(f, None), feats)
    mean = {key: sum(r[key] for r in per_rank) / 2 for key in ("loss", "grads", "scale_grad")}
    assert mean["loss"] == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(mean["grads"], ref)  # DDP's average: the whole batch's gradient
    if kind != "gist":  # the scale's gradient is averaged by the loss itself: every process holds it
        assert per_rank[0]["scale_grad"] == pytest.approx(float(one.logit_scale.grad), rel=1e-4)
        assert per_rank[1]["scale_grad"] == pytest.approx(per_rank[0]["scale_grad"], rel=1e-6)
