"""The losses' options that need sentence-transformers' objects to check: the similarity function, the
model (it must be splittable into mini-batches) and the columns a step receives."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from st_cached_losses.engine.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.functional import Similarity

logger = logging.getLogger(__name__)

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
    "check_duplicates_masking",
    "check_hardness",
    "check_splittable_model",
    "is_classic",
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
            f"{owner} is not compatible with a SentenceTransformer model based on a StaticEmbedding: its inputs "
            "(flat token ids with offsets, no batch dimension) cannot be split into mini-batches. Use "
            "sentence-transformers' MultipleNegativesRankingLoss, which is cheap for such models."
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
    if sizes[0] == 0:
        raise ValueError(
            f"{owner} got an empty batch: column 0 (the anchors) of this batch has 0 rows (rows per column: "
            f"{sizes}). Every step needs at least one (anchor, positive) pair on every process; check the "
            "sampler or the dataset split that produced this batch (e.g. drop_last, or fewer rows than processes)."
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
    """sentence-transformers' checks of ``directions`` and ``partition_mode`` (same rules and messages, plus
    the fix); every valid combination is computed."""
    if isinstance(directions, str) or not isinstance(directions, Sequence):
        raise ValueError(
            f"{owner}: directions must be a tuple of direction names, e.g. ('query_to_doc',), got {directions!r}."
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
    if len(set(directions)) != len(directions):
        raise ValueError(f"{owner}: directions={directions!r} names a direction twice; name each once.")
    if partition_mode not in VALID_PARTITION_MODES:
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError(
            "partition_mode='per_direction' requires every direction's candidate pool to include the positive pair. "
            "'query_to_query' and 'doc_to_doc' only contain same-type similarities and never include the positive, "
            "making the per-direction loss ill-defined. Use partition_mode='joint' instead."
        )
    return directions


def check_hardness(hardness_mode: str | None, hardness_strength: float, owner: str) -> None:
    """sentence-transformers' checks (and warning) of the hardness options."""
    if hardness_mode not in VALID_HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be one of {set(VALID_HARDNESS_MODES)}, got {hardness_mode!r}")
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, (int, float)):
        raise ValueError(
            f"{owner}: hardness_strength must be a non-negative number, got {hardness_strength!r}."
        )
    if not hardness_strength >= 0.0:
        raise ValueError("hardness_strength must be non-negative.")
    if hardness_mode is not None and hardness_strength == 0.0:
        logger.warning(
            f"hardness_mode={hardness_mode!r} is set but hardness_strength=0.0, so hardness weighting has no "
            "effect. Set hardness_strength to a positive value to enable hardness weighting."
        )


def is_classic(
    directions: Sequence[str], partition_mode: str, hardness_mode: str | None, hardness_strength: float
) -> bool:
    """Whether the options make the one-directional or the symmetric loss without hardness (the
    specialised core paths, which also mask duplicates); anything else runs the general loss."""
    no_hardness = hardness_mode is None or hardness_strength == 0.0
    one = tuple(directions) == ONE_DIRECTION
    two = (
        set(directions) == set(TWO_DIRECTIONS) and len(directions) == 2 and partition_mode == "per_direction"
    )
    return no_hardness and (one or two)


def check_duplicates_masking(mask_duplicates: bool, classic: bool, owner: str) -> None:
    if mask_duplicates and not classic:
        raise ValueError(
            f"{owner}: mask_duplicates=True works with directions=('query_to_doc',) and with the symmetric "
            "('query_to_doc', 'doc_to_query') per_direction loss, without hardness; set mask_duplicates=False (use "
            "the NO_DUPLICATES batch sampler instead) or those options."
        )
