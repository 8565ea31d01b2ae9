"""The symmetric (CLIP-style) InfoNCE loss: [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]
with both directions, one cross-entropy each, averaged, by default."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.losses.cached_mnr import CachedMNRLoss
from st_cached_losses.losses.citations import CLIP_CITATION, GRADCACHE_CITATION
from st_cached_losses.losses.ranking import TWO_DIRECTIONS, RankingSettings
from st_cached_losses.losses.settings import redefault

__all__ = ["CLIPSettings", "CachedCLIPLoss"]


@dataclass(frozen=True, kw_only=True)
class CLIPSettings(RankingSettings):
    """[`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss]'s settings: the ranking settings
    with both directions, per direction, by default (its constructor takes no ``in_batch_negatives``)."""

    owner: ClassVar[str] = "CachedCLIPLoss"
    not_arguments: ClassVar[frozenset[str]] = frozenset({"in_batch_negatives"})

    directions: tuple[str, ...] = redefault(RankingSettings, "directions", TWO_DIRECTIONS)
    partition_mode: str = redefault(RankingSettings, "partition_mode", "per_direction")


class CachedCLIPLoss(CachedMNRLoss):
    name = "clip"
    st_names = ("CachedMultipleNegativesSymmetricRankingLoss", "MultipleNegativesSymmetricRankingLoss")
    settings_class = CLIPSettings
    citations = (GRADCACHE_CITATION, CLIP_CITATION)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[str] = TWO_DIRECTIONS,
        partition_mode: str = "per_direction",
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        mask_duplicates: bool = False,
        negative_bank_size: int = 0,
        negative_bank_max_age: int | None = None,
        false_negative_filter: str | None = None,
        false_negative_margin: float | None = None,
        **engine: Any,
    ) -> None:
        """
        Symmetric (CLIP-style) InfoNCE with GradCache: the mean of anchor -> candidates and positive -> anchors,
        optionally with a learnable temperature, exact at any batch size with the memory of one mini-batch.

        Each anchor picks its positive among all positives and hard negatives of the batch, and each positive
        picks its anchor among all anchors; the two cross-entropies are averaged. With ``learnable_scale=True``
        the log of the scale is an ``nn.Parameter`` (``logit_scale``, CLIP's parametrisation) clamped at
        ``max_scale``: the stock ``SentenceTransformerTrainer`` optimises it, saves it in checkpoints and
        restores it on ``resume_from_checkpoint``.

        Args:
            model: the SentenceTransformer to train.
            scale: multiplies the similarities (``1 / temperature``); 20 suits cosine similarity. The initial
                value when learnable (CLIP starts at 1/0.07 = 14.3).
            directions: the similarity terms of each row (default: both directions, the symmetric loss); as
                [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s.
            partition_mode: default ``"per_direction"``: the two cross-entropies averaged.
            gather_across_devices: score each process's anchors against the candidates of every process
                (anchors too, for the positive -> anchors direction).
            learnable_scale: learn the scale (as ``logit_scale = log(scale)``); give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it with checkpoints.
            max_scale: the clamp of a learned scale (CLIP: 100).
            mask_duplicates: as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s; both directions are masked alike: a positive's
                negatives lose the anchors of its row's duplicates.

        Every other argument is [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s, with the same default and meaning;
        its settings are a [`CLIPSettings`][st_cached_losses.losses.cached_clip.CLIPSettings].

        References:
            - Radford et al., Learning Transferable Visual Models From Natural Language Supervision, 2021:
              https://huggingface.co/papers/2103.00020
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Inputs: as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s.

        Relations:
            - Same loss as ``sentence_transformers.sentence_transformer.losses.MultipleNegativesSymmetricRankingLoss`` /
              ``MultipleNegativesRankingLoss(directions=("query_to_doc", "doc_to_query"),
              partition_mode="per_direction")``, cached, with an optional learnable temperature.
            - [`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss] (``symmetric=True``) computes the same loss without a chunk x C block.

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedCLIPLoss, LossStateCallback

            model = SentenceTransformer("all-MiniLM-L6-v2")
            loss = CachedCLIPLoss(model, scale=1 / 0.07, learnable_scale=True, mini_batch_size=32)
            trainer = SentenceTransformerTrainer(
                model=model, train_dataset=train_dataset, loss=loss,
                callbacks=[LossStateCallback(loss)],  # the scale saved / restored with checkpoints
            )
            trainer.train()
            ```
        """
        super().__init__(
            model,
            scale,
            similarity_fct,
            mini_batch_size,
            mini_batch_num_tokens,
            gather_across_devices,
            directions,
            partition_mode,
            show_progress_bar,
            hardness_mode,
            hardness_strength,
            learnable_scale=learnable_scale,
            max_scale=max_scale,
            mask_duplicates=mask_duplicates,
            negative_bank_size=negative_bank_size,
            negative_bank_max_age=negative_bank_max_age,
            false_negative_filter=false_negative_filter,
            false_negative_margin=false_negative_margin,
            **engine,
        )
