"""A loss refuses, at construction, a sentence-transformers model of another kind than it trains (naming the
losses for the kind it got), and refuses an assignment of a setting that only other cached losses have (naming
them), instead of keeping it as a plain attribute that changes nothing."""

from __future__ import annotations

import re

import pytest
import torch
from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss

from st_cached_losses import (
    CachedCLIPLoss,
    CachedCrossEncoderLoss,
    CachedDistillKLDivLoss,
    CachedEmbedDistillLoss,
    CachedGISTLoss,
    CachedMarginMSELoss,
    CachedMNRLoss,
    CachedMultiVectorDistillKLDivLoss,
    CachedMultiVectorLoss,
    CachedMultiVectorMarginMSELoss,
    CachedSigLIPLoss,
    CachedSparseLoss,
    CachedTiledLoss,
)
from tests.support.tiny_model import (
    make_tiny_cross_encoder,
    make_tiny_model,
    make_tiny_multi_vector,
    make_tiny_splade,
)

EMBEDDING = "CachedCLIPLoss, CachedDistillKLDivLoss, CachedEmbedDistillLoss, CachedGISTLoss, CachedMNRLoss, CachedMarginMSELoss, CachedSigLIPLoss, CachedTiledLoss"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("kinds")
    return {
        "SentenceTransformer": make_tiny_model(base / "st"),
        "CrossEncoder": make_tiny_cross_encoder(base / "ce"),
        "SparseEncoder": make_tiny_splade(base / "splade"),
        "MultiVectorEncoder": make_tiny_multi_vector(base / "mv"),
    }


def build(cls, model, models):
    if cls is CachedGISTLoss:
        return cls(model, models["SentenceTransformer"])
    if cls is CachedSparseLoss:
        return cls(model, SparseMultipleNegativesRankingLoss(models["SparseEncoder"]), 1e-5)
    return cls(model)


LOSSES_FOR = {
    "SentenceTransformer": EMBEDDING,
    "CrossEncoder": "CachedCrossEncoderLoss",
    "SparseEncoder": "CachedSparseLoss",
    "MultiVectorEncoder": "CachedMultiVectorDistillKLDivLoss, CachedMultiVectorLoss, CachedMultiVectorMarginMSELoss",
}
KIND_OF = {
    CachedMNRLoss: "SentenceTransformer",
    CachedCLIPLoss: "SentenceTransformer",
    CachedTiledLoss: "SentenceTransformer",
    CachedSigLIPLoss: "SentenceTransformer",
    CachedGISTLoss: "SentenceTransformer",
    CachedSparseLoss: "SparseEncoder",
    CachedMultiVectorLoss: "MultiVectorEncoder",
    CachedCrossEncoderLoss: "CrossEncoder",
    CachedDistillKLDivLoss: "SentenceTransformer",
    CachedMarginMSELoss: "SentenceTransformer",
    CachedMultiVectorDistillKLDivLoss: "MultiVectorEncoder",
    CachedMultiVectorMarginMSELoss: "MultiVectorEncoder",
    CachedEmbedDistillLoss: "SentenceTransformer",
}


@pytest.mark.parametrize("cls", list(KIND_OF), ids=lambda c: c.__name__)
def test_a_model_of_another_kind_is_refused_naming_the_losses_for_it(models, cls):
    needed = KIND_OF[cls]
    assert cls.model_kind == needed
    build(cls, models[needed], models)  # its own kind is taken
    for kind, model in models.items():
        if kind == needed:
            continue
        message = (
            f"{cls.__name__} expects a model of type {needed}, but got a model of type {kind}. "
            f"{cls.__name__} trains a {needed}; for a {kind} use {LOSSES_FOR[kind]}."
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            build(cls, model, models)


def test_the_registry_reads_each_loss_s_kind():
    from st_cached_losses.config.registry import LOSSES, MODEL_KINDS

    assert {name: KIND_OF[cls] for name, cls in LOSSES.items()} == MODEL_KINDS


GIST_LACKS = {
    "directions": ("query_to_doc", "doc_to_query"),
    "mask_duplicates": True,
    "similarity_fct": torch.nn.CosineSimilarity(dim=-1),
    "hardness_strength": 5.0,
    "symmetric": True,
}


@pytest.mark.parametrize(("name", "value"), list(GIST_LACKS.items()))
def test_a_setting_of_another_loss_is_refused_naming_it(models, name, value):
    st = models["SentenceTransformer"]
    loss = CachedGISTLoss(st, st)
    # (the distillation losses score with a similarity_fct of their own too)
    owners = (
        "CachedCLIPLoss, CachedDistillKLDivLoss, CachedMNRLoss"
        if name == "similarity_fct"
        else "CachedCLIPLoss, CachedMNRLoss"
    )
    with pytest.raises(
        ValueError, match=rf"CachedGISTLoss has no setting '{name}': it is a setting of {owners}"
    ):
        setattr(loss, name, value)
    assert name not in vars(loss) and name not in loss._modules


def test_the_reranker_and_the_embedding_losses_refuse_each_other_s_settings(models):
    reranker = CachedCrossEncoderLoss(models["CrossEncoder"])
    with pytest.raises(
        ValueError, match="CachedCrossEncoderLoss has no setting 'mask_duplicates': it is a setting"
    ):
        reranker.mask_duplicates = True
    mnr = CachedMNRLoss(models["SentenceTransformer"])
    for name, value in (("num_negatives", 3), ("activation_fn", torch.nn.Identity())):
        with pytest.raises(
            ValueError, match=f"has no setting '{name}': it is a setting of CachedCrossEncoderLoss;"
        ):
            setattr(mnr, name, value)
    multi_vector = CachedMultiVectorLoss(models["MultiVectorEncoder"])
    with pytest.raises(ValueError, match="'directions': it is a setting of CachedCLIPLoss, CachedMNRLoss"):
        multi_vector.directions = ("query_to_doc",)
    # their own settings and a user's own attributes are still taken
    reranker.activation_fn = torch.nn.Identity()
    reranker.num_negatives = 2
    mnr.mask_duplicates = True
    mnr.my_note = "kept"
    assert (reranker.num_negatives, mnr.mask_duplicates, mnr.my_note) == (2, True, "kept")
