"""The previous release's module paths of the losses layer (documented in its API reference) still import,
with a DeprecationWarning, their names that still exist resolving to the new objects, and a removed name's
error saying where to look."""

from __future__ import annotations

import importlib
import sys

import pytest


def _fresh(module: str):
    sys.modules.pop(module, None)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        return importlib.import_module(module)


def test_base_shim_re_exports_the_extension_names():
    from st_cached_losses.losses import base, learnable_scale, settings

    old = _fresh("st_cached_losses.losses._base")
    assert old.StepData is base.StepData and old.StageOutput is base.StageOutput
    assert old.EngineSettings is settings.EngineSettings
    assert old.LearnableScale is learnable_scale.LearnableScale
    assert old.check_columns is base.check_columns
    assert old.CachedInfoNCEBase is base.CachedLoss
    with pytest.raises(AttributeError, match="EngineSettings"):
        old.EngineOptions  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        old.nothing  # noqa: B018


def test_sparse_settings_shim():
    from st_cached_losses.losses import cached_sparse
    from st_cached_losses.losses.stages import sparse

    old = _fresh("st_cached_losses.losses.sparse_settings")
    assert old.on_core is cached_sparse.on_core and old.is_flops is sparse.is_flops
    with pytest.raises(AttributeError, match="SparseSettings"):
        old.SparseLossSettings  # noqa: B018


def test_distillation_shim():
    old = _fresh("st_cached_losses.losses.distillation")
    with pytest.raises(AttributeError, match=r"stages\.Distillation"):
        old.DistillationBase  # noqa: B018
