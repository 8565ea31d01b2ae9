"""The losses' options that need sentence-transformers' objects to check: the similarity function, the
model (it must be splittable into mini-batches) and the columns a step receives."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from st_cached_losses.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.functional import Similarity

__all__ = [
    "ONE_DIRECTION",
    "TWO_DIRECTIONS",
    "VALID_DIRECTIONS",
    "VALID_HARDNESS_MODES",
    "VALID_PARTITION_MODES",
    "ConfigTuple",
    "check_bool",
    "check_columns",
    "check_directions",
    "check_hardness",
    "check_splittable_model",
    "resolve_similarity",
]


def resolve_similarity(similarity_fct: Callable[..., Tensor] | str) -> Similarity:
    """Map sentence-transformers' ``cos_sim`` / ``dot_score`` (or "cosine" / "dot") to the core's names.

    A ``functools.partial`` of either with nothing bound counts as the function. Any other callable is
    refused: the loss never builds the full similarity matrix, so it cannot call an arbitrary function on it.
    """
    if isinstance(similarity_fct, str):
        name = similarity_fct.lower()
        aliases = {
            "cosine": "cosine",
            "cos_sim": "cosine",
            "cos": "cosine",
            "dot": "dot",
            "dot_score": "dot",
            "dot_product": "dot",
        }
        if name in aliases:
            return aliases[name]  # type: ignore[return-value]
    else:
        from sentence_transformers.util import cos_sim, dot_score

        if (
            isinstance(similarity_fct, functools.partial)
            and not similarity_fct.args
            and not similarity_fct.keywords
        ):
            similarity_fct = similarity_fct.func  # a bare partial(cos_sim) is cos_sim
        if similarity_fct is cos_sim:
            return "cosine"
        if similarity_fct is dot_score:
            return "dot"
    raise ValueError(
        f"similarity_fct={similarity_fct!r} is not supported: the loss is computed in tiles and never builds the "
        "similarity matrix, so it must know the similarity. Pass sentence_transformers.util.cos_sim, "
        "sentence_transformers.util.dot_score, 'cosine' or 'dot'."
    )


def check_splittable_model(model: nn.Module, owner: str) -> None:
    """Refuse a StaticEmbedding model: its inputs (flat token ids with offsets) have no batch dimension
    to cut into mini-batches."""
    try:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:  # pragma: no cover - layout of other versions
        return
    if any(isinstance(m, StaticEmbedding) for m in unwrap_model(model).modules()):
        raise ValueError(
            f"{owner} cannot split a StaticEmbedding model's inputs (flat token ids with offsets, no batch "
            "dimension) into mini-batches; use sentence_transformers.losses.MultipleNegativesRankingLoss, which "
            "is cheap for such models."
        )


def check_columns(sentence_features: Sequence[dict[str, Any]], owner: str) -> None:
    """At least (anchor, positive), every column splittable, and the same number of rows in each."""
    if len(sentence_features) < 2:
        raise ValueError(
            f"{owner} needs at least two text columns, (anchor, positive[, negatives...]); got "
            f"{len(sentence_features)}. Check the dataset's columns (a 'label'/'score' column is not a text column)."
        )
    sizes = []
    for features in sentence_features:
        check_splittable(features)
        sizes.append(batch_size_of(features))
    if len(set(sizes)) > 1:
        raise ValueError(
            f"all columns must have the same number of rows, got {sizes}: every anchor needs one positive (and "
            "one row in each hard-negative column)."
        )


#: the values sentence-transformers' MultipleNegativesRankingLoss accepts for these options
VALID_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
VALID_PARTITION_MODES = ("joint", "per_direction")
VALID_HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")
ONE_DIRECTION = ("query_to_doc",)
TWO_DIRECTIONS = ("query_to_doc", "doc_to_query")


class ConfigTuple(tuple[str, ...]):
    """A tuple in a loss's config (``directions``, a tuple as in sentence-transformers' config) that also
    equals the list a JSON round trip makes of it, so a config read back from a model card compares equal."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return list(self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def check_directions(directions: Sequence[str], partition_mode: str, owner: str) -> tuple[str, ...]:
    """sentence-transformers' checks of ``directions`` and ``partition_mode`` (same rules), then ours:
    the combinations the core computes so far are the one-direction loss and the symmetric loss with one
    softmax per direction; any other valid combination is refused, never ignored."""
    if isinstance(directions, str) or not isinstance(directions, Sequence):
        raise ValueError(
            f"directions must be a tuple of direction names, e.g. ('query_to_doc',), got {directions!r}."
        )
    directions = tuple(directions)
    if not directions:
        raise ValueError("At least one direction must be specified.")
    if set(directions) - set(VALID_DIRECTIONS):
        raise ValueError(
            f"Invalid directions: {set(directions) - set(VALID_DIRECTIONS)}. Valid: {set(VALID_DIRECTIONS)}"
        )
    if "query_to_doc" not in directions:
        raise ValueError("'query_to_doc' direction is required (contains the positive pair).")
    if partition_mode not in VALID_PARTITION_MODES:
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError(
            "partition_mode='per_direction' is not compatible with 'query_to_query' or 'doc_to_doc' directions."
        )
    if set(directions) == set(ONE_DIRECTION) and len(directions) == 1:
        return directions
    if set(directions) == set(TWO_DIRECTIONS) and len(directions) == 2 and partition_mode == "per_direction":
        return directions
    raise ValueError(
        f"directions={directions!r} with partition_mode={partition_mode!r} is not supported yet by {owner}: "
        "supported are directions=('query_to_doc',) (the MNRL / InfoNCE loss) and directions=('query_to_doc', "
        "'doc_to_query') with partition_mode='per_direction' (the symmetric, CLIP loss). To switch to the "
        "symmetric loss after construction, set partition_mode='per_direction' before directions."
    )


def check_hardness(hardness_mode: str | None, hardness_strength: float, owner: str) -> None:
    if hardness_mode not in VALID_HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be one of {VALID_HARDNESS_MODES}, got {hardness_mode!r}")
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, (int, float)):
        raise ValueError(f"hardness_strength must be a non-negative number, got {hardness_strength!r}.")
    if not hardness_strength >= 0.0:
        raise ValueError("hardness_strength must be non-negative.")
    if hardness_mode is not None:
        raise ValueError(
            f"hardness_mode={hardness_mode!r} is not supported yet by {owner}: only hardness_mode=None (no hardness "
            "weighting) is; leave it None, or use sentence_transformers' CachedMultipleNegativesRankingLoss."
        )
