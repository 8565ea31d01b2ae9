"""The losses' options that need sentence-transformers' objects to check: the similarity function, the
model (it must be splittable into mini-batches) and the columns a step receives."""

from __future__ import annotations

import ast
import difflib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.engine.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.functional import Similarity
from st_cached_losses.functional.multi_vector import XTR, MaxSim
from st_cached_losses.losses.settings import check_bool

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
    "check_hardness",
    "check_splittable_model",
    "closest_name_hint",
    "parse_call",
    "resolve_similarity",
    "scoring_config_name",
    "scoring_from_config",
    "similarity_name",
]


def closest_name_hint(word: str, choices: Sequence[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def resolve_similarity(similarity_fct: Callable[..., Tensor] | str) -> Similarity:
    """Map sentence-transformers' ``cos_sim`` / ``dot_score`` (or "cosine" / "dot") to the core's GEMM
    scores; any other function ``f(a, b) -> (len(a), len(b))`` (``util.euclidean_sim``,
    ``util.manhattan_sim``, a user's) is scored exactly tile by tile through autograd (slower).

    A ``functools.partial`` of cos_sim / dot_score with nothing bound counts as the function.
    """
    if isinstance(similarity_fct, str):
        aliases = {
            "cosine": "cosine",
            "cos_sim": "cosine",
            "cos": "cosine",
            "dot": "dot",
            "dot_score": "dot",
            "dot_product": "dot",
        }
        if similarity_fct.lower() in aliases:
            return aliases[similarity_fct.lower()]  # type: ignore[return-value]
        raise ValueError(
            f"similarity_fct={similarity_fct!r} is not a similarity name: pass 'cosine', 'dot' or a function such "
            "as sentence_transformers.util.cos_sim, dot_score, euclidean_sim or manhattan_sim."
        )
    if not callable(similarity_fct):
        raise ValueError(
            f"similarity_fct must be a function f(a, b) -> (len(a), len(b)) scores or a name, got {similarity_fct!r}."
        )
    from sentence_transformers.util import cos_sim, dot_score

    fn = similarity_fct
    if isinstance(fn, functools.partial) and not fn.args and not fn.keywords:
        fn = fn.func  # a bare partial(cos_sim) is cos_sim
    if fn is cos_sim:
        return "cosine"
    if fn is dot_score:
        return "dot"
    # tried once on tiny inputs, so that a function of another shape fails here and not mid-training
    try:
        scores = similarity_fct(torch.randn(2, 3), torch.randn(4, 3))
    except Exception as exc:
        raise ValueError(
            f"similarity_fct={similarity_fct!r} failed on a (2, 3) and a (4, 3) tensor ({exc}); it must map "
            "embeddings a (n, d) and b (m, d) to an (n, m) similarity matrix, like sentence_transformers.util.cos_sim."
        ) from exc
    if not isinstance(scores, Tensor) or scores.shape != (2, 4):
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(
            f"similarity_fct={similarity_fct!r} must map embeddings a (n, d) and b (m, d) to an (n, m) similarity "
            f"matrix, like sentence_transformers.util.cos_sim; on (2, 3) and (4, 3) it returned {got}."
        )
    return similarity_fct


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """A scoring function as sentence-transformers' configs write it (``similarity_fct_name``):
    ``"xtr_scores"`` -> ``("xtr_scores", {})``, ``"XTRScores(top_k=5, chunk_elements=None)"`` ->
    ``("XTRScores", {"top_k": 5, "chunk_elements": None})``; None for anything else (positional arguments,
    values that are not literals). Parsed, never evaluated."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Name):
        return node.id, {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    keywords: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **mapping
            return None
        try:
            keywords[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None
    return node.func.id, keywords


def scoring_from_config(text: str) -> Callable[..., Tensor]:
    """A scoring function from its config string (``similarity_fct_name``'s form): ``colbert_scores``,
    ``mean_colbert_scores`` or ``xtr_scores`` with keyword arguments (a ``functools.partial``), or
    ``XTRScores(...)``; anything else raises."""
    from sentence_transformers.multi_vector_encoder import scoring

    call = parse_call(text)
    functions = {
        name: getattr(scoring, name)
        for name in ("colbert_scores", "mean_colbert_scores", "xtr_scores", "XTRScores")
    }
    if call is None or call[0] not in functions:
        raise ValueError(
            f"similarity_fct={text!r} is not a multi-vector score: use 'maxsim', 'meanmaxsim' or 'xtr', or a "
            "config's 'colbert_scores', 'mean_colbert_scores(length_normalize=...)', 'xtr_scores(top_k=...)' or "
            "'XTRScores(top_k=...)'."
        )
    name, keywords = call
    try:
        if name == "XTRScores":
            return functions[name](**keywords)
        # a partial with an unknown keyword is refused below, by the callables' rule
        return functools.partial(functions[name], **keywords)
    except TypeError as err:
        raise ValueError(f"similarity_fct={text!r}: {err}.") from None


def scoring_config_name(fn: Any) -> str:
    """The config's name of a scoring function: sentence-transformers' for theirs; for the core's own
    :class:`MaxSim` / :class:`XTR`, the name of their function it equals, so that the config rebuilds it and
    reads as theirs."""
    from sentence_transformers.util import similarity_fct_name

    if isinstance(fn, str):
        return fn
    if isinstance(fn, MaxSim):
        return "mean_colbert_scores" if fn.length_normalize else "colbert_scores"
    if isinstance(fn, XTR):
        return f"xtr_scores(top_k={fn.top_k!r})"
    return similarity_fct_name(fn)


def similarity_name(similarity: Similarity) -> str:
    """The config's name of a similarity (sentence-transformers writes the function's ``__name__``)."""
    if isinstance(similarity, str):
        return {"cosine": "cos_sim", "dot": "dot_score"}[similarity]
    return getattr(similarity, "__name__", type(similarity).__name__)


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
