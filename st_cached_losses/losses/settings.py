"""A loss's settings: one frozen object per loss, checked as a whole when it is built and when it is replaced.

A loss's settings class is a frozen dataclass of [`Settings`][st_cached_losses.losses.settings.Settings]: one
field per constructor argument, declared with [`setting`][st_cached_losses.losses.settings.setting] (its
default, its meaning in one sentence, the check of its one value, and whether the model card's config lists
it), plus the checks of the settings that go together (``validate``), run on the whole object every time one
is made. A loss never changes its settings object: assigning ``loss.scale = 10.0`` builds a new one
(``settings.replace(scale=10.0)``), checked as a whole, so no check depends on the order of assignment;
``loss.update_settings(a=..., b=...)`` changes several at once.

A name means one thing across the family; shared settings are declared once, in the group classes every loss
composes: [`EngineSettings`][st_cached_losses.losses.settings.EngineSettings] (the encoder's mini-batches and
the engine's knobs) and [`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings] (the loss
stage's plan), here; the InfoNCE options in [`ranking`][st_cached_losses.losses.ranking]; a loss's own in its
module. A loss with another default for a shared setting redeclares it with
[`redefault`][st_cached_losses.losses.settings.redefault] (same meaning and check). The configuration layer reads
these declarations: the arguments' fields, their ``--help`` and their checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor

from st_cached_losses.engine.checks import (
    check_auto_budget,
    check_mini_batch_num_tokens,
    check_mini_batch_size,
    graph_budget,
    memory_bytes,
)
from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, LossPath, scale_value
from st_cached_losses.functional.checks import check_matmul_precision, check_path, check_positive_int
from st_cached_losses.losses.similarity import EMBEDDING

__all__ = [
    "DEFAULT_PLAN",
    "PLAN_FIELDS",
    "ConfigMode",
    "EngineSettings",
    "LearnableScaleSettings",
    "LossStageSettings",
    "Plan",
    "ScaleSettings",
    "Settings",
    "SharedSettings",
    "check_bool",
    "check_finite",
    "check_max_scale",
    "check_nonnegative",
    "check_positive_number",
    "check_scale",
    "closest_name_hint",
    "optional_budget",
    "redefault",
    "setting",
    "view",
]

S = TypeVar("S", bound="Settings")

#: whether the model card's config lists a setting: ``"always"`` (sentence-transformers' keys), ``"changed"``
#: (our extras, where they differ from the loss's default), ``"never"`` (speed and memory only)
ConfigMode = Literal["always", "changed", "never"]


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    check: Callable[[str, Any], Any] | None = None,
    config: ConfigMode = "changed",
    config_form: Callable[[Any, Any], Any] | None = None,
    module: bool = False,
) -> Any:
    """A setting's declaration, as a dataclass field of a settings class.

    Args:
        default: the loss's default (the constructor's, in the form it takes).
        doc: what the setting means, in one or two sentences: the arguments' ``--help`` and the configuration
            page read it.
        check: ``check(name, value) -> value kept`` of the value alone (raises a ``ValueError`` naming the
            setting); the checks of settings that go together are the class's ``validate``.
        config: whether ``get_config_dict()`` lists it ([`ConfigMode`][st_cached_losses.losses.settings.ConfigMode]).
        config_form: ``config_form(settings, value)``, the value as the config writes it where that is not the
            value itself (a function's name, a class path); a setting whose ``check`` is a similarity kind is
            written by its ``config_name`` without one.
        module: the value is a module (or None) that the loss registers as its submodule of the same name
            (its parameters trained and moved with the loss's, as sentence-transformers registers theirs).
    """
    return dataclasses.field(
        default=default,
        metadata={"doc": doc, "check": check, "config": config, "config_form": config_form, "module": module},
    )


def redefault(group: type[Settings], name: str, default: Any, *, config: ConfigMode | None = None) -> Any:
    """The setting ``name`` of ``group`` (its meaning, check and config mode) with another default: a loss
    whose default differs from the family's (the multi-vector loss's ``scale`` of 1.0); ``config``: another
    config mode (a key of sentence-transformers' loss in one family, an extra of ours in another)."""
    metadata = dict(group.__dataclass_fields__[name].metadata)
    if config is not None:
        metadata["config"] = config
    return dataclasses.field(default=default, metadata=metadata)


class view:
    """A setting that is a view of others (``temperature`` of ``scale``, ``symmetric`` of ``directions`` and
    ``partition_mode``): read through its getter; assigning it assigns what ``changes(settings, value)``
    returns (a dict of fields). Not a field: the settings object keeps nothing for it, and its config never
    lists it."""

    def __init__(self, fget: Callable[[Any], Any]) -> None:
        self.fget = fget
        self.fchanges: Callable[[Any, Any], dict[str, Any]] | None = None
        self.__doc__ = fget.__doc__
        self.name = fget.__name__

    def changes(self, fchanges: Callable[[Any, Any], dict[str, Any]]) -> view:
        """Declare what an assignment of the view changes."""
        self.fchanges = fchanges
        return self

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else self.fget(obj)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The base of every loss's settings: checks each field by its own check, then the whole object
    (``validate``), whenever one is made; [`replace`][st_cached_losses.losses.settings.Settings.replace] makes
    another, checked again."""

    #: the loss that owns these settings, named in the checks' messages
    owner: ClassVar[str] = "the loss"
    #: fields the loss sets itself, which its constructor (and the arguments, for it) does not take
    not_arguments: ClassVar[frozenset[str]] = frozenset()
    #: views its constructor takes as arguments (the tiled loss's ``symmetric``)
    view_arguments: ClassVar[frozenset[str]] = frozenset()
    #: the config's first keys, sentence-transformers' in their order: every ``"always"`` field, and views
    #: (None: the ``"always"`` fields in declaration order)
    config_keys: ClassVar[tuple[str, ...] | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # a misspelt keyword names the closest setting (the dataclass's __init__ raises a TypeError naming none);
        # the loss's name where it has one: its constructor passes its keywords on to its settings
        known = [f.name for f in fields(cls) if f.init]
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            owner = cls.owner if cls.owner != Settings.owner else cls.__name__
            raise TypeError(
                f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}."
                + closest_name_hint(unknown[0], known)
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # every field is checked before any error is raised: one error names every bad setting at once
        errors: list[Exception] = []
        for f in fields(self):
            check = f.metadata.get("check")
            if check is None:
                continue
            try:
                value = check(f.name, getattr(self, f.name))
                object.__setattr__(self, f.name, value)
                if hasattr(check, "resolve"):  # a similarity: resolved once, kept with the settings
                    self.__dict__[f"_resolved_{f.name}"] = check.resolve(value)
            except (TypeError, ValueError) as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            kind = type(errors[0]) if all(type(e) is type(errors[0]) for e in errors) else ValueError
            raise kind(
                f"{self.owner}: {len(errors)} settings are invalid:\n" + "\n".join(f"- {e}" for e in errors)
            ) from errors[0]
        self.validate()

    def resolved(self, name: str) -> Any:
        """What the setting ``name`` (a similarity, kept as given) resolved to when these settings were made."""
        return self.__dict__[f"_resolved_{name}"]

    def validate(self) -> None:
        """The checks of settings that go together (each group calls ``super().validate()``)."""

    # ------------------------------------------------------------------ names, views, replacing

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The settings' fields, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def views(cls) -> dict[str, view]:
        """The settings that are views of others, by name."""
        return {v.name: v for c in reversed(cls.__mro__) for v in vars(c).values() if isinstance(v, view)}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting a loss of these settings has: its fields and its views."""
        return (*cls.field_names(), *(n for n in cls.views() if n not in cls.field_names()))

    @classmethod
    def declaration(cls, name: str) -> dataclasses.Field[Any]:
        """The field declaring ``name`` (its default, and in ``metadata`` its doc, check and config mode)."""
        return cls.__dataclass_fields__[name]

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of the field ``name``."""
        return cls.declaration(name).default

    def replace(self: S, **changes: Any) -> S:
        """A new settings object with ``changes`` (fields or views), checked as a whole."""
        views = type(self).views()
        resolved: dict[str, Any] = {}
        for name, value in changes.items():
            if name in views and name not in type(self).field_names():
                fchanges = views[name].fchanges
                if fchanges is None:
                    raise AttributeError(f"{self.owner}.{name} is read-only.")
                resolved.update(fchanges(self, value))
            else:
                resolved[name] = value
        return dataclasses.replace(self, **resolved)

    # ------------------------------------------------------------------ the model card's config
    # Derived from the declarations: sentence-transformers' keys (``config_keys``), what was learned, our
    # extras where they differ from their defaults, an "auto" loss's budget. Every key a constructor argument.

    def config(self) -> dict[str, Any]:
        """The loss's ``get_config_dict()``: sentence-transformers' keys
        ([`keys_config`][st_cached_losses.losses.settings.Settings.keys_config]), what a learned value needs
        (``learned_config``), our extras in use
        ([`extras_config`][st_cached_losses.losses.settings.Settings.extras_config]) and an ``"auto"`` loss's
        budget (``auto_config``), each in a form the constructor takes back."""
        return {**self.keys_config(), **self.learned_config(), **self.extras_config(), **self.auto_config()}

    def config_value(self, name: str) -> Any:
        """The setting ``name`` as the config writes it: its declaration's ``config_form``, a similarity's
        config name, or the value itself (a view's too)."""
        value = getattr(self, name)
        declared = type(self).__dataclass_fields__.get(name)
        if declared is None:
            return value
        form = declared.metadata.get("config_form")
        if form is not None:
            return form(self, value)
        config_name = getattr(declared.metadata.get("check"), "config_name", None)
        return config_name(value) if config_name is not None else value

    @classmethod
    def key_names(cls) -> tuple[str, ...]:
        """sentence-transformers' keys the config lists whatever their value, in their order."""
        if cls.config_keys is not None:
            return cls.config_keys
        return tuple(f.name for f in fields(cls) if f.metadata.get("config") == "always")

    def keys_config(self) -> dict[str, Any]:
        """sentence-transformers' keys with these settings' values."""
        return {name: self.config_value(name) for name in self.key_names()}

    @classmethod
    def extra_names(cls) -> tuple[str, ...]:
        """Our extras: the ``"changed"`` fields a constructor takes, in declaration order."""
        return tuple(
            f.name
            for f in fields(cls)
            if f.metadata.get("config") == "changed" and f.name not in cls.not_arguments
        )

    def extras_config(self) -> dict[str, Any]:
        """Our extras that differ from their defaults."""
        return {name: self.config_value(name) for name in self.changed(self.extra_names())}

    def learned_config(self) -> dict[str, Any]:
        """What rebuilding a loss that learns a value needs besides it (``learnable_scale`` and its clamp)."""
        return {}

    def auto_config(self) -> dict[str, Any]:
        """What an ``"auto"`` loss needs besides its sizes to be rebuilt."""
        return {}

    def changed(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        """The fields among ``names`` (default: every ``"changed"`` field) whose value differs from their
        default, as they are (a form the constructor takes), in the order of ``names``."""
        declared = type(self).__dataclass_fields__
        if names is None:
            names = [f.name for f in fields(self) if f.metadata.get("config") == "changed"]
        return {name: getattr(self, name) for name in names if getattr(self, name) != declared[name].default}

    def citations(self) -> tuple[str, ...]:
        """BibTeX entries of the options in use, added to the loss's own."""
        return ()

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """The settings in use that sentence-transformers' loss of the same kind does not have (a learnable
        scale, a negative bank, duplicate masks, ...): with any, no loss of theirs gives this loss's result,
        cached or not (the caching-off warning then points to none). Each group adds its own."""
        return ()


# ---------------------------------------------------------------------- values' checks


def check_bool(name: str, value: Any) -> bool:
    """True or False (not 0 / 1)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def _finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_finite(name: str, value: Any) -> float:
    """A finite number, as a float."""
    if not _finite_number(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def check_positive_number(name: str, value: Any) -> float:
    """A finite number > 0, as a float."""
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


def check_scale(name: str, value: Any) -> float:
    """A scale or a temperature (its inverse): finite and positive, sentence-transformers' words."""
    return scale_value(value, name)


def check_max_scale(max_scale: float, scale: float) -> None:
    """A learnable scale's clamp is at least the scale."""
    if max_scale < scale:
        raise ValueError(
            f"max_scale must be >= scale with learnable_scale, got max_scale={max_scale!r} and scale={scale!r}."
        )


def optional_budget(name: str, value: Any) -> int | None:
    """A memory budget in bytes ([`memory_bytes`][st_cached_losses.engine.checks.memory_bytes]'s forms), or None."""
    return memory_bytes(value, name)


def _graph_budget(name: str, value: Any) -> int | str | None:
    """``graph_memory_budget``: a budget as ``optional_budget`` takes it, or ``"auto"`` / ``"auto:<size>"``
    ([`graph_budget`][st_cached_losses.engine.checks.graph_budget])."""
    return graph_budget(value, name)


def _budget(name: str, value: Any) -> int:
    if value is None:
        raise ValueError(f"{name} must be a positive integer (bytes) or a size such as '64MiB', got None.")
    out = memory_bytes(value, name)
    assert out is not None
    return out


def _mini_batch_size(name: str, value: Any) -> int | str:
    check_mini_batch_size(value)
    return value


def _mini_batch_num_tokens(name: str, value: Any) -> int | str | None:
    check_mini_batch_num_tokens(value)
    return value


def closest_name_hint(word: str, choices: Sequence[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


# ---------------------------------------------------------------------- the engine's and the loss stage's


@dataclass(frozen=True, kw_only=True)
class EngineSettings(Settings):
    """The encoder's mini-batches and the engine's knobs (how it runs them; none changes the result): every
    cached loss's, declared here once. A loss takes the knobs as keyword-only arguments (``**engine``); a
    change of one builds the loss a new engine (its configuration is frozen), keeping its run state."""

    mini_batch_size: int | str = setting(
        32,
        doc="Rows per encoder forward (GradCache's chunk): sets the memory, never the result. Smaller than the "
        "batch to save memory; caching is off only when the whole batch, all its columns' rows together, fits "
        "in one mini-batch. 'auto': the largest that fits mini_batch_memory_budget, measured at the first "
        "step and logged.",
        check=_mini_batch_size,
        config="always",
    )
    mini_batch_num_tokens: int | str | None = setting(
        None,
        doc="A budget of real (non-padding) tokens per encoder mini-batch instead of a fixed row count, as in "
        "sentence-transformers: rows are packed longest first while their token count stays within it (a longer "
        "row alone), so long texts get smaller mini-batches; mini_batch_size is then not used. 'auto': the "
        "largest budget that fits mini_batch_memory_budget.",
        check=_mini_batch_num_tokens,
        config="always",
    )
    show_progress_bar: bool = setting(
        False,
        doc="Show tqdm bars over the loss's encoder mini-batches (both passes).",
        check=check_bool,
        config="never",
    )
    sort_by_length: bool = setting(
        True,
        doc="Embed each column's rows longest first (less padding in a mini-batch); never changes the result.",
        check=check_bool,
        config="never",
    )
    reuse_last_graph: bool = setting(
        True,
        doc="Keep the last encoder mini-batch's graph from the first pass instead of replaying it; never "
        "changes the result.",
        check=check_bool,
        config="never",
    )
    keep_params_unsharded: bool = setting(
        False,
        doc="Under FSDP2: gather every parameter group once per step and keep it until the last replay (one "
        "all-gather and one reduce-scatter per group per step), for the memory of the full parameters; nothing "
        "for other wrappers.",
        check=check_bool,
        config="never",
    )
    graph_memory_budget: int | str | None = setting(
        None,
        doc="Bytes (or a size such as '6GB') of first-pass encoder graphs to keep instead of replaying their "
        "mini-batches, the largest first; the same gradients, fewer forwards. 'auto': on CUDA what the device "
        "has free after the step's own needs ('auto:20GB': at most 20 GB), elsewhere none. None: replay all but "
        "the last.",
        check=_graph_budget,
        config="never",
    )
    mini_batch_memory_budget: int | None = setting(
        None,
        doc="With mini_batch_size='auto' (or mini_batch_num_tokens='auto'): the activation memory one encoder "
        "mini-batch may take, in bytes or a size such as '2GB' (on CUDA by default half the free memory).",
        check=optional_budget,
        config="never",
    )

    #: the fields kept on the engine (``loss.cache``), by their name there
    engine_fields: ClassVar[tuple[str, ...]] = (
        "mini_batch_size",
        "mini_batch_num_tokens",
        "show_progress_bar",
        "sort_by_length",
        "reuse_last_graph",
        "keep_params_unsharded",
        "graph_memory_budget",
        "mini_batch_memory_budget",
    )

    def validate(self) -> None:
        super().validate()
        check_auto_budget(
            self.mini_batch_size,
            self.mini_batch_num_tokens,
            self.mini_batch_memory_budget,
            cuda=torch.cuda.is_available(),
        )

    def engine(self) -> dict[str, Any]:
        """The engine's configuration these settings give (``GradCache``'s fields)."""
        return {name: getattr(self, name) for name in self.engine_fields}

    def auto_config(self) -> dict[str, Any]:
        """What the config of an ``"auto"`` loss needs besides its sizes to rebuild it: its
        ``mini_batch_memory_budget`` (a setting that never changes the result, otherwise left out of the
        config; an ``"auto"`` loss without it is refused where no CUDA device gives it a default)."""
        budget = self.mini_batch_memory_budget
        return {} if budget is None else {"mini_batch_memory_budget": budget}


@dataclass(frozen=True)
class Plan:
    """The loss stage's plan, handed to a stage whole (as the engine's part of the settings is handed to the
    engine): how the stage cuts its logit blocks and runs their products; none changes the result beyond the
    products' precision. A loss's settings make it ([`LossStageSettings.plan`][st_cached_losses.losses.settings.LossStageSettings.plan]);
    a stage says which of its fields it uses (``Stage.plan_fields``), and a loss whose stage uses none of a
    field set off its default refuses it when it is built."""

    #: ``"auto"``, ``"chunked"`` or ``"tiled"`` (across processes the ring exchange)
    path: LossPath = "auto"
    #: side of a logit tile / rows of a chunk (None: from ``memory_budget``)
    tile_size: int | None = None
    #: bytes of logit blocks the stage may hold at once
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    #: the similarity products' precision (None: torch's float32 matmul precision at the step)
    matmul_precision: str | None = None

    def options(self) -> dict[str, Any]:
        """The plan as the functional core's options take it (``InfoNCEOptions``, ``SigmoidOptions``)."""
        return {
            "path": self.path,
            "tile_size": self.tile_size,
            "memory_budget": self.memory_budget,
            "matmul_precision": self.matmul_precision,
        }


#: the plan's fields, which ``LossStageSettings`` declares under the same names
PLAN_FIELDS = tuple(f.name for f in fields(Plan))
#: the plan of the defaults (a stage's default)
DEFAULT_PLAN = Plan()


@dataclass(frozen=True, kw_only=True)
class LossStageSettings(EngineSettings):
    """The loss stage's plan (how the embedding losses' loss stage runs; none changes the result), declared
    here once, taken keyword-only with the engine's knobs."""

    path: LossPath = setting(
        "auto",
        doc="The loss stage's algorithm: 'auto' (from the batch and memory_budget), 'chunked' (row chunks "
        "against every column) or 'tiled' (Inf-CL-style tiles; across processes, the ring exchange); never "
        "changes the result.",
        check=check_path,
        config="never",
    )
    tile_size: int | None = setting(
        None,
        doc="Side of a logit tile / rows of a chunk of the loss stage (default: from memory_budget, at most 2048).",
        check=check_positive_int,
    )
    memory_budget: int = setting(
        DEFAULT_MEMORY_BUDGET,
        doc=f"Bytes of logit blocks the loss stage may hold at once, or a size such as '64MiB' (default "
        f"{DEFAULT_MEMORY_BUDGET // 2**20} MiB).",
        check=_budget,
        config="never",
    )
    matmul_precision: str | None = setting(
        None,
        doc="The loss stage's similarity products, with torch.set_float32_matmul_precision's names: 'highest' "
        "(fp32, exact), 'high' (TF32 on CUDA), 'medium' (bf16 operands, fp32 sums); default None: "
        "torch.get_float32_matmul_precision() at the step. Statistics and gradients stay fp32.",
        check=check_matmul_precision,
    )

    def plan(self) -> Plan:
        """The loss stage's part of these settings, whole: what ``build_stage`` hands the stage."""
        return Plan(**{name: getattr(self, name) for name in PLAN_FIELDS})

    def idle_plan_hint(self, name: str) -> str:
        """What to do about the plan's ``name`` set where no part of the loss uses it (a loss adds the
        setting that would use it)."""
        return f"remove {name}"


# ---------------------------------------------------------------------- the groups several losses share


@dataclass(frozen=True, kw_only=True)
class ScaleSettings(Settings):
    """The scale of an InfoNCE softmax (``1 / temperature``)."""

    scale: float = setting(
        20.0,
        doc="Multiplies the similarities in the InfoNCE softmax: 1 / temperature (20 suits cosine similarity). "
        "The initial value when learnable.",
        check=check_scale,
        config="always",
    )

    @view
    def temperature(self) -> float:
        """The temperature of the InfoNCE softmax, ``1 / scale``; setting it sets the scale."""
        return 1.0 / self.scale

    @temperature.changes
    def _(self, value: Any) -> dict[str, Any]:
        if value == self.temperature:
            return {}  # unchanged: 1 / (1 / s) may round
        return {"scale": 1.0 / check_scale("temperature", value)}


@dataclass(frozen=True, kw_only=True)
class LearnableScaleSettings(ScaleSettings):
    """A scale that may be learned (CLIP's ``logit_scale``, clamped)."""

    learnable_scale: bool = setting(
        False,
        doc="Learn the scale as CLIP's logit_scale = log(scale), clamped at max_scale; give the trainer "
        "callbacks=[LossStateCallback(loss)] to save, restore and log it.",
        check=check_bool,
        config="never",
    )
    max_scale: float = setting(
        100.0,
        doc="The clamp of a learned scale (CLIP: 100).",
        check=check_positive_number,
        config="never",
    )

    def validate(self) -> None:
        super().validate()
        if self.learnable_scale:
            check_max_scale(self.max_scale, self.scale)

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """A learned scale (sentence-transformers' losses keep theirs fixed)."""
        return (
            *super().beyond_sentence_transformers(),
            *(("learnable_scale",) if self.learnable_scale else ()),
        )

    def learned_config(self) -> dict[str, Any]:
        """The config's entries of a learnable scale: ``learnable_scale`` and its clamp, when learnable."""
        return {"learnable_scale": True, "max_scale": self.max_scale} if self.learnable_scale else {}


@dataclass(frozen=True, kw_only=True)
class SharedSettings(Settings):
    """Settings that losses of several kinds take with one meaning (the ranking, sigmoid, multi-vector and
    distillation losses), declared once here: a loss's settings class takes each with
    [`redefault`][st_cached_losses.losses.settings.redefault] (its own default, the same meaning and check)."""

    similarity_fct: Callable[..., Tensor] | str = setting(
        cos_sim,
        doc="Similarity of embeddings: 'cosine' or 'dot' (dot product), sentence-transformers' cos_sim / "
        "dot_score (GEMM tiles); any other function f(a, b) -> (len(a), len(b)) is scored exactly tile by tile "
        "through autograd (slower).",
        check=EMBEDDING,
        config="always",
    )
    gather_across_devices: bool = setting(
        False,
        doc="Score each process's rows against every process's candidates (exact global-batch gradients across "
        "processes); by ring exchange on the tiled path.",
        check=check_bool,
        config="always",
    )


# ---------------------------------------------------------------------- the previous release's names

#: names the previous release (0.2.0) documented here that moved, each to its new home: still importable from
#: here, with a DeprecationWarning naming it (looked up when read: ``ranking`` imports this module)
_MOVED = {
    **{
        name: ("st_cached_losses.losses.ranking", name)
        for name in (
            "ONE_DIRECTION",
            "TWO_DIRECTIONS",
            "VALID_DIRECTIONS",
            "VALID_HARDNESS_MODES",
            "VALID_PARTITION_MODES",
            "ConfigTuple",
            "check_directions",
            "check_hardness",
        )
    },
    # the embedding similarities' kind: resolving a similarity_fct, and its config's name, the same answers
    "resolve_similarity": ("st_cached_losses.losses.similarity", "EMBEDDING.resolve"),
    "similarity_name": ("st_cached_losses.losses.similarity", "EMBEDDING.config_name"),
}
#: names the previous release documented here whose home is now above this layer, or which are gone
_GONE = {
    "FIELD_NAMES": "st_cached_losses.config.registry.FIELD_NAMES (the configuration layer's, which this layer "
    "does not import)",
    "NOT_FIELDS": "st_cached_losses.config.registry.NOT_FIELDS (the configuration layer's, which this layer "
    "does not import)",
    "SPECS": "each setting's declaration: a field of its settings class, setting(default, doc=..., check=..., "
    "config=...), read with SettingsClass.declaration(name)",
    "Spec": "setting(default, doc=..., check=..., config=...), a field of a Settings dataclass",
    "Setting": "a field of a Settings dataclass declared with setting(...); the loss's attribute is "
    "st_cached_losses.losses.base.SettingAttribute",
}


def __getattr__(name: str) -> Any:
    """The previous release's names (``VALID_DIRECTIONS``, ``check_directions``, ``ConfigTuple``, ...): a
    moved one from its new home with a ``DeprecationWarning`` naming it; one that is not in this layer any
    more raises an ``ImportError`` naming where it went or what replaced it."""
    if name in _MOVED:
        module, path = _MOVED[name]
        warnings.warn(
            f"st_cached_losses.losses.settings.{name} is deprecated: import {module}.{path} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        value: Any = importlib.import_module(module)
        for part in path.split("."):
            value = getattr(value, part)
        return value
    if name in _GONE:
        # an ImportError: ``from ... import`` replaces an AttributeError's message with a bare one
        raise ImportError(
            f"st_cached_losses.losses.settings.{name} moved out of this module with the settings redesign: use "
            f"{_GONE[name]}; docs/development.md walks through a loss's settings.",
            name=__name__,
        )
    raise AttributeError(f"module 'st_cached_losses.losses.settings' has no attribute {name!r}")
