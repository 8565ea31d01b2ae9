"""The losses' settings: one spec per setting (its default, its one check and wording, whether the model
card's config lists it), the [`Setting`][st_cached_losses.losses.settings.Setting] descriptor that checks a plain setting on every
assignment, and the checks of the settings that go together (``directions`` with ``partition_mode``, the
hardness options) or need sentence-transformers' objects (the similarity function).

Every loss setting that is a field of the arguments has a spec here. The losses check their arguments
with these specs' checks (constructor and every assignment), the plain settings are [`Setting`][st_cached_losses.losses.settings.Setting]
descriptors built from them, ``get_config_dict`` lists the extras from them, and the configuration layer
builds each field from its spec's default, with its help text written on the field's line
(``config/training_args.py``: the command line's words live with the configuration, not here), and checks
it with the spec's check, refusing it for a loss whose signature lacks it (``tests/config/test_fields.py``
holds that every constructor argument of every loss is a field, or on [`NOT_FIELDS`][st_cached_losses.config.registry.NOT_FIELDS] with the reason).
Adding a setting is one entry here, its field line with its help (the annotation the parser reads) and its
parameter in the signatures, and its use.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

import torch
from torch import Tensor

from st_cached_losses.engine.checks import (
    check_mini_batch_num_tokens,
    check_mini_batch_size,
    graph_budget,
    memory_bytes,
)
from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, Similarity, scale_value
from st_cached_losses.functional.checks import check_matmul_precision, check_path, check_positive_int

logger = logging.getLogger(__name__)

__all__ = [
    "ONE_DIRECTION",
    "SPECS",
    "TWO_DIRECTIONS",
    "VALID_DIRECTIONS",
    "VALID_HARDNESS_MODES",
    "VALID_PARTITION_MODES",
    "ConfigTuple",
    "Setting",
    "Spec",
    "check_bool",
    "check_directions",
    "check_hardness",
    "check_in_batch_negatives",
    "check_infonce_weight",
    "check_max_scale",
    "check_negative_bank",
    "check_nonnegative",
    "check_own_candidates",
    "check_temperature",
    "closest_name_hint",
    "is_symmetric",
    "resolve_similarity",
    "similarity_name",
]

T = TypeVar("T")


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def check_max_scale(max_scale: float, scale: float) -> None:
    """A learnable scale's clamp is at least the scale."""
    if max_scale < scale:
        raise ValueError(
            f"max_scale must be >= scale with learnable_scale, got max_scale={max_scale!r} and scale={scale!r}."
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


def _budget(name: str, value: Any, optional: bool = False) -> int | None:
    """A memory budget in bytes ([`memory_bytes`][st_cached_losses.engine.checks.memory_bytes]'s forms), or None where ``optional``."""
    if value is None and not optional:
        raise ValueError(f"{name} must be a positive integer (bytes) or a size such as '64MiB', got None.")
    return memory_bytes(value, name)


def _finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _positive_number(name: str, value: Any) -> float:
    if not (_finite_number(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}; e.g. 100.0.")
    return float(value)


def check_nonnegative(name: str, value: Any, *, optional: bool = True, example: str = "3e-5") -> float | None:
    """A finite number >= 0 (a regulariser's weight or threshold, a learning rate), or None where
    ``optional``; returned as a float."""
    if value is None and optional:
        return None
    if not (_finite_number(value) and value >= 0):
        raise ValueError(
            f"{name} must be a finite number >= 0{' or None' * optional}, got {value!r}; e.g. {example}."
        )
    return float(value)


#: a FLOPS threshold's check
_THRESHOLD = functools.partial(check_nonnegative, example="100 (non-zero entries)")


def check_temperature(name: str, value: Any) -> Any:
    """A distillation loss's softmax temperature: positive and finite (sentence-transformers' rule and words);
    None where it follows ``temperature`` (the student's and the teacher's)."""
    if value is None and name != "temperature":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value}.")
    return float(value)


def check_infonce_weight(name: str, value: Any) -> float:
    """The weight of a distillation loss's in-batch InfoNCE term: a finite number >= 0 (0: the distillation
    loss alone)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(
            f"{name} must be a finite number >= 0 (0: no in-batch InfoNCE term), got {value!r}; e.g. 0.1."
        )
    return float(value)


def _scale(name: str, value: Any) -> float:
    return scale_value(value, name)


def _kept(check: Callable[[Any], None]) -> Callable[[str, Any], Any]:
    """An engine check of one value (it names the setting itself) as a spec's check: the value is kept."""
    return lambda name, value: check(value) or value  # type: ignore[func-returns-value]


def _margin_strategy(name: str, value: Any) -> str:
    if value not in ("absolute", "relative"):
        raise ValueError(f"{name} must be 'absolute' or 'relative', got {value!r}.")
    return str(value)


def _finite(name: str, value: Any) -> float:
    if not _finite_number(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def _num_negatives(name: str, value: Any) -> int | None:
    """A positive number of in-batch negatives, or None / ``"all"``: every one there is."""
    if value is None or value == "all":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, or 'all' (None in Python), got {value!r}.")
    return value


def _bank_size(name: str, value: Any) -> int:
    """A number of entries, 0 (none) or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: no negative bank), got {value!r}; e.g. 256.")
    return value


def _bank_max_age(name: str, value: Any) -> int | None:
    """A positive number of steps, or None: no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer (steps) or None (no limit), got {value!r}; e.g. 4."
        )
    return value


def _unchecked(name: str, value: Any) -> Any:
    """For the settings checked together with another (``directions`` with ``partition_mode``:
    [`check_directions`][st_cached_losses.losses.settings.check_directions]; ``hardness_mode`` with ``hardness_strength``: [`check_hardness`][st_cached_losses.losses.settings.check_hardness]) or by the
    loss that takes them (``similarity_fct``, ``guide``)."""
    return value


@dataclass(frozen=True)
class Spec:
    """A loss setting. ``default``: every loss's (None where the losses differ: each its signature's, and
    the field's None means the loss's own); ``check(name, value)`` returns the value the loss keeps or raises
    a ``ValueError`` naming the setting; ``config``: ``"changed"`` lists it in ``get_config_dict`` when it
    differs from the default, ``"never"`` for settings that never change the result (speed and memory only), ``"own"`` where
    the loss writes it itself (sentence-transformers' keys and the settings that go together)."""

    default: Any
    check: Callable[[str, Any], Any] = _unchecked
    config: Literal["own", "changed", "never"] = "own"


SPECS: dict[str, Spec] = {
    "scale": Spec(None, _scale),
    "temperature": Spec(None, _scale),
    "learnable_scale": Spec(False, check_bool),
    "max_scale": Spec(100.0, _positive_number),
    "similarity_fct": Spec(None),
    "mini_batch_size": Spec(32, _kept(check_mini_batch_size)),
    "mini_batch_num_tokens": Spec(None, _kept(check_mini_batch_num_tokens)),
    "symmetric": Spec(None, check_bool),
    "directions": Spec(None),
    "partition_mode": Spec(None),
    "hardness_mode": Spec(None),
    "hardness_strength": Spec(0.0),
    "guide": Spec(None),
    "margin_strategy": Spec("absolute", _margin_strategy),
    "margin": Spec(0.0, _finite),
    "contrast_anchors": Spec(True, check_bool),
    "contrast_positives": Spec(True, check_bool),
    "document_regularizer_weight": Spec(None, check_nonnegative),
    "query_regularizer_weight": Spec(None, check_nonnegative),
    "document_regularizer_threshold": Spec(None, _THRESHOLD),
    "query_regularizer_threshold": Spec(None, _THRESHOLD),
    "use_document_regularizer_only": Spec(False, check_bool),
    "score_mini_batch_size": Spec(None, check_positive_int),
    "num_negatives": Spec(4, _num_negatives),
    "gather_across_devices": Spec(False, check_bool),
    "in_batch_negatives": Spec(True, check_bool, "changed"),
    "mask_duplicates": Spec(False, check_bool, "changed"),
    "negative_bank_size": Spec(0, _bank_size, "changed"),
    "negative_bank_max_age": Spec(None, _bank_max_age, "changed"),
    "show_progress_bar": Spec(False, check_bool, "never"),
    "sort_by_length": Spec(True, check_bool, "never"),
    "reuse_last_graph": Spec(True, check_bool, "never"),
    "keep_params_unsharded": Spec(False, check_bool, "never"),
    "path": Spec("auto", check_path, "never"),
    "tile_size": Spec(None, check_positive_int, "changed"),
    "memory_budget": Spec(DEFAULT_MEMORY_BUDGET, _budget, "never"),
    "matmul_precision": Spec(None, check_matmul_precision, "changed"),
    "graph_memory_budget": Spec(None, lambda name, value: graph_budget(value, name), "never"),
    "mini_batch_memory_budget": Spec(None, functools.partial(_budget, optional=True), "never"),
    "student_temperature": Spec(None, check_temperature),
    "teacher_temperature": Spec(None, check_temperature),
    "infonce_weight": Spec(0.0, check_infonce_weight),
    "infonce_scale": Spec(None, lambda name, value: None if value is None else scale_value(value, name)),
}

_MISSING: Any = object()


def _argument_text(owner: type, name: str) -> str | None:
    """The text of argument ``name`` in the Args section of ``owner``'s constructor docstring, if it has one."""
    init = owner.__dict__.get("__init__")
    lines = ((init.__doc__ or "") if init is not None else "").splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(f"{name}:"):
            indent = len(line) - len(line.lstrip())
            text = [line.strip()[len(name) + 1 :].strip()]
            for more in lines[i + 1 :]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                text.append(more.strip())
            return " ".join(text)
    return None


class Setting(Generic[T]):
    """A loss setting as a descriptor, the one way a loss declares a setting: read back as kept, checked on
    every assignment (the constructor's included) by its [`Spec`][st_cached_losses.losses.settings.Spec] (or by ``check``, a spec's check, for
    a loss's own setting without a spec), then by ``validate`` where the check needs the loss (the other
    settings it goes with), and followed by ``after`` where a change must reset or rebuild something.

    Args:
        on_engine: kept on the loss's GradCache engine (``loss.cache.<name>``), for the engine's own settings;
            the engine's configuration is frozen, so a change builds the loss a new engine with it
            (``dataclasses.replace``: the run state, ``cache.auto``, goes along).
        check: ``check(name, value) -> kept value``; default the spec's.
        validate: ``validate(loss, value) -> kept value``, after ``check``: a check that reads the loss.
        target: ``target(loss, name) -> holder``: the object that keeps the value as its attribute ``attr``
            (default the setting's name), e.g. the sparse loss's base loss, read there at every step; a
            holder of None reads as None and keeps nothing (``validate`` refuses any other value then).
        attr: the holder's attribute (with ``target``).
        after: ``after(loss, old, new)``, called after every assignment (``old``: the value before, the
            spec's default at the first), to reset or rebuild what depends on the setting; if it raises,
            the old value is restored.
        none_reads_as: the name of another setting that a value of None reads as (a default that follows it).
        fixed: a reason: the value is set at construction and then refused with this reason if it changes
            (a setting kept on the loss).
        view: ``view(loss) -> value``: a setting that is a view of others (``temperature`` of ``scale``,
            ``symmetric`` of ``directions`` and ``partition_mode``) or of state the loss keeps elsewhere (a
            learned scale): it is read through ``view`` and keeps nothing itself; an assignment is checked
            (``check``, ``validate``) and then made by ``after``, which writes what the view reads.
    """

    def __init__(
        self,
        *,
        on_engine: bool = False,
        check: Callable[[str, Any], T] | None = None,
        validate: Callable[[Any, Any], Any] | None = None,
        target: Callable[[Any, str], Any] | None = None,
        attr: str | None = None,
        after: Callable[[Any, Any, Any], None] | None = None,
        none_reads_as: str | None = None,
        fixed: str | None = None,
        view: Callable[[Any], Any] | None = None,
    ) -> None:
        self.on_engine, self.check, self.validate, self.target = on_engine, check, validate, target
        self.after, self.none_reads_as, self.fixed, self.view = after, none_reads_as, fixed, view
        self.name = self.attr = attr or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.attr = self.attr or name
        self.check = self.check or SPECS[name].check
        # what the API reference shows for the attribute (not the descriptor class's Args)
        self.__doc__ = (
            _argument_text(owner, name) or f"The loss setting `{name}`, read and assigned between steps."
        )

    def __repr__(self) -> str:  # as the API reference shows the class attribute
        return f"Setting({self.name!r})"

    def _holder(self, obj: Any) -> Any:
        if self.target is not None:
            return self.target(obj, self.name)
        return obj.cache if self.on_engine else None

    def _read(self, obj: Any) -> Any:
        if self.view is not None:
            return self.view(obj)
        holder = self._holder(obj)
        if holder is None and (self.target is not None):
            return None
        if holder is None:  # not set yet: the spec's default
            default = SPECS[self.name].default if self.name in SPECS else _MISSING
            return obj.__dict__.get("_" + self.name, default)
        return getattr(holder, self.attr, None) if self.target is not None else getattr(holder, self.attr)

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Setting[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Setting[T] | T:
        if obj is None:
            return self
        value = self._read(obj)
        if value is _MISSING:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is not set yet.")
        if value is None and self.none_reads_as is not None:
            return getattr(obj, self.none_reads_as)
        return value

    def __set__(self, obj: object, value: Any) -> None:  # the check turns it into a T (e.g. '2GB')
        assert self.check is not None  # set by __set_name__
        value = self.check(self.name, value)
        if self.validate is not None:
            value = self.validate(obj, value)
        old = self._read(obj)
        if self.fixed is not None and "_" + self.name in vars(obj) and value != old:
            raise ValueError(
                f"{type(obj).__name__}.{self.name} is {old!r} and cannot be changed: {self.fixed}"
            )
        self._write(obj, value)
        if self.after is not None:
            try:
                self.after(obj, old, value)
            except BaseException:
                self._write(obj, old)
                raise

    def _write(self, obj: Any, value: Any) -> None:
        if self.view is not None:
            return  # a view keeps nothing: its after hook writes what it reads
        holder = self._holder(obj)
        if holder is None and self.target is not None:
            return  # nothing keeps it (validate allowed only None)
        if holder is None:
            if value is _MISSING:
                obj.__dict__.pop("_" + self.name, None)
            else:
                obj.__dict__["_" + self.name] = value
        elif self.on_engine:  # the engine's configuration is frozen: a changed setting is a new engine
            if value is not _MISSING and getattr(holder, self.attr) != value:
                obj.cache = dataclasses.replace(holder, **{self.attr: value})
        elif value is not _MISSING:
            setattr(holder, self.attr, value)


def closest_name_hint(word: str, choices: Sequence[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


_SIMILARITY_ALIASES = {
    **dict.fromkeys(("cosine", "cos_sim", "cos"), "cosine"),
    **dict.fromkeys(("dot", "dot_score", "dot_product"), "dot"),
}


def resolve_similarity(similarity_fct: Callable[..., Tensor] | str) -> Similarity:
    """Map sentence-transformers' ``cos_sim`` / ``dot_score`` (or "cosine" / "dot") to the core's GEMM
    scores; any other function ``f(a, b) -> (len(a), len(b))`` (``util.euclidean_sim``,
    ``util.manhattan_sim``, a user's) is scored exactly tile by tile through autograd (slower).

    A ``functools.partial`` of cos_sim / dot_score with nothing bound counts as the function.
    """
    if isinstance(similarity_fct, str):
        if similarity_fct.lower() in _SIMILARITY_ALIASES:
            return _SIMILARITY_ALIASES[similarity_fct.lower()]  # type: ignore[return-value]
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


def similarity_name(similarity: Similarity) -> str:
    """The config's name of a similarity (sentence-transformers writes the function's ``__name__``)."""
    if isinstance(similarity, str):
        return {"cosine": "cos_sim", "dot": "dot_score"}[similarity]
    return getattr(similarity, "__name__", type(similarity).__name__)


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


def is_symmetric(loss: Any) -> bool:
    """Whether ``loss`` has the CLIP pair of directions (``query_to_doc`` and ``doc_to_query``, per
    direction): what its ``symmetric`` setting reads (a view of ``directions`` and ``partition_mode``)."""
    return set(loss.directions) == set(TWO_DIRECTIONS) and loss.partition_mode == "per_direction"


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
