"""A loss registered as docs/development.md's recipe says takes only names that are free (issue 58): a name, an
alias, a class name or a sentence-transformers class name (for the same model kind) that another loss already
has is refused when the class is defined, naming its owner; before, ``aliases=("clip", "mnr")`` was accepted
and ``loss: clip`` / ``loss: mnr`` then built the user's class, and a loss named ``"sigmoid"`` (SigLIP's alias)
was accepted and never built. The same class defined again (a module reloaded) replaces the earlier one."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedSigLIPLoss
from st_cached_losses.config.registry import LOSS_ALIASES, LOSSES, canonical_loss
from st_cached_losses.losses import CachedLoss, registry
from tests.support import two_way_loss

TwoWaySettings = two_way_loss.TwoWaySettings
# the recipe's module registers its loss when imported (at collection, here): the suite's other tests, which
# read every registered loss, must not see it (tests/losses/test_recipe.py registers it for its own tests)
registry.unregister(two_way_loss.CachedTwoWayLoss)


def _init(self: CachedLoss, model: nn.Module, **engine: Any) -> None:
    CachedLoss.__init__(self, model, TwoWaySettings(**engine))


def _define(name: str, **names: Any) -> type[CachedLoss]:
    """A loss class as the recipe writes one (``class CachedUsersLoss(CachedLoss): name = ...``), with
    ``names`` (aliases, st_names) on it: registered when defined, as the recipe says."""
    body = {"name": name, "settings_class": TwoWaySettings, "__init__": _init, **names}
    return type("CachedUsersLoss", (CachedLoss,), body)


@pytest.mark.parametrize(
    ("name", "names", "owner", "what"),
    [
        ("users", {"aliases": ("clip", "mnr")}, CachedCLIPLoss, "alias 'clip'"),
        ("users", {"aliases": ("MNR",)}, CachedMNRLoss, "alias 'mnr'"),
        ("sigmoid", {}, CachedSigLIPLoss, "name 'sigmoid'"),
        ("siglip", {}, CachedSigLIPLoss, "name 'siglip'"),
        ("users", {"aliases": ("CachedCLIPLoss",)}, CachedCLIPLoss, "alias 'cachedcliploss'"),
    ],
    ids=["the-guide-s-aliases", "an-alias-in-capitals", "an-alias-as-name", "a-name", "a-class-name"],
)
def test_a_name_or_alias_another_loss_has_is_refused_naming_its_owner(name, names, owner, what):
    before = dict(LOSS_ALIASES)
    owner_path = f"{owner.__module__}.{owner.__qualname__}"
    with pytest.raises(ValueError, match=rf"loss {what} of .*CachedUsersLoss is taken by {owner_path} "):
        _define(name, **names)
    assert dict(LOSS_ALIASES) == before  # nothing of the refused class was registered
    assert LOSSES[canonical_loss("clip")] is CachedCLIPLoss and LOSSES[canonical_loss("mnr")] is CachedMNRLoss
    assert LOSSES[canonical_loss("sigmoid")] is CachedSigLIPLoss


def test_a_sentence_transformers_name_another_loss_replaces_is_refused():
    with pytest.raises(
        ValueError, match=r"'MultipleNegativesRankingLoss' in st_names .* is taken by .*CachedMNRLoss"
    ):
        _define("users", st_names=("MultipleNegativesRankingLoss",))
    assert canonical_loss("MultipleNegativesRankingLoss", "SentenceTransformer") == "mnr"


def test_free_names_register_and_the_same_class_defined_again_replaces_its_names():
    first = _define("users", aliases=("users-old",))
    try:
        assert LOSSES["users"] is first and canonical_loss("users-old") == "users"
        # the same module and qualified name (a module reloaded, a notebook cell run again): it replaces
        second = _define("users", aliases=("users-new",))
        assert second is not first
        assert LOSSES["users"] is second and canonical_loss("users-new") == "users"
        assert canonical_loss("users-old") is None  # the earlier definition's names went with it
        registry.register(second)  # registering it again changes nothing
        assert LOSSES["users"] is second
    finally:
        registry.unregister(first)
        registry.unregister(second)
    assert "users" not in LOSSES
