"""docs/development.md's recipe for adding a loss, followed: a loss written from its steps 1 to 4 (a
signature with ``**engine``, a Setting, ``_loss_terms``, the config) equals the loss it restates,
``CachedCLIPLoss``, in value and gradients, and takes the engine's knobs without restating them."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn
from typing_extensions import Unpack

from st_cached_losses import CachedCLIPLoss
from st_cached_losses.functional.terms import mnrl_terms
from st_cached_losses.losses._base import CachedInfoNCEBase, LossStageOptions, LossTerms, StepData
from st_cached_losses.losses.settings import TWO_DIRECTIONS, Setting, check_bool
from tests.support.tiny_model import make_tiny_model


class CachedTwoWayLoss(CachedInfoNCEBase):
    """Both directions, one cross-entropy each, averaged: the recipe's example."""

    gather_across_devices = Setting[bool]()
    joint = Setting[bool](check=check_bool)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        mini_batch_size: int | str = 32,
        *,
        joint: bool = False,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        super().__init__(
            model,
            scale=scale,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=None,
            show_progress_bar=False,
            **engine,
        )
        self.gather_across_devices = False
        self.joint = joint

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        mode = "joint" if self.joint else "per_direction"
        return LossTerms(mnrl_terms(TWO_DIRECTIONS, mode, None, 0.0, n_columns), "cosine")

    def get_config_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "joint": self.joint, **self._changed_settings()}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("recipe") / "bert")


@pytest.mark.parametrize("joint", [False, True])
def test_a_loss_from_the_recipe_equals_the_loss_it_restates(model, joint):
    ours = CachedTwoWayLoss(model, 7.0, tile_size=3, keep_params_unsharded=True, joint=joint)
    clip = CachedCLIPLoss(model, 7.0, partition_mode="joint" if joint else "per_direction", tile_size=3)
    assert ours.keep_params_unsharded and ours.cache.keep_params_unsharded and ours.tile_size == 3
    params = inspect.signature(CachedTwoWayLoss.__init__).parameters
    assert params["memory_budget"].kind is inspect.Parameter.KEYWORD_ONLY
    torch.manual_seed(0)
    columns = [torch.randn(5, 8, dtype=torch.float64) for _ in range(3)]
    got_leaves = [c.clone().requires_grad_() for c in columns]
    want_leaves = [c.clone().requires_grad_() for c in columns]
    got = ours.calculate_loss([[c] for c in got_leaves])
    want = clip.calculate_loss([[c] for c in want_leaves])
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for g, w in zip(got_leaves, want_leaves):
        assert w.grad is not None and w.grad.abs().sum() > 0
        torch.testing.assert_close(g.grad, w.grad)
    assert ours.get_config_dict() == {"scale": 7.0, "joint": joint, "tile_size": 3}
    with pytest.raises(TypeError, match="unexpected keyword argument 'tile_sise'"):
        CachedTwoWayLoss(model, tile_sise=3)
