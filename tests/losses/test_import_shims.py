"""The previous release's module paths of the losses layer (documented in its API reference) still import,
with a DeprecationWarning, their names that still exist resolving to the new objects, and a removed name's
error saying where to look."""

from __future__ import annotations

import importlib
import re
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


#: the names the previous release (0.2.0) documented under st_cached_losses.losses.settings (its __all__, which
#: its API page rendered) that this module no longer defines, each with its new home, or None: not forwarded
PREVIOUS_SETTINGS = {
    "ONE_DIRECTION": "st_cached_losses.losses.ranking.ONE_DIRECTION",
    "TWO_DIRECTIONS": "st_cached_losses.losses.ranking.TWO_DIRECTIONS",
    "VALID_DIRECTIONS": "st_cached_losses.losses.ranking.VALID_DIRECTIONS",
    "VALID_HARDNESS_MODES": "st_cached_losses.losses.ranking.VALID_HARDNESS_MODES",
    "VALID_PARTITION_MODES": "st_cached_losses.losses.ranking.VALID_PARTITION_MODES",
    "ConfigTuple": "st_cached_losses.losses.ranking.ConfigTuple",
    "check_directions": "st_cached_losses.losses.ranking.check_directions",
    "check_hardness": "st_cached_losses.losses.ranking.check_hardness",
    "resolve_similarity": "st_cached_losses.losses.similarity.EMBEDDING.resolve",
    "similarity_name": "st_cached_losses.losses.similarity.EMBEDDING.config_name",
    "FIELD_NAMES": None,
    "NOT_FIELDS": None,
    "SPECS": None,
    "Spec": None,
    "Setting": None,
}


@pytest.mark.parametrize("name", sorted(PREVIOUS_SETTINGS))
def test_the_previous_release_s_settings_names_import_or_say_where_they_went(name):
    """Issue 58: each of these failed with a bare ImportError. A moved name imports from its new home with a
    DeprecationWarning naming it; one whose home is now the configuration layer (which the losses layer does
    not import) or which is gone raises naming its replacement."""
    home = PREVIOUS_SETTINGS[name]
    if home is None:
        with pytest.raises(ImportError, match=rf"settings\.{name} moved out of this module.*: use \S"):
            exec(f"from st_cached_losses.losses.settings import {name}", {})
        return
    module, _, path = home.partition(".losses.")
    target = importlib.import_module(f"{module}.losses.{path.split('.')[0]}")
    for part in path.split(".")[1:]:
        target = getattr(target, part)
    scope: dict = {}
    with pytest.warns(
        DeprecationWarning, match=rf"settings\.{name} is deprecated: import {re.escape(home)} "
    ):
        exec(f"from st_cached_losses.losses.settings import {name}", scope)
    assert scope[name] == target  # the object itself (a bound method: equal, a new bound object each time)
    if not callable(target) or isinstance(target, type):
        assert scope[name] is target


def test_the_forwarded_similarity_helpers_answer_as_before():
    from sentence_transformers.util import cos_sim, dot_score, euclidean_sim

    with pytest.warns(DeprecationWarning):
        from st_cached_losses.losses.settings import resolve_similarity, similarity_name
    assert resolve_similarity(cos_sim) == "cosine" and resolve_similarity("dot") == "dot"
    assert resolve_similarity(euclidean_sim) is euclidean_sim
    assert similarity_name("cosine") == "cos_sim" and similarity_name("dot") == "dot_score"
    assert similarity_name(dot_score) == "dot_score" and similarity_name(euclidean_sim) == "euclidean_sim"


def test_the_settings_module_s_other_names_still_raise_attribute_errors():
    from st_cached_losses.losses import settings

    assert not hasattr(settings, "nothing")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        settings.nothing  # noqa: B018
