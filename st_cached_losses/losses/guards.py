"""Two refusals every cached loss shares: a model of another kind than the loss trains, and an assignment of a
setting that only another cached loss has (which would otherwise be kept as a plain attribute and ignored).

Each loss names its model kind (``model_kind``, sentence-transformers' class name); the losses are found as the
subclasses of the root class the caller passes, so this module imports no loss.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

from st_cached_losses.engine.features import unwrap_model
from st_cached_losses.losses.settings import Setting

__all__ = ["check_model_kind", "foreign_setting_owners"]

#: sentence-transformers' model classes, by name, that a cached loss trains
MODEL_CLASSES = ("SentenceTransformer", "SparseEncoder", "MultiVectorEncoder", "CrossEncoder")


def _package_losses(root: type) -> list[type]:
    """Every class of this package below ``root`` (itself included) that names a model kind, depth first."""
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("st_cached_losses.") and getattr(cls, "model_kind", None):
            found.append(cls)
    return sorted(set(found), key=lambda c: c.__name__)


def _public_losses(root: type) -> list[type]:
    """The losses users build: those whose name starts with ``Cached`` and that are not a base class."""
    return [
        c
        for c in _package_losses(root)
        if c.__name__.startswith("Cached") and not c.__name__.endswith("Base")
    ]


def check_model_kind(model: nn.Module, loss: type, root: type, *, strict: bool = False) -> None:
    """Refuse a sentence-transformers model of another kind than ``loss.model_kind`` (a ``CrossEncoder`` for
    an embedding loss, a ``SentenceTransformer`` for the multi-vector loss...), naming the losses for the kind
    it is. A module of none of these kinds (a user's own) is left to the loss, unless ``strict``.

    Args:
        model: the model handed to the loss (wrappers such as DDP are looked through).
        loss: the loss's class.
        root: the base class of every cached loss (where the losses for the other kind are looked up).
        strict: refuse any module that is not a ``loss.model_kind``.

    Raises:
        ValueError: ``"<loss> expects a model of type <kind>, but got a model of type <other>"`` and the
            losses for ``<other>``.
    """
    import sentence_transformers

    needed: str = loss.model_kind  # type: ignore[attr-defined]
    inner = unwrap_model(model)
    found = [kind for kind in MODEL_CLASSES if isinstance(inner, getattr(sentence_transformers, kind))]
    if needed in found or (not found and not strict):
        return
    message = (
        f"{loss.__name__} expects a model of type {needed}, but got a model of type {type(inner).__name__}."
    )
    if found:
        others = [c.__name__ for c in _public_losses(root) if c.model_kind == found[0]]  # type: ignore[attr-defined]
        message += (
            f" {loss.__name__} trains a {needed}; for a {found[0]} use "
            + (", ".join(others) if others else "sentence-transformers' own losses")
            + "."
        )
    raise ValueError(message)


def _settings_of(cls: type) -> set[str]:
    """The public settings of a loss class: its properties and ``Setting`` descriptors, and its constructor's
    parameters (but the model)."""
    names = {
        name
        for name in dir(cls)
        if not name.startswith("_") and isinstance(inspect.getattr_static(cls, name), (Setting, property))
    }
    names.update(inspect.signature(cls.__init__).parameters)  # type: ignore[misc]
    return names - {"self", "model", "citation"}


@functools.cache
def _foreign(cls: type, root: type) -> dict[str, tuple[str, ...]]:
    own = _settings_of(cls) | set(dir(cls))
    owners: dict[str, list[str]] = {}
    for other in _public_losses(root):
        if other is not cls:
            for name in _settings_of(other) - own:
                owners.setdefault(name, []).append(other.__name__)
    return {name: tuple(found) for name, found in owners.items()}


def foreign_setting_owners(obj: Any, name: str, root: type) -> tuple[str, ...]:
    """The cached losses (class names) that have the setting ``name`` when ``obj``'s loss does not (empty when
    it does, or when no cached loss has it: an attribute of the user's own)."""
    if name.startswith("_"):
        return ()
    return _foreign(type(obj), root).get(name, ())  # type: ignore[arg-type]
