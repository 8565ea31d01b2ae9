"""Self-guided CachedGISTLoss (``guide=None``): the model's own first-pass embeddings make GIST's mask.

On a model without dropout it equals sentence-transformers' ``GISTEmbedLoss`` with a frozen copy of the model
as the guide (loss and parameter gradients), for the absolute margin 0, Qwen3-Embedding's absolute -0.1 and
the relative strategy; with dropout, a naive reference whose mask is made of the detached embeddings of the
very forward that is differentiated; across 2 gloo processes, sentence-transformers' gathered loss with a
copy as guide; and the arguments' route (``loss: gist`` without ``guide_model``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from st_cached_losses import CachedGISTLoss
from tests.losses.test_losses import assert_grads_close, flat_grads, param_grads
from tests.support.dist_utils import run_distributed
from tests.support.st_version import gist_embed_loss
from tests.support.tiny_model import make_tiny_model, random_texts

B = 9

MARGINS = [("absolute", 0.0), ("absolute", -0.1), ("relative", 0.05)]

#: theirs, with 6.3's rule (a row is never its own negative) on 6.2 too: ours follows the fix
GISTEmbedLoss = gist_embed_loss()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("self_gist") / "model", dropout=0.0, seed=3)


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("self_gist_dropout") / "model", dropout=0.2, seed=4)


def texts(
    n_cols: int, b: int = B, seed: int = 0, words: tuple[int, int] = (1, 8), long_positive: bool = True
) -> list[list[str]]:
    cols = [
        random_texts(b, seed=seed + 31 * k, min_words=words[0], max_words=words[1]) for k in range(n_cols)
    ]
    cols[1][5] = cols[1][2]  # the same positive in two rows: a false negative for the mask to find
    # row 0's anchor is row 4's positive (rated 1.0) and row 0's positive is long and unrelated (rated
    # lower): that in-batch negative scores more than 0.1 above row 0's positive
    cols[1][4] = cols[0][0]
    if long_positive:
        cols[1][0] = random_texts(1, seed=seed + 7, min_words=30, max_words=30)[0]
    return cols


def masked_fraction(model, feats, strategy: str, margin: float) -> float:
    """The share of the in-batch anchor -> positive entries the mask removes (a non-vacuity check)."""
    with torch.no_grad():
        a, p = (F.normalize(model(dict(f))["sentence_embedding"], dim=-1) for f in feats[:2])
    sim = a @ p.T
    pos = sim.diagonal()[:, None]
    thr = pos - margin if strategy == "absolute" else pos - pos.abs() * margin
    off = ~torch.eye(len(a), dtype=torch.bool)
    return float((sim > thr)[off].float().mean())


@pytest.mark.parametrize(("strategy", "margin"), MARGINS, ids=["abs0", "abs-0.1", "rel0.05"])
@pytest.mark.parametrize("n_cols", [2, 3])
def test_equals_gist_embed_loss_with_a_frozen_copy(model, strategy, margin, n_cols):
    feats = [model.preprocess(t) for t in texts(n_cols, seed=n_cols)]
    options = {"temperature": 0.05, "margin_strategy": strategy, "margin": margin}
    frozen = copy.deepcopy(model)
    ref_loss, ref = param_grads(model, lambda f: GISTEmbedLoss(model, frozen, **options)(f, None), feats)
    ours_fn = CachedGISTLoss(model, None, **options, mini_batch_size=4)
    assert ours_fn.self_guided and not ours_fn.must_retokenize
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)
    # not vacuous: the mask removes some entries, but not all of them
    assert 0.0 < masked_fraction(model, feats, strategy, margin) < 1.0
    unmasked = GISTEmbedLoss(model, frozen, 0.05, margin_strategy="absolute", margin=-10.0)
    with torch.no_grad():
        assert float(unmasked(feats, None)) != pytest.approx(float(ref_loss), rel=1e-4)


@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_tiled_path_and_evaluation_equal_the_reference(model, path):
    feats = [model.preprocess(t) for t in texts(3, seed=5)]
    frozen = copy.deepcopy(model)
    ref_fn = GISTEmbedLoss(model, frozen, 0.05, margin=-0.1)
    ours_fn = CachedGISTLoss(model, None, 0.05, 4, margin=-0.1, path=path, tile_size=4)
    ref_loss, ref = param_grads(model, lambda f: ref_fn(f, None), feats)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)
    with torch.no_grad():  # evaluation: the same loss without caching
        assert float(ours_fn(feats, None)) == pytest.approx(float(ref_loss), rel=1e-5)


def test_learnable_scale_and_calculate_loss_with_autograd(model):
    """The autograd route (a caller asking for a graph, as MatryoshkaLoss's decorated calculate_loss may) is
    self-guided by the embeddings it is given; the learnable scale's gradient reaches logit_scale.

    Without the anchor-anchor and positive-positive blocks: there row 0's anchor, which is row 4's positive,
    ties a threshold exactly (cos(p0, p4) = cos(p0, a0)), where theirs masks or keeps by the sign of a float
    rounding (+6e-8 on one machine: masked, 2.0885 against our 2.1005) and ours counts a tie within 1e-6 as a
    tie (kept)."""
    feats = [model.preprocess(t) for t in texts(2, seed=7)]
    frozen = copy.deepcopy(model)
    blocks = {"contrast_anchors": False, "contrast_positives": False}
    ours_fn = CachedGISTLoss(model, None, 0.05, 4, learnable_scale=True, **blocks)
    with torch.no_grad():
        embs = [frozen(dict(f))["sentence_embedding"] for f in feats]
    reps = [[e.clone().requires_grad_()] for e in embs]
    loss = ours_fn.calculate_loss(reps)
    ref = GISTEmbedLoss(frozen, frozen, 0.05, **blocks)
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(ref(feats, None)), rel=1e-5)
    loss.backward()
    assert float(ours_fn.logit_scale.grad) != 0.0


def _naive_self_gist(embs: list[torch.Tensor], scale: float, margin: float) -> torch.Tensor:
    """GISTEmbedLoss's formula on embeddings with a graph, its guide the same embeddings detached."""
    a, p, *negs = (F.normalize(e, dim=-1) for e in embs)
    ga, gp, *gn = (e.detach() for e in (a, p, *negs))
    thr = (ga * gp).sum(-1, keepdim=True) - margin
    eye = torch.eye(len(a), dtype=torch.bool)
    blocks = [((a @ p.T), (ga @ gp.T) > thr)]
    blocks[0][1][eye] = False  # never the positive
    blocks.append(((a @ a.T), ((ga @ ga.T) > thr) | eye))  # never its own negative (6.3's fix)
    blocks.append(((p @ p.T), ((gp @ gp.T) > thr) | eye))
    blocks += [((a @ n.T), (ga @ g.T) > thr) for n, g in zip(negs, gn)]
    scores = torch.cat([s.masked_fill(m, -torch.inf) for s, m in blocks], dim=1) * scale
    return F.cross_entropy(scores, torch.arange(len(a)))


def test_with_dropout_the_mask_is_the_forwards_own(dropout_model):
    """Dropout on: the mask comes from the detached embeddings of the forward being differentiated (the
    engine's first pass, which the replay reproduces). The reference runs the same mini-batches in the same
    order from the same random state (texts of one length: no padding to trim, no reordering)."""
    model = dropout_model
    model.train()
    mb = 4
    feats = [model.preprocess(t) for t in texts(3, b=10, seed=11, words=(6, 6), long_positive=False)]
    assert len({f["input_ids"].shape[1] for f in feats}) == 1

    def reference(features):
        embs = []
        for f in features:
            parts = [
                model({k: v[i : i + mb] if isinstance(v, torch.Tensor) else v for k, v in f.items()})[
                    "sentence_embedding"
                ]
                for i in range(0, 10, mb)
            ]
            embs.append(torch.cat(parts))
        return _naive_self_gist(embs, 20.0, -0.1)

    torch.manual_seed(0)
    ref_loss, ref = param_grads(model, reference, feats)
    ours_fn = CachedGISTLoss(model, None, 0.05, mb, margin=-0.1, sort_by_length=False, reuse_last_graph=False)
    torch.manual_seed(0)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)
    # canary: dropout is on, so another random state gives another loss (the comparison above can fail)
    torch.manual_seed(1)
    with torch.no_grad():
        other = float(reference(feats))
    assert other != pytest.approx(float(ref_loss), rel=1e-4)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("dims", "weights", "n_cols"),
    [([32, 8], None, 2), ([32, 16, 8], [1.0, 0.5, 2.0], 3)],
    ids=["32-8-pairs", "32-16-8-weighted-triplets"],
)
def test_inside_matryoshka_every_width_is_guided_at_full_width(model, dims, weights, n_cols):
    """Issue 50: inside MatryoshkaLoss, GISTEmbedLoss with a frozen copy of the model rates the pairs with the
    copy's full-width embeddings at every width; so does the self-guided loss (it guided each width with the
    truncated embeddings: 4.5229 against their 4.7685 at dims [32, 8], gradients 0.415 apart). Training and
    evaluation."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    feats = [model.preprocess(t) for t in texts(n_cols, seed=13)]
    frozen = copy.deepcopy(model)
    theirs = MatryoshkaLoss(model, GISTEmbedLoss(model, frozen, 0.05), dims, weights)
    ours = MatryoshkaLoss(model, CachedGISTLoss(model, None, 0.05, 4), dims, weights)
    ref_loss, ref = param_grads(model, lambda f: theirs(f, None), feats)
    loss, grads = param_grads(model, lambda f: ours(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(grads, ref)
    with torch.no_grad():  # evaluation: the same loss without caching
        assert float(ours(feats, None)) == pytest.approx(float(ref_loss), rel=1e-5)
    # not vacuous: a guide truncated with each width would give another loss
    truncated = 0.0
    with torch.no_grad():
        full = [frozen(dict(f))["sentence_embedding"] for f in feats]
        for dim, w in zip(dims, weights or [1.0] * len(dims)):
            cut = [F.normalize(e[:, :dim], dim=-1) for e in full]
            truncated += w * float(CachedGISTLoss(model, None, 0.05).calculate_loss([[e] for e in cut]))
    assert truncated != pytest.approx(float(ref_loss), rel=1e-3)
    model.zero_grad(set_to_none=True)


def test_setting_and_config(model):
    loss = CachedGISTLoss(model)
    assert loss.guide is None and loss.self_guided
    assert loss.get_config_dict()["guide"] is None
    loss.guide = model  # a guide model again: embedded once more per step, as before
    assert not loss.self_guided and loss.guide is model
    loss.guide = None
    assert loss.self_guided and not loss.must_retokenize
    loss.gather_across_devices = True  # no guide to check
    assert list(loss.parameters()) == list(model.parameters())


def test_arguments_route_without_guide_model(model, tmp_path):
    from st_cached_losses import CachedLossTrainingArguments, build_loss

    args = CachedLossTrainingArguments(
        output_dir=str(tmp_path), loss="gist", margin=-0.1, per_device_train_batch_size=8, mini_batch_size=4
    )
    loss = build_loss(model, args)
    assert isinstance(loss, CachedGISTLoss) and loss.self_guided and loss.margin == -0.1


# --------------------------------------------------------------------------- two processes


def _worker(rank: int, world: int, path: str, sizes: list[int], kind: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    start = sum(sizes[:rank])
    feats = [model.preprocess(c[start : start + sizes[rank]]) for c in texts(3, b=sum(sizes), seed=21)]
    if kind == "theirs":
        loss_fn = GISTEmbedLoss(model, copy.deepcopy(model), 0.05, margin=-0.1, gather_across_devices=True)
    else:
        loss_fn = CachedGISTLoss(
            model, None, 0.05, mini_batch_size=2, margin=-0.1, gather_across_devices=True,
            path="tiled" if kind == "ring" else "auto", tile_size=3,
        )  # fmt: skip
    model.zero_grad(set_to_none=True)
    loss = loss_fn(feats, None)
    loss.backward()
    return {"loss": float(loss), "grads": flat_grads(model)}


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("self_gist_saved") / "model")
    model.save(path)
    return path


def _mean(per_rank, key):
    return sum(r[key] for r in per_rank) / len(per_rank)


def test_two_processes_equal_their_gathered_loss_with_a_copy(saved):
    theirs = run_distributed(_worker, 2, saved, [4, 4], "theirs", timeout=180)
    ours = run_distributed(_worker, 2, saved, [4, 4], "gather", timeout=180)
    assert _mean(ours, "loss") == pytest.approx(_mean(theirs, "loss"), rel=1e-5)
    assert_grads_close(_mean(ours, "grads"), _mean(theirs, "grads"))


def test_two_processes_unequal_ring_equals_gather(saved):
    gather = run_distributed(_worker, 2, saved, [6, 2], "gather", timeout=180)
    ring = run_distributed(_worker, 2, saved, [6, 2], "ring", timeout=180)
    assert _mean(ring, "loss") == pytest.approx(_mean(gather, "loss"), rel=1e-6)
    assert_grads_close(_mean(ring, "grads"), _mean(gather, "grads"), rtol=1e-6)
