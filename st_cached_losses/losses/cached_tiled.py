"""InfoNCE with an Inf-CL-style tiled loss stage: [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]
whose loss stage is always tiled (a ring exchange across processes), with a ``symmetric`` shorthand."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, LossPath
from st_cached_losses.losses.cached_mnr import CachedMNRLoss
from st_cached_losses.losses.citations import CLIP_CITATION, GRADCACHE_CITATION, INFCL_CITATION
from st_cached_losses.losses.ranking import ONE_DIRECTION, TWO_DIRECTIONS, RankingSettings
from st_cached_losses.losses.settings import redefault

__all__ = ["CachedTiledLoss", "TiledSettings"]


@dataclass(frozen=True, kw_only=True)
class TiledSettings(RankingSettings):
    """[`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss]'s settings: the ranking
    settings with the loss stage's ``path`` always ``"tiled"`` (set by the loss; any other value refused)."""

    owner: ClassVar[str] = "CachedTiledLoss"
    not_arguments: ClassVar[frozenset[str]] = frozenset({"path"})
    view_arguments: ClassVar[frozenset[str]] = frozenset({"symmetric"})

    path: LossPath = redefault(RankingSettings, "path", "tiled")

    def validate(self) -> None:
        super().validate()
        if self.path != "tiled":
            raise ValueError(
                f"CachedTiledLoss.path is 'tiled' and cannot be changed (got {self.path!r}): CachedTiledLoss "
                "always computes the Inf-CL-style tiled loss stage; for the chunked one use CachedMNRLoss or "
                "CachedCLIPLoss with path='chunked'."
            )

    def citations(self) -> tuple[str, ...]:
        return ((CLIP_CITATION,) if self.symmetric else ()) + super().citations()


class CachedTiledLoss(CachedMNRLoss):
    name = "tiled"
    settings_class = TiledSettings
    citations = (GRADCACHE_CITATION, INFCL_CITATION)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[str] | None = None,
        partition_mode: str | None = None,
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
        symmetric: bool | None = None,
        tile_size: int | None = None,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        mask_duplicates: bool = False,
        negative_bank_size: int = 0,
        negative_bank_max_age: int | None = None,
        false_negative_filter: str | None = None,
        false_negative_margin: float | None = None,
        in_batch_negatives: bool = True,
        memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
        **engine: Any,
    ) -> None:
        """
        InfoNCE with GradCache and an Inf-CL-style tiled loss stage: no block of the logits larger than one
        ``tile_size x tile_size`` tile is ever held, so the loss stage needs ``O((B + C) d)`` memory whatever
        the batch; across processes the candidate blocks travel around a ring instead of being gathered.

        The log-sum-exp of each row (and, with ``symmetric=True``, of each positive's column) is accumulated
        with a running maximum over tiles in fp32; a second pass recomputes each tile and accumulates the
        gradients. Unlike Inf-CL: hard-negative columns, cosine or dot similarity, any scale (max-subtraction
        everywhere), a correct learnable-scale gradient, pure PyTorch on any device.

        Args:
            model: the SentenceTransformer to train.
            gather_across_devices: score each process's anchors against the candidates of every process, by
                ring exchange (each process holds its own rows and one visiting block).
            directions: the similarity terms of each row (default ``("query_to_doc",)``, or both directions
                with ``symmetric=True``); as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s.
            partition_mode: as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s; default ``"joint"``, or ``"per_direction"`` with
                ``symmetric=True``.
            symmetric: shorthand: True for ``directions=("query_to_doc", "doc_to_query")``,
                ``partition_mode="per_direction"`` (the CLIP loss), False for ``("query_to_doc",)``; None
                (default): as ``directions`` say. Given with ``directions`` / ``partition_mode`` that say
                otherwise (e.g. ``symmetric=True, partition_mode="joint"``), it raises: both directions in
                one softmax are ``directions=("query_to_doc", "doc_to_query"), partition_mode="joint"``.
            tile_size: side of a logit tile (default: from ``memory_budget``, at most 2048).
            memory_budget: bytes of logit tiles the loss stage may hold at once when ``tile_size`` is None.
            mask_duplicates: as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s; with ``symmetric``, a positive's negatives lose the
                anchors of its row's duplicates too, so both directions are masked alike.
            in_batch_negatives: as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s: False scores each anchor against its own
                positive and hard negatives only (one direction); there are no tiles then (``B x K`` logits),
                and across processes nothing travels around the ring.

        Every other argument is [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s, with the same default and meaning (``**engine``:
        the engine's knobs, [`EngineSettings`][st_cached_losses.losses.settings.EngineSettings]); the loss stage's ``path`` is
        always ``"tiled"``. Its settings are a [`TiledSettings`][st_cached_losses.losses.cached_tiled.TiledSettings].

        References:
            - Cheng et al., Breaking the Memory Barrier: Near Infinite Batch Size Scaling for Contrastive Loss,
              2024: https://huggingface.co/papers/2410.17243
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Inputs: as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss]'s.

        Relations:
            - Same loss as [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss] (``symmetric=False``) or [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss]
              (``symmetric=True``); trades ~1.3x loss-stage flops for memory that does not grow with B x C.

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedTiledLoss

            model = SentenceTransformer("all-MiniLM-L6-v2")
            loss = CachedTiledLoss(model, symmetric=True, tile_size=1024, mini_batch_size=32)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        directions, partition_mode = _resolve_symmetric(symmetric, directions, partition_mode)
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
            in_batch_negatives=in_batch_negatives,
            tile_size=tile_size,
            memory_budget=memory_budget,
            **engine,
        )


def _resolve_symmetric(
    symmetric: bool | None, directions: Sequence[str] | None, partition_mode: str | None
) -> tuple[Sequence[str], str]:
    """``directions`` and ``partition_mode`` from the ``symmetric`` shorthand; a contradiction raises,
    however it is spelled."""
    if symmetric is None:
        return ONE_DIRECTION if directions is None else directions, partition_mode or "joint"
    wanted: tuple[tuple[str, ...], str] = (
        (TWO_DIRECTIONS, "per_direction") if symmetric else (ONE_DIRECTION, partition_mode or "joint")
    )
    given_dirs = wanted[0] if directions is None else tuple(directions)
    given_mode = wanted[1] if partition_mode is None else partition_mode
    if set(given_dirs) != set(wanted[0]) or len(given_dirs) != len(wanted[0]) or given_mode != wanted[1]:
        meaning = (
            "directions=('query_to_doc', 'doc_to_query') with partition_mode='per_direction' (the CLIP loss)"
            if symmetric
            else "directions=('query_to_doc',)"
        )
        raise ValueError(
            f"symmetric={symmetric!r} means {meaning}, which contradicts directions={given_dirs!r} with "
            f"partition_mode={given_mode!r}. Pass symmetric or directions / partition_mode, not both"
            + (
                "; both directions in one softmax are directions=('query_to_doc', 'doc_to_query'), "
                "partition_mode='joint'."
                if symmetric
                else "."
            )
        )
    return wanted
