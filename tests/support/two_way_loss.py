"""docs/development.md's recipe, followed literally, in a module outside the package: ``CachedTwoWayLoss``,
both directions of InfoNCE (one cross-entropy each, averaged; or one softmax with ``partition_mode='joint'``),
which is ``CachedCLIPLoss`` written from the recipe. Importing this module registers it as ``loss: two_way``
(tests/losses/test_recipe.py imports it in a process of its own, or unregisters it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from st_cached_losses.functional.softmax.terms import TermSet, mnrl_terms
from st_cached_losses.losses import CachedLoss
from st_cached_losses.losses.citations import CLIP_CITATION, GRADCACHE_CITATION
from st_cached_losses.losses.ranking import TWO_DIRECTIONS, RankingSettings, check_directions
from st_cached_losses.losses.settings import LossStageSettings, ScaleSettings, redefault
from st_cached_losses.losses.stages import InfoNCE


@dataclass(frozen=True, kw_only=True)
class TwoWaySettings(ScaleSettings, LossStageSettings):
    """``CachedTwoWayLoss``'s settings: a scale, the engine's knobs and the loss stage's plan (the groups'),
    and ``partition_mode`` (the ranking losses' declaration, another default)."""

    owner: ClassVar[str] = "CachedTwoWayLoss"

    partition_mode: str = redefault(RankingSettings, "partition_mode", "per_direction")

    def validate(self) -> None:
        super().validate()
        check_directions(TWO_DIRECTIONS, self.partition_mode, self.owner)


class CachedTwoWayLoss(CachedLoss):
    name = "two_way"
    aliases = ("two-way",)
    settings_class = TwoWaySettings
    citations = (GRADCACHE_CITATION, CLIP_CITATION)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        partition_mode: str = "per_direction",
        mini_batch_size: int | str = 32,
        **engine: Any,
    ) -> None:
        """Both directions of InfoNCE with GradCache.

        Args:
            model: the SentenceTransformer to train.
            scale: multiplies the cosine similarities (1 / temperature).
            partition_mode: ``"per_direction"`` (one cross-entropy per direction, averaged) or ``"joint"``.
            mini_batch_size: rows per encoder forward.
            engine: the engine's knobs and the loss stage's plan.
        """
        super().__init__(
            model,
            TwoWaySettings(
                scale=scale, partition_mode=partition_mode, mini_batch_size=mini_batch_size, **engine
            ),
        )

    def build_stage(self) -> InfoNCE:
        s = self.settings

        def terms(n_columns: int) -> TermSet:
            return mnrl_terms(TWO_DIRECTIONS, s.partition_mode, None, 0.0, n_columns)

        return InfoNCE(
            owner=type(self).__name__,
            terms=terms,
            similarity="cosine",
            scale=s.scale,
            plan=s.plan(),
        )
