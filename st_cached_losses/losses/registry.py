"""Which cached loss each name means: every loss class that declares a ``name`` is registered when it is
defined ([`CachedLoss`][st_cached_losses.losses.base.CachedLoss]'s ``__init_subclass__``), with its aliases,
the sentence-transformers class names it replaces, and its variants (the sparse loss with a distillation base
loss). The configuration layer reads this registry (``loss:`` names, the fields each loss takes), so a loss
defined in a user's module builds from a dict, a YAML file and the command line by its name once its module is
imported.

The losses are listed in the order their classes were registered, a variant after every class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LossName", "Variant", "losses", "names", "register", "setting_owners", "unregister"]


@dataclass(frozen=True)
class Variant:
    """Another name for a loss class that builds it with a base loss of its own: ``name``'s loss is the class
    with a ``base_loss`` built from the arguments' fields (``CachedSparseLoss`` with
    ``SparseDistillKLDivLoss``: ``"sparse_distill_kl"``)."""

    name: str
    #: the base loss's class (the factory builds it from the fields its constructor takes)
    base_loss: type[Any] | None = None
    aliases: tuple[str, ...] = ()
    #: sentence-transformers' class names that mean this loss
    st_names: tuple[str, ...] = ()
    #: the class's settings this variant leaves unused (the arguments refuse them for it)
    unused: frozenset[str] = frozenset()
    #: a distillation loss: teacher scores in the labels, at least one negative column
    distillation: bool = False
    #: the similarity kind of the base loss (its ``similarity_fct``: the arguments' names and what each gives)
    base_similarity: Any = None


@dataclass(frozen=True)
class LossName:
    """A name ``loss:`` takes: the class it builds, its aliases and sentence-transformers' names."""

    name: str
    cls: type[Any]  #: a CachedLoss subclass
    aliases: tuple[str, ...] = ()
    st_names: tuple[str, ...] = ()
    base_loss: type[Any] | None = None
    unused: frozenset[str] = frozenset()
    distillation: bool = False
    base_similarity: Any = None
    variant: bool = False


_NAMES: dict[str, LossName] = {}
#: a change count, so that what is computed from the registry is computed again after a registration
_VERSION = [0]
_OWNERS: dict[str, Any] = {}


def register(cls: type[Any]) -> None:
    """Register ``cls`` under its ``name`` and its variants. Every spelling ``loss:`` would take for it (a
    name, an alias, our class name, any case) and every sentence-transformers class name it claims for its
    model kind must be free: one taken by another class raises a ``ValueError`` naming that class (a later
    registration would otherwise take the name from it, or be shadowed by it, silently). The same class
    defined again (its module reloaded, a notebook cell run twice: the same module and qualified name)
    replaces the earlier one, its old names with it. A subclass declares its own names: it inherits none of
    its parent's (the CLIP loss is not sentence-transformers' MNRL)."""
    own = vars(cls)
    entries = [
        LossName(
            cls.name,
            cls,
            tuple(own.get("aliases", ())),
            tuple(own.get("st_names", ())),
            own.get("default_base_loss"),
            distillation=cls.distillation,
            base_similarity=own.get("default_base_similarity"),
        ),
        *(
            LossName(
                v.name,
                cls,
                v.aliases,
                v.st_names,
                v.base_loss,
                v.unused,
                v.distillation,
                v.base_similarity,
                True,
            )
            for v in own.get("variants", ())
        ),
    ]
    qualified = _qualified(cls)
    others = [e for e in _NAMES.values() if _qualified(e.cls) != qualified]
    taken = {s: e for e in others for s in _spellings(e)}
    st_taken = {(st.lower(), e.cls.model_kind): e for e in others for st in e.st_names}
    for entry in entries:
        for spelling, what in _spellings(entry).items():
            owner = taken.get(spelling)
            if owner is not None:
                raise ValueError(
                    f"loss {what} {spelling!r} of {qualified} is taken by {_qualified(owner.cls)} "
                    f"(loss {owner.name!r}): give {cls.__name__} another {what}; 'loss:' must mean one loss."
                )
        for st in entry.st_names:
            owner = st_taken.get((st.lower(), cls.model_kind))
            if owner is not None:
                raise ValueError(
                    f"sentence-transformers' class name {st!r} in st_names of {qualified} is taken by "
                    f"{_qualified(owner.cls)} (loss {owner.name!r}) for a {cls.model_kind}: remove it from "
                    f"{cls.__name__}.st_names; 'loss:' must mean one loss."
                )
    for name in [n for n, e in _NAMES.items() if _qualified(e.cls) == qualified]:
        del _NAMES[name]  # the class defined again: its earlier definition's names go
    for entry in entries:
        _NAMES[entry.name] = entry
    _VERSION[0] += 1


def _spellings(entry: LossName) -> dict[str, str]:
    """What ``loss:`` takes for ``entry`` (lower case; the configuration reads names in any case), each with
    what it is: its name, its aliases and, for a class's own name, our class name."""
    out = {entry.cls.__name__.lower(): "class name"} if not entry.variant else {}
    out.update({alias.lower(): "alias" for alias in entry.aliases})
    out[entry.name.lower()] = "name"
    return out


def unregister(cls: type[Any]) -> None:
    """Forget ``cls``'s names (its own and its variants'): a loss defined for a while (a test's)."""
    for name in [n for n, e in _NAMES.items() if e.cls is cls]:
        del _NAMES[name]
    _VERSION[0] += 1


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def names() -> dict[str, LossName]:
    """Every registered name, the classes' own in registration order, then the variants."""
    ordered = sorted(_NAMES.values(), key=lambda e: e.variant)  # stable: registration order within each
    return {e.name: e for e in ordered}


def losses() -> dict[str, type[Any]]:
    """Every registered name and the class it builds."""
    return {name: entry.cls for name, entry in names().items()}


def setting_owners(setting: str) -> tuple[str, ...]:
    """The registered loss classes (their names, sorted) whose settings include ``setting``."""
    if _OWNERS.get("version") != _VERSION[0]:
        owners: dict[str, set[str]] = {}
        for entry in _NAMES.values():
            for name in entry.cls.settings_class.names():
                owners.setdefault(name, set()).add(entry.cls.__name__)
        _OWNERS.clear()
        _OWNERS.update({"version": _VERSION[0], "owners": {k: tuple(sorted(v)) for k, v in owners.items()}})
    return _OWNERS["owners"].get(setting, ())
