"""The configuration's view of the losses: which cached loss each name (or alias) means, the settings each
takes from the arguments (read from its settings object's declarations), the defaults the configuration
fills in, and the "did you mean" hint every configuration error uses.

Every table is read from the losses' registry ([`st_cached_losses.losses.registry`][st_cached_losses.losses.registry])
when it is used, so a loss registered later (a user's module imported after this one) is in them.

The bottom of the configuration layer: it imports the losses only, so that the arguments class
([`st_cached_losses.config.training_args`][st_cached_losses.config.training_args]), the factory
([`st_cached_losses.config.factory`][st_cached_losses.config.factory]) and the parser
([`st_cached_losses.config.cli`][st_cached_losses.config.cli]) share one table.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from st_cached_losses.losses import registry
from st_cached_losses.losses.base import CachedLoss
from st_cached_losses.losses.settings import closest_name_hint  # the hint of every configuration error

__all__ = [
    "BASE_LOSSES",
    "BASE_SIMILARITY",
    "DEFAULT_GIST_TEMPERATURE",
    "DEFAULT_SCALE",
    "DEFAULT_SCALE_LEARNING_RATE",
    "DISTILLATION_LOSSES",
    "FIELD_NAMES",
    "LOSSES",
    "LOSS_ALIASES",
    "MODEL_KINDS",
    "NOT_FIELDS",
    "ST_LOSS_NAMES",
    "UNUSED_PARAMETERS",
    "accepts",
    "base_parameters",
    "canonical_loss",
    "closest_name_hint",
    "declaration",
    "field_takers",
    "loss_default",
    "loss_parameters",
    "own_parameters",
    "takers",
]

V = TypeVar("V")


class _Live(Mapping[str, V]):
    """A table computed from the registry whenever it is read (a loss registered later is in it)."""

    def __init__(self, build: Callable[[], dict[str, V]]) -> None:
        self._build = build

    def __getitem__(self, key: str) -> V:
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())


def _losses() -> dict[str, type[CachedLoss]]:
    return registry.losses()


def _aliases() -> dict[str, str]:
    names = registry.names()
    out = {name: name for name in names}
    # a class that several names share (CachedSparseLoss) means its own name ('sparse'), not a variant's
    out.update({e.cls.__name__.lower(): name for name, e in reversed(names.items()) if not e.variant})
    for name, entry in names.items():
        out.update({alias.lower(): name for alias in entry.aliases})
    return out


def _st_names() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, entry in registry.names().items():
        for st in entry.st_names:
            out.setdefault(st.lower(), {})[entry.cls.model_kind] = name
    return out


#: canonical loss name -> class
LOSSES: Mapping[str, type[CachedLoss]] = _Live(_losses)
#: every accepted spelling (lower case) -> canonical name: the names, the aliases, our class names
LOSS_ALIASES: Mapping[str, str] = _Live(_aliases)
#: sentence-transformers' class names (lower case) -> ours, by the model kind they train: a run written for
#: theirs names its loss as before. Two of theirs share the name CachedMultipleNegativesRankingLoss (the
#: SentenceTransformer's and the CrossEncoder's): the arguments class, which trains one kind, tells them apart
ST_LOSS_NAMES: Mapping[str, dict[str, str]] = _Live(_st_names)
#: the model (and trainer) each loss trains: sentence-transformers' class names
MODEL_KINDS: Mapping[str, str] = _Live(lambda: {n: e.cls.model_kind for n, e in registry.names().items()})
#: losses whose base loss is an object of its own, built by the factory from the fields: its class, whose
#: constructor arguments (but the model) are fields too
BASE_LOSSES: Mapping[str, type[Any]] = _Live(
    lambda: {n: e.base_loss for n, e in registry.names().items() if e.base_loss is not None}
)
#: settings of a loss's class that its base loss leaves unused, so no field sets them
UNUSED_PARAMETERS: Mapping[str, frozenset[str]] = _Live(
    lambda: {n: e.unused for n, e in registry.names().items() if e.unused}
)
#: the similarity kind of a loss's base loss (the arguments' ``similarity`` names and what each gives it)
BASE_SIMILARITY: Mapping[str, Any] = _Live(
    lambda: {n: e.base_similarity for n, e in registry.names().items() if e.base_similarity is not None}
)
#: the distillation losses: teacher scores in the dataset's label column, at least one negative column
DISTILLATION_LOSSES: Mapping[str, type[CachedLoss]] = _Live(
    lambda: {n: e.cls for n, e in registry.names().items() if e.distillation}
)

#: settings set by an arguments field of another name
FIELD_NAMES = {
    "similarity_fct": "similarity",
    "show_progress_bar": "loss_show_progress_bar",
    "guide": "guide_model",
    "teacher": "teacher_model",
    "bias": "siglip_bias",
}
#: settings no field sets, and why
NOT_FIELDS = {
    "model": "the trainer's model: build_loss(model, args) passes it",
    "loss": "CachedSparseLoss's base loss, an object: build_loss builds SparseMultipleNegativesRankingLoss "
    "('sparse') from the fields scale, similarity, gather_across_devices, directions, partition_mode and "
    "hardness_*, SparseDistillKLDivLoss ('sparse_distill_kl') from similarity, temperature, student_temperature "
    "and teacher_temperature, SparseMarginMSELoss ('sparse_margin_mse') from similarity; construct "
    "CachedSparseLoss yourself for another base loss",
    "document_regularizer": "an object: the default FlopsLoss, counting rows above document_regularizer_threshold; "
    "construct CachedSparseLoss yourself for another regulariser",
    "activation_fn": "an nn.Module: the default (torch.nn.Sigmoid, as sentence-transformers'); construct "
    "CachedCrossEncoderLoss yourself for another activation",
    "query_regularizer": "an object: the default FlopsLoss, counting rows above query_regularizer_threshold; "
    "construct CachedSparseLoss yourself for another regulariser",
}

#: the default learning rate of a learnable scale (its own optimizer group, see ``scale_learning_rate``)
DEFAULT_SCALE_LEARNING_RATE = 1e-2


def canonical_loss(name: str, kind: str | None = None) -> str | None:
    """Our canonical name of loss ``name`` (ours, an alias, our class name or sentence-transformers' class
    name, any case), for an arguments class that trains ``kind`` (None: any); None for no cached loss.

    A sentence-transformers name for the kind's loss gives ours (``CachedMultipleNegativesRankingLoss``:
    'mnr', or 'cross_encoder' for a CrossEncoder); one for another kind gives that kind's loss (the
    arguments class then says which class to use)."""
    key = str(name).lower()
    aliases = _aliases()
    if key in aliases:
        return aliases[key]
    ours = _st_names().get(key)
    if ours is None:
        return None
    return ours.get(kind or "", next(iter(ours.values())))


def own_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The settings of loss ``name`` (canonical) that the arguments may set, each as a keyword parameter with
    the loss's default: its settings' fields (but those the loss sets itself, ``not_arguments``, and those its
    base loss leaves unused) and the views its constructor takes (``view_arguments``: the tiled loss's
    ``symmetric``)."""
    entry = registry.names()[name]
    settings = entry.cls.settings_class
    skip = settings.not_arguments | entry.unused
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = {
        f.name: inspect.Parameter(
            f.name,
            keyword,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
        )
        for f in dataclasses.fields(settings)
        if f.name not in skip
    }
    params.update({v: inspect.Parameter(v, keyword, default=None) for v in settings.view_arguments})
    return params


def base_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The constructor arguments of loss ``name``'s base loss (but ``self`` and ``model``), which the factory
    builds from the fields; empty for a loss without one."""
    base = registry.names()[name].base_loss
    if base is None:
        return {}
    params = inspect.signature(base.__init__).parameters.items()
    return {key: param for key, param in params if key not in ("self", "model")}


def loss_parameters(name: str) -> dict[str, inspect.Parameter]:
    """Everything the arguments may set for loss ``name``: its own settings
    ([`own_parameters`][st_cached_losses.config.registry.own_parameters]), then its base loss's constructor
    arguments ([`base_parameters`][st_cached_losses.config.registry.base_parameters])."""
    return {**base_parameters(name), **own_parameters(name)}


def loss_default(name: str, setting: str) -> Any:
    """Loss ``name``'s default of ``setting`` (None where it has none)."""
    param = loss_parameters(name).get(setting)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def takers(setting: str) -> list[str]:
    """The losses (canonical names) that have ``setting`` as a setting of their own (or of their base loss)."""
    return [name for name in _losses() if setting in loss_parameters(name)]


def accepts(name: str, setting: str) -> bool:
    """Whether the arguments take ``setting`` for loss ``name``: a setting of its own (or of its base loss), or
    ``scale`` / ``temperature`` where the loss has the other as a setting and this one is its inverse (an
    InfoNCE loss's ``temperature`` is ``1 / scale``; GIST's ``scale`` is a view of its temperature). The one
    rule of the arguments' checks, their ``--help`` and the configuration page's lists."""
    taken = loss_parameters(name)
    if setting in taken:
        return True
    if setting == "temperature":
        return "scale" in taken
    if setting == "scale":
        return "temperature" in taken and "scale" in _losses()[name].settings_class.views()
    return False


def field_takers(setting: str) -> list[str]:
    """The losses (canonical names) whose arguments take ``setting``
    ([`accepts`][st_cached_losses.config.registry.accepts]), in the registry's order."""
    return [name for name in _losses() if accepts(name, setting)]


def declaration(setting: str) -> dataclasses.Field[Any] | None:
    """The declaration of ``setting`` (its meaning, check and config mode): the first registered loss's
    settings field of that name (a name means one thing across the family)."""
    for entry in registry.names().values():
        fields = entry.cls.settings_class.__dataclass_fields__
        if setting in fields:
            return fields[setting]
    return None


#: the InfoNCE losses' default scale (``CachedMNRLoss``'s, as sentence-transformers')
DEFAULT_SCALE: float = loss_default("mnr", "scale")
#: GISTEmbedLoss's default temperature (scale 100), ``CachedGISTLoss``'s
DEFAULT_GIST_TEMPERATURE: float = loss_default("gist", "temperature")
