"""The losses' similarity functions, each kind resolved once and named back once.

A loss's ``similarity_fct`` setting keeps what was given (sentence-transformers' function, a name, a
``functools.partial``, a user's function); its check resolves it, once, into what the loss stage computes with,
and its config writes it back in a form the constructor takes. A kind is one of these objects, the check of
the losses' ``similarity_fct`` field, which the configuration layer reads too (the names the arguments'
``similarity`` field takes, and what each gives the loss):

* [`EMBEDDING`][st_cached_losses.losses.similarity.EMBEDDING]: an in-batch score of embeddings (``cos_sim``,
  ``dot_score``: GEMM tiles; any ``f(a, b) -> (len(a), len(b))`` tile by tile through autograd);
* [`PAIRWISE`][st_cached_losses.losses.similarity.PAIRWISE]: a distillation loss's pairwise score of embeddings
  (``pairwise_dot_score``, ``pairwise_cos_sim``, any ``f(a, b) -> (len(a),)``), and the in-batch score of an
  InfoNCE term added to it;
* [`TOKENS`][st_cached_losses.losses.similarity.TOKENS]: the multi-vector ranking loss's token score (MaxSim,
  MeanMaxSim, XTR);
* [`PAIRWISE_TOKENS_KL`][st_cached_losses.losses.similarity.PAIRWISE_TOKENS_KL] and
  [`PAIRWISE_TOKENS_MARGIN`][st_cached_losses.losses.similarity.PAIRWISE_TOKENS_MARGIN]: the multi-vector
  distillation losses' token scores.

A multi-vector loss's ``similarity_fct=None`` is sentence-transformers' default of the installed release
([`model_token_score`][st_cached_losses.losses.similarity.model_token_score]): from 6.3 the model's own
``model.similarity``, in 6.2 MaxSim.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from packaging.version import Version
from torch import Tensor

from st_cached_losses.functional import Similarity
from st_cached_losses.functional.representations.multi_vector import XTR, MaxSim

__all__ = [
    "EMBEDDING",
    "MODEL_SCORE_DEFAULT",
    "PAIRWISE",
    "PAIRWISE_TOKENS_KL",
    "PAIRWISE_TOKENS_MARGIN",
    "TOKENS",
    "Embedding",
    "Pairwise",
    "PairwiseTokens",
    "SimilarityKind",
    "Tokens",
    "model_token_score",
    "parse_call",
]

#: sentence-transformers 6.3 or newer is installed: its multi-vector losses' ``similarity_fct=None`` is the
#: model's own similarity (``model.similarity``), written None in their config; 6.2's was MaxSim, written
#: ``"colbert_scores"`` (``"colbert_kd_scores"``, ``"colbert_scores_pairwise"``). A default, not a fix: ours
#: follows the installed release, so that it equals their loss and config on either.
MODEL_SCORE_DEFAULT = Version(importlib.metadata.version("sentence-transformers")).release[:2] >= (6, 3)


def _bare(fn: Any) -> tuple[Any, dict[str, Any]]:
    """A ``functools.partial`` without positional arguments as its function and keywords."""
    if isinstance(fn, functools.partial) and not fn.args:
        return fn.func, dict(fn.keywords)
    return fn, {}


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


def _named(text: str, functions: dict[str, Any], what: str) -> Any:
    """The function a config's string names (with keyword arguments: a ``functools.partial``, or an
    instance of a scoring class), among ``functions``; anything else raises naming ``what``."""
    call = parse_call(text)
    if call is None or call[0] not in functions:
        raise ValueError(f"similarity_fct={text!r} is not {what}.")
    name, keywords = call
    fn = functions[name]
    try:
        if isinstance(fn, type):
            return fn(**keywords)
        return functools.partial(fn, **keywords) if keywords else fn
    except TypeError as err:
        raise ValueError(f"similarity_fct={text!r}: {err}.") from None


class SimilarityKind:
    """A kind of ``similarity_fct``: the check of the field (``kind(name, value)`` returns the value as
    given, refusing one it cannot resolve), [`resolve`][st_cached_losses.losses.similarity.SimilarityKind.resolve]
    (what the loss stage computes with), [`config_name`][st_cached_losses.losses.similarity.SimilarityKind.config_name]
    (the config's form, which ``resolve`` takes back) and [`argument`][st_cached_losses.losses.similarity.SimilarityKind.argument]
    (the value the arguments' ``similarity`` field gives the loss for each of its names)."""

    #: the arguments' ``similarity`` names (lower case) this kind takes, each with the value the loss gets
    arguments: ClassVar[dict[str, str]] = {}

    def __call__(self, name: str, value: Any) -> Any:
        """The check: the value as given (the settings object resolves it once, with ``resolve``)."""
        return value

    def resolve(self, value: Any) -> Any:
        raise NotImplementedError

    def config_name(self, value: Any) -> str | None:
        from sentence_transformers.util import similarity_fct_name

        return value if isinstance(value, str) else similarity_fct_name(value)

    def argument_name(self, name: str) -> str | None:
        """The arguments' canonical ``similarity`` name for ``name`` (any case), None if this kind has none."""
        return name.lower() if name.lower() in self.arguments else None

    def argument(self, name: str) -> Any:
        """What the loss takes for the arguments' ``similarity`` name ``name`` (one of ``arguments``): the
        sentence-transformers function of that name."""
        raise NotImplementedError


class Embedding(SimilarityKind):
    """An in-batch score of embeddings: sentence-transformers' ``cos_sim`` / ``dot_score`` (or "cosine" /
    "dot", or a config's "cos_sim" / "dot_score") are the core's GEMM scores; ``euclidean_sim``,
    ``manhattan_sim`` or any other ``f(a, b) -> (len(a), len(b))`` is scored exactly tile by tile through
    autograd (slower). A ``functools.partial`` of ``cos_sim`` / ``dot_score`` with nothing bound counts as the
    function."""

    arguments: ClassVar[dict[str, str]] = {"cosine": "cos_sim", "dot": "dot_score"}
    _NAMES: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("cosine", "cos_sim", "cos"), "cosine"),
        **dict.fromkeys(("dot", "dot_score", "dot_product"), "dot"),
    }
    #: other functions of sentence_transformers.util a config may name
    _UTIL = ("euclidean_sim", "manhattan_sim")

    def resolve(self, value: Any) -> Similarity:
        if isinstance(value, str):
            if value.lower() in self._NAMES:
                return self._NAMES[value.lower()]  # type: ignore[return-value]
            if value in self._UTIL:
                import sentence_transformers.util as util

                return self.resolve(getattr(util, value))
            raise ValueError(
                f"similarity_fct={value!r} is not a similarity name: pass 'cosine', 'dot' or a function such "
                "as sentence_transformers.util.cos_sim, dot_score, euclidean_sim or manhattan_sim."
            )
        if not callable(value):
            raise ValueError(
                f"similarity_fct must be a function f(a, b) -> (len(a), len(b)) scores or a name, got {value!r}."
            )
        from sentence_transformers.util import cos_sim, dot_score

        fn, keywords = _bare(value)
        if not keywords and fn is cos_sim:
            return "cosine"
        if not keywords and fn is dot_score:
            return "dot"
        # tried once on tiny inputs, so that a function of another shape fails here and not mid-training
        try:
            scores = value(torch.randn(2, 3), torch.randn(4, 3))
        except Exception as exc:
            raise ValueError(
                f"similarity_fct={value!r} failed on a (2, 3) and a (4, 3) tensor ({exc}); it must map "
                "embeddings a (n, d) and b (m, d) to an (n, m) similarity matrix, like sentence_transformers.util.cos_sim."
            ) from exc
        if not isinstance(scores, Tensor) or scores.shape != (2, 4):
            got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
            raise ValueError(
                f"similarity_fct={value!r} must map embeddings a (n, d) and b (m, d) to an (n, m) similarity "
                f"matrix, like sentence_transformers.util.cos_sim; on (2, 3) and (4, 3) it returned {got}."
            )
        return value

    def config_name(self, value: Any) -> str:
        """sentence-transformers' form (the function's ``__name__``): ``cos_sim`` / ``dot_score`` for the
        core's scores, which the constructor takes back."""
        resolved = self.resolve(value)
        if isinstance(resolved, str):
            return {"cosine": "cos_sim", "dot": "dot_score"}[resolved]
        return getattr(resolved, "__name__", type(resolved).__name__)

    def argument_name(self, name: str) -> str | None:
        return self._NAMES.get(name.lower())

    def argument(self, name: str) -> Any:
        import sentence_transformers.util as util

        return getattr(util, self.arguments[name])


class Pairwise(SimilarityKind):
    """A distillation loss's pairwise score of embeddings, ``f(a, b) -> (len(a),)``: sentence-transformers'
    ``pairwise_dot_score`` / ``pairwise_cos_sim`` (or "dot" / "cosine", or a config's names of them, or of ``pairwise_euclidean_sim``
    / ``pairwise_manhattan_sim`` / ``pairwise_angle_sim``) or any function; called on row chunks. Its in-batch
    form ([`infonce`][st_cached_losses.losses.similarity.Pairwise.infonce]) is the score of an InfoNCE term."""

    arguments: ClassVar[dict[str, str]] = {"cosine": "pairwise_cos_sim", "dot": "pairwise_dot_score"}
    _UTIL = (
        "pairwise_dot_score",
        "pairwise_cos_sim",
        "pairwise_euclidean_sim",
        "pairwise_manhattan_sim",
        "pairwise_angle_sim",
    )

    def resolve(self, value: Any) -> Callable[[Tensor, Tensor], Tensor]:
        if isinstance(value, str):
            import sentence_transformers.util as util

            value = self.arguments.get(value.lower(), value)  # "dot" / "cosine"
            return _named(
                value,
                {name: getattr(util, name) for name in self._UTIL},
                f"a pairwise score: name one of {', '.join(self._UTIL)}, or pass a function f(a, b) -> (len(a),)",
            )
        if not callable(value):
            raise ValueError(
                f"similarity_fct must be a pairwise score f(a, b) -> (len(a),), e.g. sentence_transformers.util."
                f"pairwise_dot_score or pairwise_cos_sim, got {value!r}."
            )
        return value

    def argument(self, name: str) -> Any:
        return self.resolve(self.arguments[name])

    def infonce(self, value: Any) -> Similarity | None:
        """The core's in-batch score that the pairwise score is the diagonal of: ``pairwise_dot_score`` ->
        ``"dot"``, ``pairwise_cos_sim`` -> ``"cosine"``; None for any other."""
        from sentence_transformers.util import pairwise_cos_sim, pairwise_dot_score

        fn, keywords = _bare(self.resolve(value))
        if keywords:
            return None
        return {pairwise_dot_score: "dot", pairwise_cos_sim: "cosine"}.get(fn)  # type: ignore[return-value]


class Tokens(SimilarityKind):
    """The multi-vector ranking loss's token score: ``None`` / ``colbert_scores`` / ``"maxsim"`` -> MaxSim,
    ``mean_colbert_scores`` / ``"meanmaxsim"`` -> MeanMaxSim (a ``functools.partial`` of either may bind
    ``length_normalize`` and ``chunk_elements``, the latter a memory knob the tiles make moot), ``xtr_scores``
    / ``XTRScores(top_k)`` / ``"xtr"`` -> XTR (a partial of ``xtr_scores`` may bind ``top_k`` and
    ``chunk_elements``; ``top_k`` 256 by default, as theirs), a config's string of any of them
    (``"xtr_scores(top_k=5)"``), or the core's [`MaxSim`][st_cached_losses.functional.representations.multi_vector.MaxSim] /
    ``XTR``. ``XTRKDScores`` is refused: it scores each query's own documents only (a distillation score)."""

    arguments: ClassVar[dict[str, str]] = {
        "maxsim": "colbert_scores",
        "meanmaxsim": "mean_colbert_scores",
        "xtr": "xtr_scores",
    }

    def resolve(self, value: Any) -> MaxSim | XTR:
        if value is None:
            return MaxSim()
        if isinstance(value, (MaxSim, XTR)):
            return value
        from sentence_transformers.multi_vector_encoder import scoring

        if isinstance(value, str):
            names = {
                "maxsim": False,
                "colbert_scores": False,
                "meanmaxsim": True,
                "mean_colbert_scores": True,
            }
            if value.lower() in names:
                return MaxSim(names[value.lower()])
            if value.lower() in ("xtr", "xtr_scores"):
                return XTR()
            value = _named(
                value,
                {
                    n: getattr(scoring, n)
                    for n in ("colbert_scores", "mean_colbert_scores", "xtr_scores", "XTRScores")
                },
                "a multi-vector score: use 'maxsim', 'meanmaxsim' or 'xtr', or a config's 'colbert_scores', "
                "'mean_colbert_scores(length_normalize=...)', 'xtr_scores(top_k=...)' or 'XTRScores(top_k=...)'",
            )
        fn, keywords = _bare(value)
        if isinstance(fn, scoring.XTRKDScores) or fn is scoring.xtr_kd_scores:
            raise ValueError(
                "XTRKDScores / xtr_kd_scores score each query against its own documents only (for "
                "distillation); the in-batch ranking loss takes xtr_scores or XTRScores."
            )
        if isinstance(fn, scoring.XTRScores) and not keywords:
            return XTR(fn.top_k)
        if fn is scoring.xtr_scores and not set(keywords) - {"top_k", "chunk_elements"}:
            return XTR(keywords.get("top_k", 256))
        defaults = {scoring.colbert_scores: False, scoring.mean_colbert_scores: True}
        if fn not in defaults or set(keywords) - {"length_normalize", "chunk_elements"}:
            raise ValueError(
                f"similarity_fct={value!r} is not supported: CachedMultiVectorLoss scores tile by tile, so it "
                "takes sentence_transformers.multi_vector_encoder.scoring.colbert_scores (MaxSim, the default), "
                "mean_colbert_scores (MeanMaxSim) or xtr_scores / XTRScores (XTR), optionally as a "
                "functools.partial binding length_normalize / chunk_elements (top_k / chunk_elements for "
                "xtr_scores), or st_cached_losses.functional.representations.multi_vector.MaxSim / XTR."
            )
        return MaxSim(bool(keywords.get("length_normalize", defaults[fn])))

    def config_name(self, value: Any) -> str | None:
        """sentence-transformers' name for theirs; for the core's MaxSim / XTR, the name of their function
        it equals (so that the config rebuilds it and reads as theirs). None (the default) as the installed
        release writes it: None from 6.3 (the model's own score), ``"colbert_scores"`` in 6.2."""
        if value is None:
            return None if MODEL_SCORE_DEFAULT else "colbert_scores"
        if isinstance(value, MaxSim):
            return "mean_colbert_scores" if value.length_normalize else "colbert_scores"
        if isinstance(value, XTR):
            return f"xtr_scores(top_k={value.top_k!r})"
        return super().config_name(value)

    def argument(self, name: str) -> Any:
        from sentence_transformers.multi_vector_encoder import scoring

        return getattr(scoring, self.arguments[name])


class PairwiseTokens(SimilarityKind):
    """A multi-vector distillation loss's token score. For the KL loss ``colbert_kd_scores`` (None),
    ``mean_colbert_kd_scores`` or ``xtr_kd_scores`` / ``XTRKDScores(top_k)`` (XTR's top-k over every document
    of the batch); for the margin loss ``colbert_scores_pairwise`` (None), ``mean_colbert_scores_pairwise`` or
    ``xtr_scores_pairwise`` (XTR's top-k over each column's documents); a ``functools.partial`` may bind
    ``length_normalize`` / ``top_k`` and ``chunk_elements`` (a memory knob the chunks make moot); a config's
    string of any of them; ``"maxsim"`` / ``"meanmaxsim"`` / ``"xtr"``; or a
    [`MaxSim`][st_cached_losses.functional.representations.multi_vector.MaxSim] / ``XTR``."""

    def __init__(self, kl: bool) -> None:
        self.kl = kl
        self.arguments = (  # type: ignore[misc]
            {"maxsim": "colbert_kd_scores", "meanmaxsim": "mean_colbert_kd_scores", "xtr": "xtr_kd_scores"}
            if kl
            else {
                "maxsim": "colbert_scores_pairwise",
                "meanmaxsim": "mean_colbert_scores_pairwise",
                "xtr": "xtr_scores_pairwise",
            }
        )

    def _functions(self) -> tuple[dict[Any, bool], Any, dict[str, Any]]:
        from sentence_transformers.multi_vector_encoder import scoring

        if self.kl:
            maxsims = {scoring.colbert_kd_scores: False, scoring.mean_colbert_kd_scores: True}
            xtr: Any = scoring.xtr_kd_scores
        else:
            maxsims = {scoring.colbert_scores_pairwise: False, scoring.mean_colbert_scores_pairwise: True}
            xtr = scoring.xtr_scores_pairwise
        named = {f.__name__: f for f in [*maxsims, xtr]}
        if self.kl:
            named["XTRKDScores"] = scoring.XTRKDScores
        return maxsims, xtr, named

    def resolve(self, value: Any) -> MaxSim | XTR:
        if value is None:
            return MaxSim()
        if isinstance(value, (MaxSim, XTR)):
            return value
        maxsims, xtr_fn, named = self._functions()
        if isinstance(value, str):
            short: dict[str, MaxSim | XTR] = {"maxsim": MaxSim(), "meanmaxsim": MaxSim(True), "xtr": XTR()}
            if value.lower() in short:
                return short[value.lower()]
            value = _named(value, named, f"a score of this loss: {self._names_text()}")
        from sentence_transformers.multi_vector_encoder import scoring

        fn, keywords = _bare(value)
        if self.kl and isinstance(fn, scoring.XTRKDScores) and not keywords:
            return XTR(fn.top_k)
        if fn is xtr_fn and not set(keywords) - {"top_k", "chunk_elements"}:
            return XTR(keywords.get("top_k", 256))
        if fn in maxsims and not set(keywords) - {"length_normalize", "chunk_elements"}:
            return MaxSim(bool(keywords.get("length_normalize", maxsims[fn])))
        raise ValueError(
            f"similarity_fct={value!r} is not supported: the cached loss scores row chunks with the core's "
            f"MaxSim / XTR, so it takes sentence_transformers.multi_vector_encoder.scoring's {self._names_text()} "
            "(optionally a functools.partial binding length_normalize / top_k and chunk_elements), 'maxsim', "
            "'meanmaxsim' or 'xtr', or st_cached_losses.functional.representations.multi_vector.MaxSim / XTR."
        )

    def _names_text(self) -> str:
        maxsims, xtr_fn, _ = self._functions()
        return ", ".join(f.__name__ for f in [*maxsims, xtr_fn]) + (", XTRKDScores(top_k)" if self.kl else "")

    def config_name(self, value: Any) -> str | None:
        """sentence-transformers' name; the core's MaxSim / XTR as the name of their function it equals. None
        (the default) as the installed release writes it: None from 6.3 (the model's own score),
        ``colbert_kd_scores`` / ``colbert_scores_pairwise`` in 6.2."""
        if value is None:
            if MODEL_SCORE_DEFAULT:
                return None
            return "colbert_kd_scores" if self.kl else "colbert_scores_pairwise"
        if isinstance(value, MaxSim):
            maxsims, _, _ = self._functions()
            fn = next(f for f, normalize in maxsims.items() if normalize == value.length_normalize)
            return fn.__name__
        if isinstance(value, XTR):
            return f"{'xtr_kd_scores' if self.kl else 'xtr_scores_pairwise'}(top_k={value.top_k!r})"
        return super().config_name(value)

    def argument(self, name: str) -> Any:
        from sentence_transformers.multi_vector_encoder import scoring

        return getattr(scoring, self.arguments[name])


def model_token_score(model: Any) -> MaxSim:
    """The token score of a multi-vector loss whose ``similarity_fct`` is None, sentence-transformers' default
    of the installed release ([`MODEL_SCORE_DEFAULT`][st_cached_losses.losses.similarity.MODEL_SCORE_DEFAULT]):
    from 6.3 the model's own, as their losses score with ``model.similarity`` (``similarity_pairwise``):
    MeanMaxSim where the model's ``similarity_fn_name`` is ``"meanmaxsim"``, else MaxSim (a
    ``MultiVectorEncoder``'s default ``"maxsim"``, and a model without one); in 6.2 MaxSim whatever the model's
    ``similarity_fn_name``. The two differ for a ``"meanmaxsim"`` model only.

    Args:
        model: the loss's model (a ``MultiVectorEncoder``), read at each step: a change of its
            ``similarity_fn_name`` is followed.

    Returns:
        The core's [`MaxSim`][st_cached_losses.functional.representations.multi_vector.MaxSim], length-normalised or not.
    """
    return MaxSim(MODEL_SCORE_DEFAULT and getattr(model, "similarity_fn_name", None) == "meanmaxsim")


#: the kinds, one object each (a settings field's check)
EMBEDDING = Embedding()
PAIRWISE = Pairwise()
TOKENS = Tokens()
PAIRWISE_TOKENS_KL = PairwiseTokens(kl=True)
PAIRWISE_TOKENS_MARGIN = PairwiseTokens(kl=False)
