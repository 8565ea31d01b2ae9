"""Every option of sentence-transformers' MultipleNegativesRankingLoss through our cached losses, end to
end on a tiny model: loss and parameter gradients against sentence-transformers' own non-cached loss
(the oracle), with mini-batches that do not divide the batch, hard negatives and token budgets; and the
options' validation (before any step, naming the argument and the fix)."""

from __future__ import annotations

import logging

import pytest
from sentence_transformers.sentence_transformer import losses as st_losses

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from tests.losses.test_losses import B, assert_grads_close, columns, param_grads
from tests.support.tiny_model import make_tiny_model

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
OPTIONS = [
    ({"directions": ALL, "partition_mode": "joint"}, 2),
    (
        {
            "directions": ALL,
            "partition_mode": "joint",
            "hardness_mode": "all_negatives",
            "hardness_strength": 5.0,
        },
        3,
    ),
    ({"directions": ("query_to_doc", "query_to_query")}, 2),
    (
        {
            "directions": ("query_to_doc", "doc_to_doc"),
            "hardness_mode": "hard_negatives",
            "hardness_strength": 5.0,
        },
        3,
    ),
    ({"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "joint"}, 2),
    (
        {
            "directions": ("query_to_doc", "doc_to_query"),
            "partition_mode": "per_direction",
            "hardness_mode": "in_batch_negatives",
            "hardness_strength": 9.0,
        },
        3,
    ),
    ({"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0}, 2),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


@pytest.mark.parametrize(("options", "n_cols"), OPTIONS)
@pytest.mark.parametrize(
    ("cls", "engine"),
    [(CachedMNRLoss, {"mini_batch_size": 4}), (CachedTiledLoss, {"mini_batch_size": 5, "tile_size": 3})],
    ids=["mnr", "tiled"],
)
def test_options_equal_sentence_transformers_mnrl(model, options, n_cols, cls, engine):
    feats = columns(model, n_cols, seed=11)
    st_loss = st_losses.MultipleNegativesRankingLoss(model, scale=20.0, **options)
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    ours_fn = cls(model, 20.0, **options, **engine)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


def test_token_budget_with_general_options(model):
    feats = columns(model, 2, seed=12)
    options = {"directions": ALL, "hardness_mode": "all_negatives", "hardness_strength": 5.0}
    st_loss = st_losses.MultipleNegativesRankingLoss(model, scale=20.0, **options)
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    ours_fn = CachedMNRLoss(model, 20.0, mini_batch_num_tokens=12, **options)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


def test_options_set_after_construction_take_effect(model):
    feats = columns(model, 2, seed=13)
    st_loss = st_losses.MultipleNegativesRankingLoss(model, scale=10.0, directions=ALL)
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    ours_fn = CachedMNRLoss(model, mini_batch_size=3)
    ours_fn.directions = ALL
    ours_fn.scale = 10.0
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


def test_clip_with_learnable_scale_takes_joint_and_hardness(model):
    feats = columns(model, 2, seed=14)
    options = {"partition_mode": "joint", "hardness_mode": "in_batch_negatives", "hardness_strength": 2.0}
    st_loss = st_losses.MultipleNegativesRankingLoss(
        model, scale=20.0, directions=("query_to_doc", "doc_to_query"), **options
    )
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    ours_fn = CachedCLIPLoss(model, 20.0, mini_batch_size=4, **options)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"directions": ("query_to_doc", "query_to_query"), "partition_mode": "per_direction"}, "joint"),
        ({"directions": ("query_to_doc", "doc_to_doc"), "partition_mode": "per_direction"}, "joint"),
        ({"directions": ("query_to_doc", "sideways")}, "Invalid directions"),
        ({"directions": ("doc_to_query",)}, "'query_to_doc' direction is required"),
        ({"directions": "query_to_doc"}, "tuple of direction names"),
        ({"partition_mode": "both"}, "partition_mode"),
        ({"hardness_mode": "hardest"}, "hardness_mode must be one of"),
        (
            {"hardness_mode": "all_negatives", "hardness_strength": -1.0},
            "hardness_strength must be non-negative",
        ),
        ({"hardness_strength": "5"}, "hardness_strength"),
    ],
)
def test_bad_options_raise_at_construction(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedMNRLoss(model, **kwargs)


def test_bad_options_set_later_raise_and_keep_the_old_value(model):
    loss = CachedMNRLoss(model, mask_duplicates=True)
    loss.hardness_strength = 3.0  # fine alone: hardness_mode is still None
    loss.hardness_mode = "all_negatives"  # duplicate masks compose with every option (one core)
    assert loss.hardness_mode == "all_negatives" and loss.mask_duplicates
    with pytest.raises(ValueError, match="joint"):
        loss.partition_mode = "per_direction"
        loss.directions = ALL
    loss.partition_mode = "joint"
    loss.directions = ALL
    with pytest.raises(ValueError, match="joint"):
        loss.partition_mode = "per_direction"
    assert loss.partition_mode == "joint" and loss.directions == ALL


def test_hardness_mode_without_strength_warns_like_sentence_transformers(model, caplog):
    with caplog.at_level(logging.WARNING):
        CachedMNRLoss(model, hardness_mode="hard_negatives")
    assert "hardness_strength=0.0" in caplog.text


def test_batch_not_divisible(model):
    assert B % 4 and B % 5  # the mini-batch sizes used above do not divide the batch


def test_model_card_tags_name_the_equivalent_loss(tmp_path):
    from st_cached_losses import CachedGISTLoss

    model = make_tiny_model(tmp_path / "m", dropout=0.0)
    guide = make_tiny_model(tmp_path / "g", dropout=0.0, seed=3)
    feats = columns(model, 2, seed=15)
    CachedMNRLoss(model, mini_batch_size=4)(feats, None)
    assert {"st_cached_losses", "equivalent-loss:CachedMultipleNegativesRankingLoss"} <= set(
        model.model_card_data.tags
    )
    CachedGISTLoss(model, guide, mini_batch_size=4)(feats, None)
    assert "equivalent-loss:CachedGISTEmbedLoss" in model.model_card_data.tags


# --------------------------------------------------------------------------- two processes, unequal batches


def _options_worker(rank: int, world: int, path: str, sizes: list[int], cls_name: str):
    import torch
    from sentence_transformers import SentenceTransformer

    import st_cached_losses
    from tests.losses.test_loss_options import ALL, OPTIONS_DIST, global_texts

    model = SentenceTransformer(path, device="cpu")
    start = sum(sizes[:rank])
    feats = [model.preprocess(c[start : start + sizes[rank]]) for c in global_texts(sum(sizes))]
    extra = {"tile_size": 3} if cls_name == "CachedTiledLoss" else {}
    loss_fn = getattr(st_cached_losses, cls_name)(
        model, 20.0, mini_batch_size=2, gather_across_devices=True, directions=ALL, **OPTIONS_DIST, **extra
    )
    model.zero_grad(set_to_none=True)
    loss = loss_fn(feats, None)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"loss": float(loss), "grads": grads}


OPTIONS_DIST = {"hardness_mode": "all_negatives", "hardness_strength": 5.0}


def global_texts(n: int) -> list[list[str]]:
    from tests.support.tiny_model import random_texts

    return [random_texts(n, seed=40 + k, max_words=8) for k in range(3)]


@pytest.mark.parametrize("cls_name", ["CachedMNRLoss", "CachedTiledLoss"], ids=["gather", "ring"])
def test_two_processes_unequal_batches_equal_one_process(tmp_path, cls_name):
    """Every process's share weighs W / B_global: the mean over processes of losses and gradients is the
    global batch's, which sentence-transformers' non-cached MNRL gives on one process."""
    import torch

    from tests.support.dist_utils import run_distributed

    model = make_tiny_model(tmp_path / "m", dropout=0.0)
    path = str(tmp_path / "st")
    model.save(path)
    sizes = [5, 2]
    per_rank = run_distributed(_options_worker, 2, path, sizes, cls_name, timeout=180)
    feats = [model.preprocess(t) for t in global_texts(sum(sizes))]
    st_loss = st_losses.MultipleNegativesRankingLoss(model, scale=20.0, directions=ALL, **OPTIONS_DIST)
    model.zero_grad(set_to_none=True)
    ref_loss = st_loss(feats, None)
    ref_loss.backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert sum(r["loss"] for r in per_rank) / 2 == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(sum(r["grads"] for r in per_rank) / 2, ref)
