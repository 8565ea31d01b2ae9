"""Deprecated: the previous release's sparse settings module. The sparse loss's settings are now one frozen
object, [`SparseSettings`][st_cached_losses.losses.cached_sparse.SparseSettings], and its stage
[`Splade`][st_cached_losses.losses.stages.sparse.Splade]; ``is_flops`` and ``on_core`` are importable from
here still, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from typing import Any

from st_cached_losses.losses.cached_sparse import on_core
from st_cached_losses.losses.stages.sparse import is_flops

__all__ = ["is_flops", "on_core"]

warnings.warn(
    "st_cached_losses.losses.sparse_settings is deprecated: the sparse loss's settings are "
    "st_cached_losses.losses.cached_sparse.SparseSettings (on_core there too), is_flops is in "
    "st_cached_losses.losses.stages.sparse.",
    DeprecationWarning,
    stacklevel=2,
)

_GONE = {
    "SparseLossSettings": "st_cached_losses.losses.cached_sparse.SparseSettings (the settings of CachedSparseLoss)",
    "weight_value": "the regularisers' weights, fields of SparseSettings",
}


def __getattr__(name: str) -> Any:
    if name in _GONE:
        raise AttributeError(
            f"st_cached_losses.losses.sparse_settings.{name} was removed with the stage redesign: use "
            f"{_GONE[name]}."
        )
    raise AttributeError(f"module 'st_cached_losses.losses.sparse_settings' has no attribute {name!r}")
