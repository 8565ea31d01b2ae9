"""The losses' options that need sentence-transformers' objects to check: the similarity function, the
model (it must be splittable into mini-batches) and the columns a step receives."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from st_cached_losses.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.functional import Similarity

__all__ = ["check_columns", "check_splittable_model", "resolve_similarity"]


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
