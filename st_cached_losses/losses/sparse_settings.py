"""The settings of [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss] as properties, its model
card config and citation.

The base loss's settings (``scale``, ``similarity_fct``, ``directions``, ``partition_mode``, ``hardness_*``,
``gather_across_devices``) stay on the base loss, as in sentence-transformers: they are properties here that
read and set the base loss's attribute, and are checked again at every step (`_core_options`), however
they were set. The regularisers' weights and ``use_document_regularizer_only`` are checked when set.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sparse_encoder.losses import FlopsLoss
from torch import Tensor, nn

from st_cached_losses.functional import Similarity, scale_value
from st_cached_losses.losses._base import CachedInfoNCEBase, LossTerms, StepData
from st_cached_losses.losses.cached_mnr import ranking_citations, ranking_terms
from st_cached_losses.losses.settings import (
    ONE_DIRECTION,
    TWO_DIRECTIONS,
    Setting,
    check_bool,
    check_directions,
    check_hardness,
    is_symmetric,
    resolve_similarity,
)
from st_cached_losses.losses.settings import check_nonnegative as weight_value  # the weights' one check

logger = logging.getLogger(__name__)

__all__ = ["SparseLossSettings", "is_flops", "on_core", "weight_value"]


def on_core(loss: nn.Module) -> bool:
    """Whether the base loss is sentence-transformers' multiple-negatives ranking loss (their
    ``SparseMultipleNegativesRankingLoss`` is one), whose loss and gradient the core computes."""
    return (
        isinstance(loss, MultipleNegativesRankingLoss)
        and type(loss).compute_loss_from_embeddings
        is MultipleNegativesRankingLoss.compute_loss_from_embeddings
    )


def is_flops(regularizer: nn.Module) -> bool:
    """Whether a regulariser is their ``FlopsLoss`` (computed from column sums), not another one."""
    return (
        isinstance(regularizer, FlopsLoss)
        and type(regularizer).compute_loss_from_embeddings is FlopsLoss.compute_loss_from_embeddings
    )


#: the base loss's settings read through this loss, checked again at every step when one changed
_BASE_OPTIONS = (
    "scale",
    "similarity_fct",
    "gather_across_devices",
    "directions",
    "partition_mode",
    "hardness_mode",
    "hardness_strength",
)


def _required_weight(name: str, value: Any) -> float:
    """A weight that may not be None (the documents' regulariser's)."""
    weight = weight_value(name, value, optional=False)
    assert weight is not None  # not optional
    return weight


def _as_tuple(name: str, value: Any) -> Any:
    """``directions`` kept as a tuple, as sentence-transformers keeps it (checked with the others)."""
    return tuple(value) if not isinstance(value, str) else value


class SparseLossSettings(CachedInfoNCEBase):
    """The settable settings of the sparse loss; the values live in the base loss (``self.loss``), the
    regularisers and the private attributes that [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss]'s constructor sets."""

    loss: nn.Module
    document_regularizer: nn.Module
    query_regularizer: nn.Module | None
    _checked: tuple[Any, ...] | None

    mask_duplicates = Setting[bool]()

    # ------------------------------------------------------------------ settings

    def _check_query_weight(self, value: float | None) -> float | None:
        if value is not None and self.query_regularizer is None:
            raise ValueError(
                "query_regularizer_weight needs a query regulariser: with use_document_regularizer_only=True every "
                "column is a document. Set use_document_regularizer_only=False first."
            )
        return value

    def _check_document_only(self, value: bool) -> bool:
        if value and self.query_regularizer_weight is not None:
            raise ValueError(
                "use_document_regularizer_only=True regularises every column as a document: set "
                "query_regularizer_weight=None first."
            )
        return value

    def _default_query_regularizer(self, old: object, new: bool) -> None:
        if not new and self.query_regularizer is None:
            # the default query regulariser, as the constructor would have made it
            self.query_regularizer = FlopsLoss(cast(Any, self.model), threshold=None)

    def _regularizer(self, name: str) -> nn.Module | None:
        """The regulariser that keeps the FLOPS threshold ``name``, or None (none, or without a threshold)."""
        regularizer = getattr(self, name.replace("_threshold", ""))
        return regularizer if hasattr(regularizer, "threshold") else None

    document_regularizer_weight = Setting[float](check=_required_weight)
    #: None: the queries are not regularised (always None with ``use_document_regularizer_only``).
    query_regularizer_weight = Setting[float | None](validate=_check_query_weight)
    use_document_regularizer_only = Setting[bool](
        validate=_check_document_only, after=_default_query_regularizer
    )

    def _check_document_threshold(self, value: float | None) -> float | None:
        return self._threshold_settable("document", value)

    def _check_query_threshold(self, value: float | None) -> float | None:
        return self._threshold_settable("query", value)

    def _threshold_settable(self, kind: str, value: float | None) -> float | None:
        name = f"{kind}_regularizer_threshold"
        regularizer = getattr(self, f"{kind}_regularizer")
        if value is not None and (regularizer is None or not hasattr(regularizer, "threshold")):
            raise ValueError(
                f"{name} needs a query regulariser: with use_document_regularizer_only=True every column is a "
                "document. Set use_document_regularizer_only=False first."
                if regularizer is None
                else f"{name}: the {kind} regulariser is a {type(regularizer).__name__}, which has no threshold; "
                f"set its own attributes ({kind}_regularizer), or use the default FlopsLoss."
            )
        return value

    #: The documents' FLOPS counts only rows with more than this many non-zero entries; None: every row.
    #: Kept by the regulariser itself (``document_regularizer.threshold``, as in sentence-transformers), so
    #: an assignment to either is seen; None for a regulariser without a threshold.
    document_regularizer_threshold = Setting[float | None](
        validate=_check_document_threshold, target=_regularizer, attr="threshold"
    )
    #: As ``document_regularizer_threshold``, for the queries' FLOPS (``query_regularizer.threshold``);
    #: None without a query regulariser (``use_document_regularizer_only``).
    query_regularizer_threshold = Setting[float | None](
        validate=_check_query_threshold, target=_regularizer, attr="threshold"
    )

    def _mnrl(self, name: str) -> MultipleNegativesRankingLoss:
        """The base loss, when the core computes it; reading its settings otherwise is an error."""
        if not on_core(self.loss):
            raise AttributeError(
                f"CachedSparseLoss: {name!r} is a setting of SparseMultipleNegativesRankingLoss; the base loss is a "
                f"{type(self.loss).__name__}: read its own attributes (loss.loss)."
            )
        return self.loss  # type: ignore[return-value]

    def _recheck(self, old: object, new: object) -> None:
        self._core_options()  # raises on a value the core cannot take: the assignment is undone

    # the base loss's settings, kept by it (read at every step, an assignment to either is seen)
    scale = Setting[float](target=_mnrl, after=_recheck)
    similarity_fct = Setting[Any](target=_mnrl, after=_recheck)
    gather_across_devices = Setting[bool](target=_mnrl, after=_recheck)
    directions = Setting[tuple[str, ...]](check=_as_tuple, target=_mnrl, after=_recheck)
    partition_mode = Setting[str](target=_mnrl, after=_recheck)
    hardness_mode = Setting[str | None](target=_mnrl, after=_recheck)
    hardness_strength = Setting[float](target=_mnrl, after=_recheck)

    @property
    def similarity(self) -> Similarity:
        return self._core_options()[1]

    def _set_symmetric(self, old: bool, new: bool) -> None:
        if new == old:
            return
        base: Any = self._mnrl("symmetric")
        base.directions, base.partition_mode = (
            (TWO_DIRECTIONS, "per_direction") if new else (ONE_DIRECTION, base.partition_mode)
        )

    #: Whether the base loss has the CLIP pair of directions (``query_to_doc``, ``doc_to_query``, per
    #: direction); setting it sets those on the base loss (a view of its two settings).
    symmetric = Setting[bool](view=is_symmetric, after=_set_symmetric)

    def _core_options(self) -> tuple[float, Similarity]:
        """The base loss's settings, checked (again whenever they changed, however they were set): the
        scale and the core's similarity."""
        base = self._mnrl("options")
        options = tuple(getattr(base, name) for name in _BASE_OPTIONS)
        if options != self._checked:
            scale = scale_value(base.scale)
            self._similarity = resolve_similarity(base.similarity_fct)
            check_bool("gather_across_devices", base.gather_across_devices)
            self._directions = check_directions(base.directions, base.partition_mode, "CachedSparseLoss")
            self._partition_mode = base.partition_mode
            check_hardness(base.hardness_mode, base.hardness_strength, "CachedSparseLoss")
            self._hardness_mode, self._hardness_strength = base.hardness_mode, base.hardness_strength
            self._scale, self._checked = scale, options
        return self._scale, self._similarity

    def scale_tensor(self) -> Tensor | float:
        """The base loss's scale (checked); 1.0 for a base loss the core does not compute."""
        return self._core_options()[0] if on_core(self.loss) else 1.0

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        _, similarity = self._core_options()
        return ranking_terms(
            step,
            n_rows,
            n_columns,
            self._directions,
            self._partition_mode,
            self._hardness_mode,
            self._hardness_strength,
            similarity,
        )

    # ------------------------------------------------------------------ model card

    def get_config_dict(self) -> dict[str, Any]:
        """``SpladeLoss``'s keys (the base loss as a module, rendered with its own config by the model card)
        and ``CachedSpladeLoss``'s ``mini_batch_size`` / ``mini_batch_num_tokens``, then our extras in use."""
        config: dict[str, Any] = {
            "loss": self.loss,
            "document_regularizer_weight": self.document_regularizer_weight,
        }
        if self.query_regularizer_weight is not None:
            config["query_regularizer_weight"] = self.query_regularizer_weight
        for prefix, regularizer in [
            ("document", self.document_regularizer),
            ("query", self.query_regularizer),
        ]:
            if regularizer is None:
                continue
            if not isinstance(regularizer, FlopsLoss):
                config[f"{prefix}_regularizer"] = type(regularizer).__name__
            if getattr(regularizer, "threshold", None) is not None:
                config[f"{prefix}_regularizer_threshold"] = regularizer.threshold
        if self.use_document_regularizer_only:
            config["use_document_regularizer_only"] = True
        config["mini_batch_size"] = self.mini_batch_size
        config["mini_batch_num_tokens"] = self.mini_batch_num_tokens
        return {**config, **self._changed_settings()}

    @property
    def citation(self) -> str:
        """BibTeX for the model card: GradCache, SPLADE, FLOPS, and the base loss's options' papers."""
        extra: tuple[str, ...] = ()
        if on_core(self.loss):
            extra = ranking_citations(
                self.directions, self.partition_mode, self.hardness_mode, self.hardness_strength
            )
        return "".join(self._citations + extra)
