"""The arguments for the sparse and multi-vector losses: built from a dict, YAML or the command line; fields
the chosen loss does not take refused; a model of another kind refused; their card settings."""

from __future__ import annotations

import pytest
import yaml

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss
from st_cached_losses.config.training_args import (
    CachedLossArguments,
)
from tests.config.helpers import ARGS, BASE, _arguments, _class_of, parse_cli
from tests.support.st_version import ST_6_3
from tests.support.tiny_model import make_tiny_model

SPARSE_FIELDS = {
    "loss": "sparse",
    "document_regularizer_weight": 3e-5,
    "query_regularizer_weight": 5e-5,
    "document_regularizer_threshold": 40,
    "query_regularizer_threshold": 20,
    "mini_batch_size": 4,
    "hardness_mode": "in_batch_negatives",
    "hardness_strength": 2.0,
    "mask_duplicates": True,
}


MULTI_VECTOR_FIELDS = {
    "loss": "multi_vector",
    "similarity": "xtr",
    "score_mini_batch_size": 3,
    "mini_batch_size": 4,
    "path": "tiled",
    "tile_size": 16,
}


def _cli_argv(fields: dict) -> list[str]:
    argv = []
    for key, value in fields.items():
        argv += [f"--{key}", str(value)]
    return argv


@pytest.mark.parametrize("source", ["dict", "yaml", "cli"])
def test_sparse_loss_from_the_arguments(tmp_path, source):
    """loss: sparse builds CachedSparseLoss around a SparseMultipleNegativesRankingLoss with
    sentence-transformers' defaults (scale 1, dot product) and the configured regularisers, from a dict, a
    YAML file or the command line."""
    from sentence_transformers.sparse_encoder.losses import FlopsLoss, SparseMultipleNegativesRankingLoss
    from sentence_transformers.util import dot_score

    from st_cached_losses import CachedSparseLoss
    from tests.support.tiny_model import make_tiny_splade

    args = _parsed(tmp_path, source, SPARSE_FIELDS)
    assert args.model_kind == "SparseEncoder" and args.loss_scale == 1.0
    loss = build_loss(make_tiny_splade(tmp_path / "splade"), args)
    assert type(loss) is CachedSparseLoss
    assert type(loss.loss) is SparseMultipleNegativesRankingLoss
    assert (loss.loss.scale, loss.loss.similarity_fct) == (1.0, dot_score)
    assert (loss.loss.hardness_mode, loss.loss.hardness_strength) == ("in_batch_negatives", 2.0)
    assert (loss.document_regularizer_weight, loss.query_regularizer_weight) == (3e-5, 5e-5)
    assert isinstance(loss.document_regularizer, FlopsLoss) and loss.document_regularizer.threshold == 40
    assert isinstance(loss.query_regularizer, FlopsLoss) and loss.query_regularizer.threshold == 20
    assert (loss.mini_batch_size, loss.mask_duplicates, loss.use_document_regularizer_only) == (
        4,
        True,
        False,
    )

    scaled = _arguments(
        **BASE,
        **{**SPARSE_FIELDS, "temperature": 0.05, "similarity": "cosine", "gather_across_devices": True},
    )
    loss = build_loss(make_tiny_splade(tmp_path / "splade2"), scaled)
    assert loss.loss.scale == pytest.approx(20.0) and loss.loss.gather_across_devices
    assert loss.loss.similarity_fct.__name__ == "cos_sim"


@pytest.mark.parametrize("source", ["dict", "yaml", "cli"])
def test_multi_vector_loss_from_the_arguments(tmp_path, source):
    """loss: multi_vector builds CachedMultiVectorLoss with sentence-transformers' defaults (scale 1, MaxSim)
    unless configured: here XTR, score_mini_batch_size, the tiled path."""
    from sentence_transformers.multi_vector_encoder.scoring import (
        colbert_scores,
        mean_colbert_scores,
        xtr_scores,
    )

    from st_cached_losses import CachedMultiVectorLoss
    from st_cached_losses.functional.representations.multi_vector import XTR, MaxSim
    from tests.support.tiny_model import make_tiny_multi_vector

    model = make_tiny_multi_vector(tmp_path / "mv")
    args = _parsed(tmp_path, source, MULTI_VECTOR_FIELDS)
    assert args.model_kind == "MultiVectorEncoder"
    loss = build_loss(model, args)
    assert type(loss) is CachedMultiVectorLoss
    assert (loss.scale, loss.similarity_fct, loss.similarity) == (1.0, xtr_scores, XTR(256))
    assert (loss.score_mini_batch_size, loss.mini_batch_size, loss.path, loss.tile_size) == (
        3,
        4,
        "tiled",
        16,
    )
    default = build_loss(model, _arguments(**BASE, loss="multi_vector", mini_batch_size=4))
    assert (default.scale, default.similarity) == (1.0, MaxSim())
    # sentence-transformers 6.3 writes its default (the model's similarity) as None, 6.2 its MaxSim by name
    expected = None if ST_6_3 else colbert_scores.__name__
    assert default.get_config_dict()["similarity_fct"] == expected
    mean = build_loss(
        model,
        _arguments(
            **BASE, loss="CachedMultiVectorLoss", similarity="MeanMaxSim", scale=8.0, mini_batch_size=4
        ),
    )
    assert (mean.scale, mean.similarity_fct, mean.similarity) == (8.0, mean_colbert_scores, MaxSim(True))


def _parsed(tmp_path, source: str, fields: dict) -> CachedLossArguments:
    if source == "dict":
        return _arguments(**BASE, **fields)
    if source == "yaml":
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({**BASE, **fields}))
        (args,) = CachedLossArgumentParser(_class_of(fields["loss"])).parse_yaml_file(
            str(tmp_path / "run.yaml")
        )
        return args
    return parse_cli(_cli_argv(fields), _class_of(fields["loss"]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss": "sparse"}, "needs document_regularizer_weight"),
        ({"loss": "sparse", "document_regularizer_weight": -1.0}, "document_regularizer_weight must be"),
        (
            {"loss": "sparse", "document_regularizer_weight": 1e-5, "score_mini_batch_size": 4},
            "score_mini_batch_size",
        ),
        ({"loss": "sparse", "document_regularizer_weight": 1e-5, "similarity": "maxsim"}, "similarity"),
        ({"loss": "sparse", "document_regularizer_weight": 1e-5, "learnable_scale": True}, "learnable_scale"),
        ({"loss": "multi_vector", "directions": "query_to_doc"}, "directions does not apply"),
        ({"loss": "multi_vector", "hardness_mode": "in_batch_negatives"}, "hardness_mode does not apply"),
        ({"loss": "multi_vector", "mask_duplicates": True}, "mask_duplicates does not apply"),
        ({"loss": "multi_vector", "max_scale": 50.0}, "max_scale does not apply"),
        ({"loss": "multi_vector", "similarity": "dot"}, "'maxsim', 'meanmaxsim' or 'xtr'"),
        (
            {"loss": "multi_vector", "document_regularizer_weight": 1e-5},
            "document_regularizer_weight does not",
        ),
        ({"loss": "multi_vector", "score_mini_batch_size": 0}, "score_mini_batch_size must be"),
        ({"loss": "mnr", "score_mini_batch_size": 4}, "score_mini_batch_size does not apply"),
        ({"loss": "clip", "use_document_regularizer_only": True}, "use_document_regularizer_only does not"),
        (
            {"loss": "gist", "guide_model": "g", "query_regularizer_weight": 1e-5},
            "query_regularizer_weight does",
        ),
        ({"loss": "mnr", "similarity": "xtr"}, "loss='multi_vector'"),
        ({"loss": "multi-vektor"}, "Did you mean loss='multi_vector'"),
    ],
)
def test_fields_the_chosen_loss_does_not_take_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _arguments(**BASE, **kwargs)


def test_a_model_of_another_kind_is_refused_naming_the_one_needed(tmp_path):
    """build_loss checks the model against the loss: a SentenceTransformer for loss='sparse' (or a
    SparseEncoder for 'mnr') names the kind and trainer the loss needs."""
    from tests.support.tiny_model import make_tiny_splade

    dense = make_tiny_model(tmp_path / "dense")
    sparse_args = _arguments(**BASE, loss="sparse", document_regularizer_weight=3e-5, mini_batch_size=4)
    with pytest.raises(
        ValueError, match=r"trains a SparseEncoder, got a SentenceTransformer.*SparseEncoderTrainer"
    ):
        build_loss(dense, sparse_args)
    with pytest.raises(ValueError, match=r"trains a MultiVectorEncoder.*'mnr', 'clip', 'tiled', 'gist'"):
        build_loss(dense, _arguments(**BASE, loss="multi_vector", mini_batch_size=4))
    with pytest.raises(ValueError, match=r"trains a SentenceTransformer, got a SparseEncoder.*'sparse'"):
        build_loss(
            make_tiny_splade(tmp_path / "splade"),
            _arguments(**BASE, loss="mnr", mini_batch_size=4),
        )


def test_model_card_lists_the_sparse_settings_only(tmp_path):
    """The card's loss settings for loss='sparse' name its own fields (and not GIST's or the multi-vector
    loss's): the callback's non-default hyperparameters, from loss_settings."""
    from st_cached_losses.config.training_args import LOSS_DEFAULTS

    args = _arguments(**BASE, **SPARSE_FIELDS)
    changed = {k: v for k, v in args.loss_settings().items() if v != LOSS_DEFAULTS[k]}
    assert changed == {k: v for k, v in SPARSE_FIELDS.items()}


@pytest.mark.parametrize("loss", ["tiled", "gist", "sparse", "multi_vector"])
def test_tile_size_reaches_every_loss_that_takes_it(loss):
    """CachedGISTLoss takes tile_size, but a hand-written list in the arguments refused it for 'gist': which
    loss takes a field is its signature's answer alone."""
    extra = {"guide_model": "guide"} if loss == "gist" else {}
    if loss == "sparse":
        extra["document_regularizer_weight"] = 3e-5
    args = _arguments(**ARGS, loss=loss, tile_size=64, **extra)
    assert args.loss_kwargs()["tile_size"] == 64 and args.loss_settings()["tile_size"] == 64
