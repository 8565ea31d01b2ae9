"""The loss registry: which cached loss each name (or alias) means, the defaults the configuration fills in,
and the "did you mean" hint every configuration error uses.

The bottom of the configuration layer: it imports the losses only, so that the arguments class
([`st_cached_losses.config.training_args`][st_cached_losses.config.training_args]), the factory ([`st_cached_losses.config.factory`][st_cached_losses.config.factory]) and the
parser ([`st_cached_losses.config.cli`][st_cached_losses.config.cli]) share one table.
"""

from __future__ import annotations

import inspect
from typing import Any

from sentence_transformers.sparse_encoder.losses import (
    SparseDistillKLDivLoss,
    SparseMarginMSELoss,
    SparseMultipleNegativesRankingLoss,
)

from st_cached_losses.losses import (
    CachedCLIPLoss,
    CachedCrossEncoderLoss,
    CachedDistillKLDivLoss,
    CachedGISTLoss,
    CachedInfoNCEBase,
    CachedMarginMSELoss,
    CachedMNRLoss,
    CachedMultiVectorDistillKLDivLoss,
    CachedMultiVectorLoss,
    CachedMultiVectorMarginMSELoss,
    CachedSparseLoss,
    CachedTiledLoss,
)
from st_cached_losses.losses.settings import closest_name_hint  # the hint of every configuration error

__all__ = [
    "BASE_LOSSES",
    "DEFAULT_GIST_TEMPERATURE",
    "DEFAULT_SCALE",
    "DEFAULT_SCALE_LEARNING_RATE",
    "DISTILLATION_LOSSES",
    "FIELD_NAMES",
    "LOSSES",
    "LOSS_ALIASES",
    "LOSS_DEFAULT_SCALES",
    "MODEL_KINDS",
    "NOT_FIELDS",
    "SPARSE_DISTILLATION_LOSSES",
    "ST_LOSS_NAMES",
    "UNUSED_PARAMETERS",
    "canonical_loss",
    "closest_name_hint",
    "loss_parameters",
]

#: canonical loss name -> class (the InfoNCE family, and the reranker loss, which scores pairs)
LOSSES: dict[str, type[CachedInfoNCEBase] | type[CachedCrossEncoderLoss]] = {
    "mnr": CachedMNRLoss,
    "clip": CachedCLIPLoss,
    "tiled": CachedTiledLoss,
    "gist": CachedGISTLoss,
    "sparse": CachedSparseLoss,
    "multi_vector": CachedMultiVectorLoss,
    "cross_encoder": CachedCrossEncoderLoss,
    "distill_kl": CachedDistillKLDivLoss,
    "margin_mse": CachedMarginMSELoss,
    "multi_vector_distill_kl": CachedMultiVectorDistillKLDivLoss,
    "multi_vector_margin_mse": CachedMultiVectorMarginMSELoss,
    # CachedSparseLoss with a distillation base loss (BASE_LOSSES), built from the fields
    "sparse_distill_kl": CachedSparseLoss,
    "sparse_margin_mse": CachedSparseLoss,
}
#: the sparse distillation losses: CachedSparseLoss with sentence-transformers' SparseDistillKLDivLoss /
#: SparseMarginMSELoss as its base loss
SPARSE_DISTILLATION_LOSSES = ("sparse_distill_kl", "sparse_margin_mse")
#: the distillation losses: teacher scores in the dataset's label column, at least one negative column
DISTILLATION_LOSSES = (
    "distill_kl",
    "margin_mse",
    "multi_vector_distill_kl",
    "multi_vector_margin_mse",
    *SPARSE_DISTILLATION_LOSSES,
)
#: every accepted spelling (case-insensitive) -> canonical name
LOSS_ALIASES: dict[str, str] = {
    **{name: name for name in LOSSES},
    # a class that several names share (CachedSparseLoss) means the first of them ('sparse')
    **{cls.__name__.lower(): name for name, cls in reversed(LOSSES.items())},
    "multi-vector": "multi_vector",
    "multivector": "multi_vector",
    "cross-encoder": "cross_encoder",
    "crossencoder": "cross_encoder",
    **{name.replace("_", "-"): name for name in DISTILLATION_LOSSES},
}
#: sentence-transformers' cached losses (their class names, lower case) -> ours, by the model kind they train:
#: a run written for theirs names its loss as before. Two of theirs share the name
#: CachedMultipleNegativesRankingLoss (the SentenceTransformer's and the CrossEncoder's): the arguments class,
#: which trains one kind, tells them apart
ST_LOSS_NAMES: dict[str, dict[str, str]] = {
    "cachedmultiplenegativesrankingloss": {"SentenceTransformer": "mnr", "CrossEncoder": "cross_encoder"},
    "cachedmultiplenegativessymmetricrankingloss": {"SentenceTransformer": "clip"},
    "cachedgistembedloss": {"SentenceTransformer": "gist"},
    "cachedspladeloss": {"SparseEncoder": "sparse"},
    "cachedmultivectormultiplenegativesrankingloss": {"MultiVectorEncoder": "multi_vector"},
    # their non-cached distillation losses (they have no cached ones)
    "distillkldivloss": {"SentenceTransformer": "distill_kl"},
    "marginmseloss": {"SentenceTransformer": "margin_mse"},
    "multivectordistillkldivloss": {"MultiVectorEncoder": "multi_vector_distill_kl"},
    "multivectormarginmseloss": {"MultiVectorEncoder": "multi_vector_margin_mse"},
    "sparsedistillkldivloss": {"SparseEncoder": "sparse_distill_kl"},
    "sparsemarginmseloss": {"SparseEncoder": "sparse_margin_mse"},
}
#: the model (and trainer) each loss trains: sentence-transformers' class names
MODEL_KINDS: dict[str, str] = {name: cls.model_kind for name, cls in LOSSES.items()}
#: losses whose ranking loss is an object of its own, built by the factory from the fields: its class, whose
#: constructor arguments (but the model) are fields too
BASE_LOSSES: dict[str, type[Any]] = {
    "sparse": SparseMultipleNegativesRankingLoss,
    "sparse_distill_kl": SparseDistillKLDivLoss,
    "sparse_margin_mse": SparseMarginMSELoss,
}
#: constructor arguments of a loss's class that its base loss leaves unused, so no field sets them:
#: CachedSparseLoss's options of the core's ranking loss, which a distillation base loss (each row's own
#: scores, through autograd on the whole batch) does not run
UNUSED_PARAMETERS: dict[str, frozenset[str]] = {
    name: frozenset({"mask_duplicates", "path", "tile_size", "memory_budget", "matmul_precision"})
    for name in SPARSE_DISTILLATION_LOSSES
}


def canonical_loss(name: str, kind: str | None = None) -> str | None:
    """Our canonical name of loss ``name`` (ours, an alias, our class name or sentence-transformers' class
    name, any case), for an arguments class that trains ``kind`` (None: any); None for no cached loss.

    A sentence-transformers name for the kind's loss gives ours (``CachedMultipleNegativesRankingLoss``:
    'mnr', or 'cross_encoder' for a CrossEncoder); one for another kind gives that kind's loss (the
    arguments class then says which class to use)."""
    key = str(name).lower()
    if key in LOSS_ALIASES:
        return LOSS_ALIASES[key]
    ours = ST_LOSS_NAMES.get(key)
    if ours is None:
        return None
    return ours.get(kind or "", next(iter(ours.values())))


#: constructor arguments set by an arguments field of another name
FIELD_NAMES = {
    "similarity_fct": "similarity",
    "show_progress_bar": "loss_show_progress_bar",
    "guide": "guide_model",
}
#: constructor arguments no field sets, and why
NOT_FIELDS = {
    "model": "the trainer's model: build_loss(model, args) passes it",
    "loss": "CachedSparseLoss's base loss, an object: build_loss builds SparseMultipleNegativesRankingLoss "
    "('sparse') from the fields scale, similarity, gather_across_devices, directions, partition_mode and "
    "hardness_*, SparseDistillKLDivLoss ('sparse_distill_kl') from similarity, temperature, student_temperature "
    "and teacher_temperature, SparseMarginMSELoss ('sparse_margin_mse') from similarity; construct "
    "CachedSparseLoss yourself for another base loss",
    "document_regularizer": "an object: the default FlopsLoss, counting rows above document_regularizer_threshold; "
    "construct CachedSparseLoss yourself for another regulariser",
    "activation_fn": "an nn.Module: the default (torch.nn.Sigmoid, as sentence-transformers'); construct "
    "CachedCrossEncoderLoss yourself for another activation",
    "query_regularizer": "an object: the default FlopsLoss, counting rows above query_regularizer_threshold; "
    "construct CachedSparseLoss yourself for another regulariser",
}


def loss_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The constructor arguments of loss ``name`` (canonical) that a field may set: its class's (but
    ``self`` and those its base loss leaves unused, ``UNUSED_PARAMETERS``), then its base loss's (but
    ``self`` and ``model``), which the factory passes to the base loss."""
    params = dict(inspect.signature(LOSSES[name].__init__).parameters)
    for key in ("self", *UNUSED_PARAMETERS.get(name, ())):
        params.pop(key, None)
    base = BASE_LOSSES.get(name)
    if base is not None:
        for key, param in inspect.signature(base.__init__).parameters.items():
            if key not in ("self", "model"):
                params.setdefault(key, param)
    return params


def _st_default_scale(name: str) -> float:
    """The scale sentence-transformers' own loss starts from (the base loss's for 'sparse')."""
    return float(loss_parameters(name)["scale"].default)


DEFAULT_SCALE = 20.0
#: losses whose default scale is not DEFAULT_SCALE: sentence-transformers' own default (1.0, dot-product
#: and MaxSim scores are unbounded; 10.0 for the reranker's sigmoid scores), read from the signatures
LOSS_DEFAULT_SCALES: dict[str, float] = {
    name: _st_default_scale(name) for name in ("sparse", "multi_vector", "cross_encoder")
}
# the KL losses' temperature (1.0, as theirs; SparseDistillKLDivLoss's 2.0) is the inverse of the scale field's default
LOSS_DEFAULT_SCALES.update(
    {
        name: 1.0 / float(loss_parameters(name)["temperature"].default)
        for name in ("distill_kl", "multi_vector_distill_kl", "sparse_distill_kl")
    }
)
#: GISTEmbedLoss's default temperature (scale 100), used by loss='gist' when neither scale nor temperature is given
DEFAULT_GIST_TEMPERATURE = 0.01
#: the default learning rate of a learnable scale (its own optimizer group, see ``scale_learning_rate``)
DEFAULT_SCALE_LEARNING_RATE = 1e-2
