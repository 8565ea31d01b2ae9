"""Deprecated: the previous release's distillation base class, replaced by the distillation stage
([`st_cached_losses.losses.stages.distill`][st_cached_losses.losses.stages.distill]) that
``CachedDistillKLDivLoss``, ``CachedMarginMSELoss`` and their multi-vector forms build (with an InfoNCE term,
a [`WeightedSum`][st_cached_losses.losses.stages.weighted.WeightedSum] of the two). Importing this module
warns; its names have no counterpart and reading them says where to look."""

from __future__ import annotations

import warnings
from typing import Any

__all__: list[str] = []

warnings.warn(
    "st_cached_losses.losses.distillation is deprecated (removed with the stage redesign): the distillation "
    "losses are in st_cached_losses.losses.cached_distill and cached_multi_vector_distill, their stage in "
    "st_cached_losses.losses.stages.distill.",
    DeprecationWarning,
    stacklevel=2,
)

_GONE = {
    "DistillationBase": "st_cached_losses.losses.stages.Distillation (a stage a CachedLoss builds)",
    "similarity_or_none": "the distillation settings, which refuse an InfoNCE term without a matrix score "
    "when built",
}


def __getattr__(name: str) -> Any:
    if name in _GONE:
        raise AttributeError(
            f"st_cached_losses.losses.distillation.{name} was removed with the stage redesign: use {_GONE[name]}."
        )
    raise AttributeError(f"module 'st_cached_losses.losses.distillation' has no attribute {name!r}")
