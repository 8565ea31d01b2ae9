"""Every loss rebuilt from its own ``get_config_dict()``, and the config a drop-in for
sentence-transformers' (with their nine keys' settings, ours equals theirs, no ``symmetric`` key)."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from sentence_transformers.multi_vector_encoder.scoring import (
    XTRScores,
    colbert_scores,
    mean_colbert_scores,
    xtr_scores,
)
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.sparse_encoder.losses import FlopsLoss, SparseMultipleNegativesRankingLoss
from sentence_transformers.util import dot_score

from st_cached_losses import (
    CachedCLIPLoss,
    CachedGISTLoss,
    CachedMNRLoss,
    CachedMultiVectorLoss,
    CachedSparseLoss,
    CachedTiledLoss,
)
from st_cached_losses.functional.representations.multi_vector import XTR, MaxSim
from tests.support.tiny_model import make_tiny_model, make_tiny_multi_vector, make_tiny_splade

TWO = ("query_to_doc", "doc_to_query")
FOUR = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("round_trip")
    return {
        "dense": make_tiny_model(root / "dense"),
        "guide": make_tiny_model(root / "guide", seed=1),
        "splade": make_tiny_splade(root / "splade"),
        "multi_vector": make_tiny_multi_vector(root / "mv"),
    }


def _round_trip(cls: type, model: Any, loss: Any) -> None:
    config = loss.get_config_dict()
    rebuilt = cls(model, **config)
    assert rebuilt.get_config_dict() == config


DENSE = [
    (CachedMNRLoss, {}),
    (CachedMNRLoss, {"directions": TWO, "partition_mode": "per_direction"}),
    (CachedMNRLoss, {"directions": FOUR, "hardness_mode": "in_batch_negatives", "hardness_strength": 9.0}),
    (CachedMNRLoss, {"scale": 50.0, "similarity_fct": dot_score, "mask_duplicates": True, "path": "tiled"}),
    # "auto" without a memory budget is refused at construction off CUDA (issue 45): an "auto" loss's config
    # carries its budget (test_an_auto_loss_rebuilds_from_its_config); here a fixed token budget
    (CachedMNRLoss, {"mini_batch_size": 8, "mini_batch_num_tokens": 64}),
    (CachedCLIPLoss, {}),
    (CachedCLIPLoss, {"learnable_scale": True, "scale": 14.0, "max_scale": 50.0}),
    (CachedCLIPLoss, {"directions": ("query_to_doc",), "partition_mode": "joint"}),
    (CachedTiledLoss, {}),
    (CachedTiledLoss, {"symmetric": True, "tile_size": 4}),
    (CachedTiledLoss, {"directions": TWO, "partition_mode": "joint", "learnable_scale": True}),
]


def _id(value: object) -> str:
    """A test id without the memory addresses of function reprs: the same in every process (pytest -n
    compares the ids its workers collected)."""
    return re.sub(r" at 0x[0-9a-f]+", "", str(value))


@pytest.mark.parametrize(
    ("cls", "kwargs"), DENSE, ids=lambda v: v.__name__ if isinstance(v, type) else _id(v)
)
def test_dense_losses_rebuild_from_their_config(models, cls, kwargs):
    _round_trip(cls, models["dense"], cls(models["dense"], **kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"margin_strategy": "relative", "margin": 0.1, "contrast_anchors": False, "temperature": 0.05}],
)
def test_gist_rebuilds_from_its_config(models, kwargs):
    _round_trip(CachedGISTLoss, models["dense"], CachedGISTLoss(models["dense"], models["guide"], **kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {
            "query_regularizer_weight": 5e-5,
            "document_regularizer_threshold": 10,
            "query_regularizer_threshold": 5,
        },
        {"use_document_regularizer_only": True, "mini_batch_num_tokens": 64, "tile_size": 4},
    ],
)
def test_sparse_rebuilds_from_its_config(models, kwargs):
    model = models["splade"]
    loss = CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), 3e-5, **kwargs)
    _round_trip(CachedSparseLoss, model, loss)


@pytest.mark.parametrize(
    "similarity_fct",
    [
        None,
        colbert_scores,
        mean_colbert_scores,
        functools.partial(mean_colbert_scores, length_normalize=False),
        xtr_scores,
        XTRScores(top_k=5),
        functools.partial(xtr_scores, top_k=5),
        "xtr",
        MaxSim(True),
        XTR(7),
    ],
    ids=_id,
)
def test_multi_vector_rebuilds_from_its_config(models, similarity_fct):
    model = models["multi_vector"]
    loss = CachedMultiVectorLoss(model, similarity_fct=similarity_fct, score_mini_batch_size=4)
    _round_trip(CachedMultiVectorLoss, model, loss)
    rebuilt = CachedMultiVectorLoss(model, **loss.get_config_dict())
    assert rebuilt.similarity == loss.similarity  # the same score: MaxSim / MeanMaxSim / XTR with its top_k


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("XTRScores(top_k=5, chunk_elements=None)", XTR(5)),
        ("xtr_scores(top_k=5)", XTR(5)),
        ("mean_colbert_scores(length_normalize=False)", MaxSim(False)),
        ("mean_colbert_scores", MaxSim(True)),
        ("colbert_scores", MaxSim(False)),
    ],
)
def test_multi_vector_takes_their_config_strings(models, text, expected):
    assert CachedMultiVectorLoss(models["multi_vector"], similarity_fct=text).similarity == expected


@pytest.mark.parametrize(
    "text", ["xtr_scores(top_k=k)", "xtr_scores(5)", "xtr_kd_scores", "cos_sim", "xtr_scores(x=1)"]
)
def test_multi_vector_refuses_other_strings(models, text):
    with pytest.raises(ValueError, match="similarity_fct"):
        CachedMultiVectorLoss(models["multi_vector"], similarity_fct=text)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"directions": TWO, "partition_mode": "per_direction"},
        {
            "directions": FOUR,
            "partition_mode": "joint",
            "hardness_mode": "all_negatives",
            "hardness_strength": 5.0,
        },
        {"scale": 30.0, "similarity_fct": dot_score, "mini_batch_size": 4, "gather_across_devices": True},
    ],
)
def test_config_equals_theirs_for_their_settings(models, kwargs):
    """Their ``test_cmnrl_attributes_and_config_back_compat`` compares configs with ``==``."""
    model = models["dense"]
    theirs = st_losses.CachedMultipleNegativesRankingLoss(model, **kwargs).get_config_dict()
    assert CachedMNRLoss(model, **kwargs).get_config_dict() == theirs
    if kwargs.get("directions") == TWO:
        assert CachedCLIPLoss(model, **kwargs).get_config_dict() == theirs


def test_sparse_regularizers_stay_flops(models):
    model = models["splade"]
    loss = CachedSparseLoss(
        model, SparseMultipleNegativesRankingLoss(model), 3e-5, document_regularizer_threshold=10
    )
    assert isinstance(loss.document_regularizer, FlopsLoss)


@pytest.mark.parametrize(
    "sizes", [{"mini_batch_size": "auto"}, {"mini_batch_size": 8, "mini_batch_num_tokens": "auto"}]
)
@pytest.mark.parametrize("kind", ["dense", "multi_vector", "cross_encoder"])
def test_an_auto_loss_rebuilds_from_its_config(models, tmp_path, kind, sizes):
    """The config of a loss whose mini-batches are "auto" carries what rebuilding it needs: "auto" and its
    memory budget (off CUDA an "auto" loss without a budget is refused); the multi-vector scoring chunk that
    follows an "auto" mini_batch_size is written as None (their key takes a count)."""
    from st_cached_losses import CachedCrossEncoderLoss
    from tests.support.tiny_model import make_tiny_cross_encoder

    if kind == "cross_encoder" and "mini_batch_num_tokens" in sizes:
        pytest.skip("sentence-transformers' reranker config has no mini_batch_num_tokens key")
    cls, model = {
        "dense": (CachedMNRLoss, models["dense"]),
        "multi_vector": (CachedMultiVectorLoss, models["multi_vector"]),
        "cross_encoder": (CachedCrossEncoderLoss, None),
    }[kind]
    if model is None:
        model = make_tiny_cross_encoder(tmp_path / "ce")
    loss = cls(model, **sizes, mini_batch_memory_budget="64MB")
    config = loss.get_config_dict()
    assert config["mini_batch_memory_budget"] == 64_000_000
    assert {k: config[k] for k in sizes} == sizes
    if kind == "multi_vector":
        assert config["score_mini_batch_size"] == (None if sizes["mini_batch_size"] == "auto" else 8)
    rebuilt = cls(model, **config)
    again = rebuilt.get_config_dict()
    if kind == "cross_encoder":  # its activation_fn is written as a name: compared apart (not this test's)
        again.pop("activation_fn"), config.pop("activation_fn")
    assert again == config
    assert (rebuilt.mini_batch_memory_budget, rebuilt.mini_batch_size) == (
        64_000_000,
        sizes["mini_batch_size"],
    )
    fixed = cls(model, mini_batch_size=8)
    assert "mini_batch_memory_budget" not in fixed.get_config_dict()


def _every_loss(models: dict[str, Any], ce_model: Any) -> list[tuple[str, Any]]:
    """One loss of every registered name, several settings away from their defaults (the variants of
    the sparse loss with their base losses)."""
    from sentence_transformers.multi_vector_encoder.scoring import xtr_kd_scores
    from sentence_transformers.sparse_encoder.losses import SparseDistillKLDivLoss, SparseMarginMSELoss
    from sentence_transformers.util import pairwise_cos_sim

    import st_cached_losses as s

    dense, mv, splade = models["dense"], models["multi_vector"], models["splade"]
    return [
        ("mnr", s.CachedMNRLoss(dense, 13.0, mini_batch_size=2, negative_bank_size=4, learnable_scale=True)),
        ("clip", s.CachedCLIPLoss(dense, mini_batch_size=2, mask_duplicates=True, tile_size=3)),
        ("tiled", s.CachedTiledLoss(dense, mini_batch_size=2, symmetric=True, hardness_mode="all_negatives",
                                    hardness_strength=2.0)),
        ("gist", s.CachedGISTLoss(dense, None, 0.05, 2, margin=-0.1, contrast_anchors=False)),
        ("sparse", s.CachedSparseLoss(splade, SparseMultipleNegativesRankingLoss(splade), 3e-5, 5e-5,
                                      mini_batch_size=2, document_regularizer_threshold=10)),
        ("sparse_distill_kl", s.CachedSparseLoss(splade, SparseDistillKLDivLoss(splade), 3e-5, mini_batch_size=2)),
        ("sparse_margin_mse", s.CachedSparseLoss(splade, SparseMarginMSELoss(splade), 3e-5, mini_batch_size=2)),
        ("multi_vector", s.CachedMultiVectorLoss(mv, scale=2.0, similarity_fct="meanmaxsim", mini_batch_size=2)),
        ("cross_encoder", s.CachedCrossEncoderLoss(ce_model, 2, 5.0, torch.nn.Tanh(), mini_batch_size=3)),
        ("distill_kl", s.CachedDistillKLDivLoss(dense, pairwise_cos_sim, 0.5, teacher_temperature=2.0,
                                                mini_batch_size=2, infonce_weight=0.2)),
        ("margin_mse", s.CachedMarginMSELoss(dense, mini_batch_size=2, infonce_weight=0.1, infonce_scale=10.0)),
        ("multi_vector_distill_kl", s.CachedMultiVectorDistillKLDivLoss(mv, similarity_fct=xtr_kd_scores,
                                                                        temperature=2.0, mini_batch_size=2)),
        ("multi_vector_margin_mse", s.CachedMultiVectorMarginMSELoss(mv, mini_batch_size=2, infonce_weight=0.5)),
        ("siglip", s.CachedSigLIPLoss(dense, 5.0, -3.0, True, 2, similarity_fct="dot", path="tiled")),
        ("embed_distill", s.CachedEmbedDistillLoss(dense, "l2", 12, mini_batch_size=2, listwise_weight=0.5,
                                                   listwise_teacher_scale=10.0, tile_size=3)),
    ]  # fmt: skip


def _train_step(name: str, loss: Any) -> None:
    """One training step of ``loss`` on a tiny batch of its kind: a finite loss and a gradient in the model."""
    from tests.support.tiny_model import random_texts

    model = loss.model
    n_columns = 3
    if name == "cross_encoder":
        inputs: Any = [random_texts(4, seed=k) for k in range(n_columns)]
    else:
        inputs = [model.preprocess(random_texts(4, seed=k)) for k in range(n_columns)]
    labels = None
    if loss.distillation or name.startswith("sparse_"):
        labels = torch.randn(4, n_columns - 1)  # a teacher's score of each candidate column
    if name == "embed_distill":
        labels = torch.randn(4, n_columns, 12)  # a teacher's embedding of each row of each column
    model.zero_grad()
    out = loss(inputs, labels)
    total = sum(out.values()) if isinstance(out, dict) else out
    total.backward()
    assert torch.isfinite(total)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads), name


def test_every_loss_rebuilds_from_its_own_config_and_trains(models, tmp_path):
    """Every registered loss (issue 51): ``type(loss)(model, **loss.get_config_dict())`` builds (the
    distillation losses wrote similarity names their constructors refused, the reranker an activation it
    accepted as a string and crashed on at the first step), its config is the same, and it trains a step."""
    from st_cached_losses.losses.registry import names
    from tests.support.tiny_model import make_tiny_cross_encoder

    built = _every_loss(models, make_tiny_cross_encoder(tmp_path / "ce"))
    assert sorted(n for n, _ in built) == sorted(names()), "a registered loss is missing here"
    for name, loss in built:
        config = loss.get_config_dict()
        rebuilt = type(loss)(loss.model, **config)
        assert rebuilt.get_config_dict() == config, name
        _train_step(name, rebuilt)
