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
from st_cached_losses.losses._base import CachedInfoNCEBase, StepData
from st_cached_losses.losses.cached_mnr import ranking_citations, ranking_terms
from st_cached_losses.losses.settings import (
    ONE_DIRECTION,
    SPECS,
    TWO_DIRECTIONS,
    Setting,
    check_bool,
    check_directions,
    check_hardness,
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


#: the base loss's settings read through this loss (each `_base_option` adds its name), checked again
#: at every step when one changed
_BASE_OPTIONS: list[str] = []


def _base_option(name: str, doc: str) -> property:
    """A setting of the base loss (their MNRL's attribute of the same name), read and set through this
    loss: the base loss holds it, as in sentence-transformers, so an assignment to either is seen."""
    _BASE_OPTIONS.append(name)

    def get(self: SparseLossSettings) -> Any:
        return getattr(self._mnrl(name), name)

    def set_(self: SparseLossSettings, value: Any) -> None:
        base = self._mnrl(name)
        old = getattr(base, name)
        setattr(base, name, tuple(value) if name == "directions" and not isinstance(value, str) else value)
        try:
            self._core_options()
        except ValueError:
            setattr(base, name, old)
            raise

    return property(get, set_, doc=doc)


def _threshold_option(kind: str, doc: str) -> property:
    """The FLOPS threshold of the ``kind`` ("document" / "query") regulariser, kept by the regulariser itself
    (``<kind>_regularizer.threshold``); None where there is no regulariser or it has no threshold."""
    name = f"{kind}_regularizer_threshold"

    def get(self: SparseLossSettings) -> float | None:
        return getattr(getattr(self, f"{kind}_regularizer"), "threshold", None)

    def set_(self: SparseLossSettings, value: float | None) -> None:
        SPECS[name].check(name, value)
        regularizer = getattr(self, f"{kind}_regularizer")
        if regularizer is None or not hasattr(regularizer, "threshold"):
            if value is None:
                return
            raise ValueError(
                f"{name} needs a query regulariser: with use_document_regularizer_only=True every column is a "
                "document. Set use_document_regularizer_only=False first."
                if regularizer is None
                else f"{name}: the {kind} regulariser is a {type(regularizer).__name__}, which has no threshold; "
                f"set its own attributes ({kind}_regularizer), or use the default FlopsLoss."
            )
        regularizer.threshold = value  # read by the regulariser at every step (FLOPS counts rows above it)

    return property(get, set_, doc=doc)


class SparseLossSettings(CachedInfoNCEBase):
    """The settable settings of the sparse loss; the values live in the base loss (``self.loss``), the
    regularisers and the private attributes that [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss]'s constructor sets."""

    loss: nn.Module
    document_regularizer: nn.Module
    query_regularizer: nn.Module | None
    _document_regularizer_weight: float
    _query_regularizer_weight: float | None
    _use_document_regularizer_only: bool
    _checked: tuple[Any, ...] | None

    mask_duplicates = Setting[bool]()

    # ------------------------------------------------------------------ settings

    @property
    def document_regularizer_weight(self) -> float:
        return self._document_regularizer_weight

    @document_regularizer_weight.setter
    def document_regularizer_weight(self, value: float) -> None:
        weight = weight_value("document_regularizer_weight", value, optional=False)
        assert weight is not None
        self._document_regularizer_weight = weight

    @property
    def query_regularizer_weight(self) -> float | None:
        """None: the queries are not regularised (always None with ``use_document_regularizer_only``)."""
        return self._query_regularizer_weight

    @query_regularizer_weight.setter
    def query_regularizer_weight(self, value: float | None) -> None:
        weight = weight_value("query_regularizer_weight", value, optional=True)
        if weight is not None and self.query_regularizer is None:
            raise ValueError(
                "query_regularizer_weight needs a query regulariser: with use_document_regularizer_only=True every "
                "column is a document. Set use_document_regularizer_only=False first."
            )
        self._query_regularizer_weight = weight

    @property
    def use_document_regularizer_only(self) -> bool:
        return self._use_document_regularizer_only

    @use_document_regularizer_only.setter
    def use_document_regularizer_only(self, value: bool) -> None:
        if check_bool("use_document_regularizer_only", value) and self._query_regularizer_weight is not None:
            raise ValueError(
                "use_document_regularizer_only=True regularises every column as a document: set "
                "query_regularizer_weight=None first."
            )
        if not value and self.query_regularizer is None:
            # the default query regulariser, as the constructor would have made it
            self.query_regularizer = FlopsLoss(cast(Any, self.model), threshold=None)
        self._use_document_regularizer_only = value

    document_regularizer_threshold = _threshold_option(
        "document",
        """The documents' FLOPS counts only rows with more than this many non-zero entries; None: every row.
        Kept by the regulariser itself (``document_regularizer.threshold``, as in sentence-transformers), so an
        assignment to either is seen; None for a regulariser without a threshold.""",
    )
    query_regularizer_threshold = _threshold_option(
        "query",
        """As [`document_regularizer_threshold`][st_cached_losses.losses.sparse_settings.SparseLossSettings.document_regularizer_threshold], for the queries' FLOPS (``query_regularizer.threshold``);
        None without a query regulariser (``use_document_regularizer_only``).""",
    )

    def _mnrl(self, name: str) -> MultipleNegativesRankingLoss:
        """The base loss, when the core computes it; reading its settings otherwise is an error."""
        if not on_core(self.loss):
            raise AttributeError(
                f"CachedSparseLoss: {name!r} is a setting of SparseMultipleNegativesRankingLoss; the base loss is a "
                f"{type(self.loss).__name__}: read its own attributes (loss.loss)."
            )
        return self.loss  # type: ignore[return-value]

    scale = _base_option("scale", "The base loss's ``scale`` (1 / temperature).")
    similarity_fct = _base_option("similarity_fct", "The base loss's similarity (dot product by default).")
    gather_across_devices = _base_option(
        "gather_across_devices", "The base loss's: score each process's rows against every process's."
    )
    directions = _base_option("directions", "The base loss's ``directions``.")
    partition_mode = _base_option("partition_mode", "The base loss's ``partition_mode``.")
    hardness_mode = _base_option("hardness_mode", "The base loss's ``hardness_mode``.")
    hardness_strength = _base_option("hardness_strength", "The base loss's ``hardness_strength``.")

    @property
    def similarity(self) -> Similarity:
        return self._core_options()[1]

    @property
    def symmetric(self) -> bool:
        """Whether the base loss has the CLIP pair of directions (``query_to_doc``, ``doc_to_query``, per
        direction); setting it sets those on the base loss."""
        return set(self.directions) == set(TWO_DIRECTIONS) and self.partition_mode == "per_direction"

    @symmetric.setter
    def symmetric(self, value: bool) -> None:
        if check_bool("symmetric", value) == self.symmetric:
            return
        base: Any = self._mnrl("symmetric")
        base.directions, base.partition_mode = (
            (TWO_DIRECTIONS, "per_direction") if value else (ONE_DIRECTION, base.partition_mode)
        )

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
        return self._core_options()[0]

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> dict[str, Any]:
        _, similarity = self._core_options()
        terms = ranking_terms(
            step,
            n_rows,
            n_columns,
            self._directions,
            self._partition_mode,
            self._hardness_mode,
            self._hardness_strength,
        )
        return {"similarity": similarity, **terms}

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
        if self.mask_duplicates:
            config["mask_duplicates"] = True
        if self.path != "auto":
            config["path"] = self.path
        if self.tile_size is not None:
            config["tile_size"] = self.tile_size
        return config

    @property
    def citation(self) -> str:
        """BibTeX for the model card: GradCache, SPLADE, FLOPS, and the base loss's options' papers."""
        extra: tuple[str, ...] = ()
        if on_core(self.loss):
            extra = ranking_citations(
                self.directions, self.partition_mode, self.hardness_mode, self.hardness_strength
            )
        return "".join(self._citations + extra)
