"""The refusal every cached loss shares at construction: a model of another kind than the loss trains.

Each loss names its model kind (``model_kind``, sentence-transformers' class name); the losses for the other
kinds are read from the registry ([`registry`][st_cached_losses.losses.registry]), so this module imports no
loss. (An assignment of a setting that only another loss has is refused by the template, from the same
registry.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from st_cached_losses.engine.features import unwrap_model
from st_cached_losses.losses import registry

__all__ = ["MODEL_CLASSES", "check_model_kind"]

#: sentence-transformers' model classes, by name, that a cached loss trains
MODEL_CLASSES = ("SentenceTransformer", "SparseEncoder", "MultiVectorEncoder", "CrossEncoder")


def check_model_kind(model: nn.Module, loss: type[Any], *, strict: bool = False) -> None:
    """Refuse a sentence-transformers model of another kind than ``loss.model_kind`` (a ``CrossEncoder`` for
    an embedding loss, a ``SentenceTransformer`` for the multi-vector loss...), naming the losses for the kind
    it is. A module of none of these kinds (a user's own) is left to the loss, unless ``strict``.

    Args:
        model: the model handed to the loss (wrappers such as DDP are looked through).
        loss: the loss's class.
        strict: refuse any module that is not a ``loss.model_kind``.

    Raises:
        ValueError: ``"<loss> expects a model of type <kind>, but got a model of type <other>"`` and the
            losses for ``<other>``.
    """
    import sentence_transformers

    needed: str = loss.model_kind
    inner = unwrap_model(model)
    found = [kind for kind in MODEL_CLASSES if isinstance(inner, getattr(sentence_transformers, kind))]
    if needed in found or (not found and not strict):
        return
    message = (
        f"{loss.__name__} expects a model of type {needed}, but got a model of type {type(inner).__name__}."
    )
    if found:
        others = sorted({c.__name__ for c in registry.losses().values() if c.model_kind == found[0]})
        message += (
            f" {loss.__name__} trains a {needed}; for a {found[0]} use "
            + (", ".join(others) if others else "sentence-transformers' own losses")
            + "."
        )
    raise ValueError(message)
