"""The InfoNCE losses' settings, declared once: the scale (and a learnable one), and sentence-transformers'
``MultipleNegativesRankingLoss`` options that [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss],
[`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss] and
[`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss] share (the similarity, the directions
and their partition, hardness weighting, duplicate masking, the negative bank, in-batch negatives), with their
checks: sentence-transformers' rules and words, plus the fix."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sentence_transformers.util import cos_sim
from torch import Tensor

from st_cached_losses.functional import Similarity
from st_cached_losses.functional.softmax.options import FALSE_NEGATIVE_FILTERS, FalseNegativeFilter
from st_cached_losses.losses.citations import CONTACCUM_CITATION, GTE_CITATION, HARDNESS_CITATION
from st_cached_losses.losses.settings import (
    LearnableScaleSettings,
    LossStageSettings,
    SharedSettings,
    check_bool,
    closest_name_hint,
    redefault,
    setting,
    view,
)
from st_cached_losses.losses.settings import ScaleSettings as ScaleSettings  # its home moved: settings
from st_cached_losses.losses.similarity import EMBEDDING, SimilarityKind

logger = logging.getLogger(__name__)

__all__ = [
    "ONE_DIRECTION",
    "TWO_DIRECTIONS",
    "VALID_DIRECTIONS",
    "VALID_HARDNESS_MODES",
    "VALID_PARTITION_MODES",
    "ConfigTuple",
    "RankingSettings",
    "check_directions",
    "check_hardness",
    "check_in_batch_negatives",
    "check_negative_bank",
    "check_own_candidates",
    "ranking_citations",
]

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
        return list(self) == other if isinstance(other, list) else tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


# ---------------------------------------------------------------------- the checks


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
    unknown = [d for d in directions if d not in VALID_DIRECTIONS]
    if unknown:
        raise ValueError(
            f"Invalid directions: {set(unknown)}. Valid: {set(VALID_DIRECTIONS)}"
            f"{closest_name_hint(str(unknown[0]), VALID_DIRECTIONS)}"
        )
    if "query_to_doc" not in directions:
        fixed = ("query_to_doc", *directions)
        # the arguments' field (owner "directions") is a comma-separated string; a loss's argument a tuple
        field = owner == "directions"
        given, example = (",".join(directions), ",".join(fixed)) if field else (directions, fixed)
        raise ValueError(
            "'query_to_doc' direction is required (contains the positive pair). "
            f"{'' if field else owner + ': '}directions={given!r} lacks it; add it: directions={example!r}."
        )
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
        modes = [mode for mode in VALID_HARDNESS_MODES if mode is not None]
        raise ValueError(
            f"hardness_mode must be one of {', '.join(map(repr, modes))} (or leave it unset: no hardness weighting), "
            f"got {hardness_mode!r}.{closest_name_hint(str(hardness_mode), modes)}"
        )
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


def check_in_batch_negatives(
    in_batch_negatives: bool, directions: Sequence[str], hardness_mode: str | None, owner: str
) -> None:
    """``in_batch_negatives=False`` scores each anchor against its own candidates: only the ``query_to_doc``
    direction has any (the others score a row against other rows), and ``hardness_mode='in_batch_negatives'``
    would weigh negatives that are not there."""
    if in_batch_negatives:
        return
    if tuple(directions) != ONE_DIRECTION:
        raise ValueError(
            f"{owner}: in_batch_negatives=False scores each anchor against its own positive and hard negatives "
            f"only, so directions must be ('query_to_doc',), got {tuple(directions)!r} (the other directions score "
            "a row against other rows). Set directions=('query_to_doc',) or in_batch_negatives=True."
        )
    if hardness_mode == "in_batch_negatives":
        raise ValueError(
            f"{owner}: hardness_mode='in_batch_negatives' weighs in-batch negatives, which in_batch_negatives=False "
            "removes; use hardness_mode='hard_negatives' (or 'all_negatives') to weigh the own hard negatives."
        )


def check_negative_bank(
    negative_bank_size: int, mask_duplicates: bool, in_batch_negatives: bool = True
) -> None:
    """A negative bank keeps embeddings, not the inputs ``mask_duplicates`` compares: not both; and it adds
    other steps' rows as negatives, which a loss without in-batch negatives has no place for."""
    if negative_bank_size and not in_batch_negatives:
        raise ValueError(
            "negative_bank_size and in_batch_negatives=False cannot be used together: the bank adds other steps' "
            "rows as negatives, and the loss without in-batch negatives scores each row against its own candidates "
            "only. Set negative_bank_size=0 or in_batch_negatives=True."
        )
    if negative_bank_size and mask_duplicates:
        raise ValueError(
            "negative_bank_size and mask_duplicates cannot be used together: the negative bank keeps embeddings, "
            "not the inputs mask_duplicates compares, so its duplicates could not be masked. Set "
            "negative_bank_size=0 or mask_duplicates=False."
        )


def check_own_candidates(n_columns: int, owner: str) -> None:
    """A batch for ``in_batch_negatives=False`` has hard-negative columns: with pairs alone each row's softmax
    holds its positive only (a loss of 0, no gradient)."""
    if n_columns < 3:
        raise ValueError(
            f"{owner} with in_batch_negatives=False scores each anchor against its own positive and hard "
            f"negatives only, and this batch has {n_columns} columns (no hard negative): the loss would be 0. "
            "Give the dataset hard-negative columns (anchor, positive, negative, ...), or set "
            "in_batch_negatives=True for this dataset."
        )


def ranking_citations(
    directions: Sequence[str], partition_mode: str, hardness_mode: str | None, hardness_strength: float
) -> tuple[str, ...]:
    """The papers of the ranking options in use: GTE's four directions in one softmax, hardness weighting."""
    extra: tuple[str, ...] = ()
    if set(directions) == set(VALID_DIRECTIONS) and partition_mode == "joint":
        extra += (GTE_CITATION,)
    if hardness_mode is not None and hardness_strength > 0:
        extra += (HARDNESS_CITATION,)
    return extra


def _directions(name: str, value: Any) -> Any:
    """Kept as a tuple, as sentence-transformers keeps it (checked with ``partition_mode``); a string (one name,
    whose letters would be read as names) is refused as theirs is."""
    if isinstance(value, str):
        raise ValueError(f"{name} must be a tuple of direction names, e.g. ('query_to_doc',), got {value!r}.")
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _bank_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: no negative bank), got {value!r}; e.g. 256.")
    return value


def _bank_max_age(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer (steps) or None (no limit), got {value!r}; e.g. 4."
        )
    return value


def _false_negative_filter(name: str, value: Any) -> str | None:
    if value is not None and value not in FALSE_NEGATIVE_FILTERS:
        names = list(FALSE_NEGATIVE_FILTERS)
        raise ValueError(
            f"{name} must be 'relative' (NV-Retriever's TopK-PercPos) or 'absolute' (Qwen3-Embedding), or None (no "
            f"filter), got {value!r}.{closest_name_hint(str(value), names)}"
        )
    return value


def _false_negative_margin(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or None (the filter's typical margin), got {value!r}.")
    return float(value)


def _hardness_strength(name: str, value: Any) -> Any:
    return value  # checked with hardness_mode, as sentence-transformers does (their words)


# ---------------------------------------------------------------------- the settings


@dataclass(frozen=True, kw_only=True)
class RankingSettings(LearnableScaleSettings, LossStageSettings):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` options and ours: the settings of
    [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss] (and, with other defaults, of the
    CLIP and tiled losses)."""

    owner: ClassVar[str] = "CachedMNRLoss"

    #: the kind of ``similarity_fct`` (its check, its config name, the arguments' names)
    similarity_kind: ClassVar[SimilarityKind] = EMBEDDING
    #: sentence-transformers' nine keys, in their order (``scale`` the current, learned one; the symmetric loss
    #: is said by ``directions`` and ``partition_mode``, as in theirs); with no extra in use the config equals
    #: theirs
    config_keys: ClassVar[tuple[str, ...]] = (
        "scale",
        "similarity_fct",
        "mini_batch_size",
        "mini_batch_num_tokens",
        "gather_across_devices",
        "directions",
        "partition_mode",
        "hardness_mode",
        "hardness_strength",
    )

    similarity_fct: Callable[..., Tensor] | str = redefault(SharedSettings, "similarity_fct", cos_sim)
    gather_across_devices: bool = redefault(SharedSettings, "gather_across_devices", False)
    directions: tuple[str, ...] = setting(
        ONE_DIRECTION,
        doc="The similarity terms of each row, as sentence-transformers' MultipleNegativesRankingLoss: "
        "query_to_doc (required: every candidate column), query_to_query (the other anchors), doc_to_query (the "
        "positive against every anchor), doc_to_doc (the positive against every other row's documents).",
        check=_directions,
        config="always",
        config_form=lambda _, value: ConfigTuple(value),
    )
    partition_mode: str = setting(
        "joint",
        doc="'joint' (one softmax over every selected term; GTE with all four directions) or 'per_direction' (one "
        "per direction, averaged; not with query_to_query / doc_to_doc).",
        config="always",
    )
    hardness_mode: str | None = setting(
        None,
        doc="Hardness weighting of negatives (default none): in_batch_negatives, hard_negatives or all_negatives "
        "add hardness_strength * stop_grad(similarity) (not scaled) to those negatives' logits, as "
        "sentence-transformers does.",
        config="always",
    )
    hardness_strength: float = setting(
        0.0,
        doc="The hardness penalty's alpha, non-negative; unused while hardness_mode is None.",
        check=_hardness_strength,
        config="always",
    )
    in_batch_negatives: bool = setting(
        True,
        doc="Score each anchor against every row's candidates (default); False: against its own positive and "
        "its own hard negatives only (FlagEmbedding's no_in_batch_neg_flag), across processes too (nothing is "
        "gathered). Needs hard-negative columns.",
        check=check_bool,
    )
    mask_duplicates: bool = setting(
        False,
        doc="Mask false negatives found by equal inputs (token ids, and pixels with images), on this process and "
        "across processes: rows "
        "sharing their anchor or their positive are duplicates; a row's negatives lose the positives of its "
        "duplicates, and any candidate equal to its own positive.",
        check=check_bool,
    )
    negative_bank_size: int = setting(
        0,
        doc="Keep the embeddings of this many past candidates (and, where the loss scores positives against "
        "anchors, past anchors) per process, without gradient, and score them as extra negatives of the next "
        "steps (ContAccum-style); 0: no bank, the loss as without it.",
        check=_bank_size,
    )
    negative_bank_max_age: int | None = setting(
        None,
        doc="Drop bank entries added more than this many steps (training calls of the loss) ago; None: the size "
        "alone decides.",
        check=_bank_max_age,
    )
    false_negative_filter: str | None = setting(
        None,
        doc="Remove from a row's negatives every candidate the model itself rates too close to the row's positive "
        "(its own similarity, without gradient): 'relative' (NV-Retriever's TopK-PercPos) above "
        "false_negative_margin x the positive's similarity, 'absolute' (Qwen3-Embedding) above the positive's "
        "similarity + false_negative_margin; on every candidate source (in-batch, hard negatives, lists, other "
        "processes, the bank). None: no filter, the loss as without it.",
        check=_false_negative_filter,
    )
    false_negative_margin: float | None = setting(
        None,
        doc="The false-negative filter's margin: for 'relative' in (0, 1] (None: 0.95), for 'absolute' >= 0 "
        "(None: 0.1); a candidate rated above the positive is always removed.",
        check=_false_negative_margin,
    )

    @view
    def symmetric(self) -> bool:
        """Whether the loss has the CLIP pair of directions (``query_to_doc`` and ``doc_to_query``, per
        direction); setting it sets ``directions`` and ``partition_mode`` (False: one direction)."""
        return set(self.directions) == set(TWO_DIRECTIONS) and self.partition_mode == "per_direction"

    @symmetric.changes
    def _(self, value: Any) -> dict[str, Any]:
        check_bool("symmetric", value)
        if value == self.symmetric:
            return {}  # e.g. False for four directions: stays four directions
        if value:
            return {"directions": TWO_DIRECTIONS, "partition_mode": "per_direction"}
        return {"directions": ONE_DIRECTION}

    @view
    def similarity(self) -> Similarity:
        """The core's score: ``"cosine"``, ``"dot"`` (GEMM tiles) or the function itself."""
        return self.resolved("similarity_fct")

    def validate(self) -> None:
        super().validate()
        owner = self.owner
        check_directions(self.directions, self.partition_mode, owner)
        check_hardness(self.hardness_mode, self.hardness_strength, owner)
        check_in_batch_negatives(self.in_batch_negatives, self.directions, self.hardness_mode, owner)
        check_negative_bank(self.negative_bank_size, self.mask_duplicates, self.in_batch_negatives)
        self.false_negatives()

    def false_negatives(self, tally: Tensor | None = None) -> FalseNegativeFilter | None:
        """The core's false-negative filter of ``false_negative_filter`` and ``false_negative_margin`` (None
        without one), counting into ``tally``; raises where the margin does not fit the filter."""
        if self.false_negative_filter is None:
            if self.false_negative_margin is not None:
                raise ValueError(
                    f"{self.owner}: false_negative_margin={self.false_negative_margin!r} is the margin of a "
                    "false-negative filter, and false_negative_filter is None; set false_negative_filter='relative' "
                    "or 'absolute', or leave the margin None."
                )
            return None
        margin = self.false_negative_margin
        if margin is None:
            margin = FALSE_NEGATIVE_FILTERS[self.false_negative_filter]
        try:
            return FalseNegativeFilter(self.false_negative_filter, margin, tally)
        except ValueError as error:
            raise ValueError(
                f"{self.owner}: false_negative_margin={margin!r} with false_negative_filter="
                f"{self.false_negative_filter!r}: {error}"
            ) from None

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """A learned scale, each row's own candidates only, duplicate masks, a negative bank, a false-negative
        filter: none is an option of sentence-transformers' ``MultipleNegativesRankingLoss``."""
        ours = (
            ("in_batch_negatives", not self.in_batch_negatives),
            ("mask_duplicates", self.mask_duplicates),
            ("negative_bank_size", bool(self.negative_bank_size)),
            ("false_negative_filter", self.false_negative_filter is not None),
        )
        return (*super().beyond_sentence_transformers(), *(name for name, used in ours if used))

    def citations(self) -> tuple[str, ...]:
        """The papers of the options in use (GTE's four directions, hardness weighting, the bank)."""
        bank = (CONTACCUM_CITATION,) if self.negative_bank_size else ()
        return (
            *ranking_citations(
                self.directions, self.partition_mode, self.hardness_mode, self.hardness_strength
            ),
            *bank,
        )
