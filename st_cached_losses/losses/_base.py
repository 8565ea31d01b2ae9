"""Deprecated: the extension API of the previous release, whose home is now the public
[`st_cached_losses.losses.base`][st_cached_losses.losses.base] (the template ``CachedLoss`` and its ``Stage``)
with [`settings`][st_cached_losses.losses.settings] and
[`learnable_scale`][st_cached_losses.losses.learnable_scale]. This module keeps the names that still exist
importable from here, with a ``DeprecationWarning`` (``CachedInfoNCEBase`` a name of ``CachedLoss``, as in
``st_cached_losses.losses``, whose hooks are not the previous template's); ``EngineOptions`` /
``LossStageOptions`` and ``LossTerms`` have no counterpart: a loss is now a settings class, a stage and a class
(``docs/development.md``), and reading them says so."""

from __future__ import annotations

import warnings
from typing import Any

from st_cached_losses.losses.base import (
    CachedLoss,
    StageOutput,
    StepData,
    check_columns,
    check_splittable_model,
    engine_signature,
)
from st_cached_losses.losses.learnable_scale import LearnableScale
from st_cached_losses.losses.settings import EngineSettings

#: the previous template's name (``st_cached_losses.losses`` keeps it too)
CachedInfoNCEBase = CachedLoss

__all__ = [
    "CachedInfoNCEBase",
    "EngineSettings",
    "LearnableScale",
    "StageOutput",
    "StepData",
    "check_columns",
    "check_splittable_model",
    "engine_signature",
]

warnings.warn(
    "st_cached_losses.losses._base is deprecated: import from st_cached_losses.losses (CachedLoss, Stage, "
    "StepData, StageOutput, EngineSettings, LearnableScale) or st_cached_losses.losses.base.",
    DeprecationWarning,
    stacklevel=2,
)

_GONE = {
    "EngineOptions": "the engine's knobs are fields of st_cached_losses.losses.EngineSettings",
    "LossStageOptions": "the loss stage's knobs are fields of st_cached_losses.losses.LossStageSettings",
    "LossTerms": "an InfoNCE stage's terms (st_cached_losses.losses.stages.InfoNCE's terms)",
}


def __getattr__(name: str) -> Any:
    if name in _GONE:
        raise AttributeError(
            f"st_cached_losses.losses._base.{name} was removed with the stage redesign: use {_GONE[name]}; "
            "docs/development.md walks through adding a loss."
        )
    raise AttributeError(f"module 'st_cached_losses.losses._base' has no attribute {name!r}")
