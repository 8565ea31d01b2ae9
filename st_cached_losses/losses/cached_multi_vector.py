"""Late-interaction (ColBERT MaxSim, MeanMaxSim, XTR) in-batch negatives ranking loss with GradCache, for a
``MultiVectorEncoder``: the InfoNCE stage over token rows, cached packed
([`TokenRows`][st_cached_losses.engine.cache_form.TokenRows])."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from st_cached_losses.engine.cache_form import TokenRows
from st_cached_losses.engine.features import batch_size_of
from st_cached_losses.engine.lists import ListColumns, check_list_columns
from st_cached_losses.functional.checks import check_positive_int
from st_cached_losses.functional.representations.multi_vector import XTR, MaxSim
from st_cached_losses.functional.softmax.terms import mnrl_terms
from st_cached_losses.losses.base import CachedLoss
from st_cached_losses.losses.citations import GRADCACHE_CITATION, MNRL_CITATION
from st_cached_losses.losses.ranking import ONE_DIRECTION
from st_cached_losses.losses.settings import (
    LossStageSettings,
    ScaleSettings,
    SharedSettings,
    redefault,
    setting,
    view,
)
from st_cached_losses.losses.similarity import TOKENS, SimilarityKind, model_token_score
from st_cached_losses.losses.stages.infonce import InfoNCE

__all__ = ["CachedMultiVectorLoss", "MultiVectorSettings", "TokenScoreLoss", "with_tasks"]


def with_tasks(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each column's task, as sentence-transformers stamps it (a collator's choice kept): queries first, the
    other columns documents."""
    return [{**f, "task": f.get("task", "query" if k == 0 else "document")} for k, f in enumerate(features)]


class TokenScoreLoss(CachedLoss):
    """A multi-vector loss (a ``MultiVectorEncoder``'s token rows, each column's task stamped as
    sentence-transformers stamps it) whose ``similarity_fct=None`` scores as sentence-transformers' default
    ([`model_token_score`][st_cached_losses.losses.similarity.model_token_score]: from 6.3 the model's own
    similarity, MaxSim with 6.2): its stage is built with it and built again at the next call of the loss when the
    model's ``similarity_fn_name`` has changed. An explicit ``similarity_fct`` is used as given."""

    @property
    def similarity(self) -> MaxSim | XTR:
        """The core's token score the loss computes with: ``similarity_fct`` resolved, or where it is None the
        model's own (MaxSim, or MeanMaxSim for a ``"meanmaxsim"`` model)."""
        if self.settings.similarity_fct is None:
            return model_token_score(self.model)
        score: MaxSim | XTR = self.settings.resolved("similarity_fct")
        return score

    def stage_score(self) -> MaxSim | XTR:
        """[`similarity`][st_cached_losses.losses.cached_multi_vector.TokenScoreLoss.similarity], remembered as
        the one the stage being built computes with (``build_stage`` calls this)."""
        score = self.similarity
        self.__dict__["_stage_score"] = score
        return score

    def follow_model_score(self) -> None:
        """Build the stage again if the model's own score, which it follows, has changed since it was built."""
        if self.settings.similarity_fct is None and self.__dict__.get("_stage_score") != self.similarity:
            self.stage = self.build_stage()

    def engine_columns(self, inputs: Any, **call: Any) -> list[Any]:
        self.follow_model_score()
        return with_tasks(list(inputs))


def _score_chunk(mini_batch_size: Any, score_mini_batch_size: int | None) -> int | None:
    """``score_mini_batch_size`` as their config writes it: the chunk in use (default ``mini_batch_size``), or
    None where it follows an ``"auto"`` mini_batch_size (it rebuilds the same; their key takes a count)."""
    score = score_mini_batch_size if score_mini_batch_size is not None else mini_batch_size
    return None if score == "auto" else score


@dataclass(frozen=True, kw_only=True)
class MultiVectorSettings(ScaleSettings, LossStageSettings):
    """[`CachedMultiVectorLoss`][st_cached_losses.losses.cached_multi_vector.CachedMultiVectorLoss]'s settings:
    sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss`` arguments and ours."""

    owner: ClassVar[str] = "CachedMultiVectorLoss"
    #: sentence-transformers' six keys, in their order
    config_keys: ClassVar[tuple[str, ...]] = (
        "scale",
        "similarity_fct",
        "mini_batch_size",
        "mini_batch_num_tokens",
        "score_mini_batch_size",
        "gather_across_devices",
    )

    scale: float = redefault(ScaleSettings, "scale", 1.0)
    #: the kind of ``similarity_fct`` (its check, its config name, the arguments' names)
    similarity_kind: ClassVar[SimilarityKind] = TOKENS

    similarity_fct: Callable[..., Tensor] | str | None = setting(
        None,
        doc="The multi-vector score: None (the default: the model's own, model.similarity as "
        "sentence-transformers 6.3: MaxSim, MeanMaxSim for a 'meanmaxsim' model; MaxSim with 6.2), 'maxsim' (colbert_scores), "
        "'meanmaxsim' (mean_colbert_scores) or 'xtr' (xtr_scores, top_k 256), sentence-transformers' functions "
        "(or a config's string of them), or the core's MaxSim / XTR.",
        check=TOKENS,
        config="always",
    )
    score_mini_batch_size: int | None = setting(
        None,
        doc="sentence-transformers' scoring chunk, kept for their config (default mini_batch_size); the scoring "
        "tiles are sized from memory_budget and never change the result.",
        check=check_positive_int,
        config="always",
        config_form=lambda settings, value: _score_chunk(settings.mini_batch_size, value),
    )
    gather_across_devices: bool = redefault(SharedSettings, "gather_across_devices", False)

    @view
    def similarity(self) -> MaxSim | XTR:
        """The core's tile score: [`MaxSim`][st_cached_losses.functional.representations.multi_vector.MaxSim] or ``XTR``
        (MaxSim for None; the loss's ``similarity`` is the model's own then)."""
        return self.resolved("similarity_fct")


def _list_refusal(owner: str, several: bool, across: bool) -> str | None:
    """Lists of hard negatives are taken on one process and across processes (each process's token rows
    gathered, or passed around the ring, at their own lengths and widths); several positives are refused with
    the columns (``check_lists``), before any forward."""
    return None


class CachedMultiVectorLoss(TokenScoreLoss):
    name = "multi_vector"
    aliases = ("multi-vector", "multivector")
    st_names = ("CachedMultiVectorMultipleNegativesRankingLoss", "MultiVectorMultipleNegativesRankingLoss")
    settings_class = MultiVectorSettings
    citations = (GRADCACHE_CITATION, MNRL_CITATION)
    equivalent_st_loss = "CachedMultiVectorMultipleNegativesRankingLoss"
    model_kind = "MultiVectorEncoder"

    def __init__(
        self,
        model: nn.Module,
        *,
        scale: float = 1.0,
        similarity_fct: Callable[..., Tensor] | str | None = None,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        score_mini_batch_size: int | None = None,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Any,
    ) -> None:
        """
        Late-interaction (ColBERT MaxSim) in-batch negatives ranking loss with GradCache, for a
        ``MultiVectorEncoder``: the gradients of a batch of thousands with the memory of one encoder
        mini-batch and one scoring tile, exactly.

        Each query is scored against its positive document, every hard negative and every other row's
        documents by MaxSim (the sum over the query's tokens of the best document-token similarity), and the
        loss is the cross-entropy of picking the positive, as sentence-transformers'
        ``MultiVectorMultipleNegativesRankingLoss``. The batch is embedded mini-batch by mini-batch without a
        graph (token embeddings and scoring masks cached, each mini-batch trimmed to its longest row); the
        loss and its gradient wrt every token embedding are computed by the package's one InfoNCE core, tile
        by tile over (query rows x document rows): the largest intermediate is one tile's
        ``(rows, documents, q_tokens, d_tokens)`` similarities, sized from ``memory_budget``, never the
        ``(Q, Q*N, q_tokens, d_tokens)`` tensor of sentence-transformers' cached loss. The encoder is then
        replayed with the cached gradients.

        The constructor takes sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``
        arguments (keyword-only, as theirs), then our extras. Every argument is a property, read and
        assigned between steps.

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan, keyword-only
        ([`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]); none changes the result.
        Its settings are a [`MultiVectorSettings`][st_cached_losses.losses.cached_multi_vector.MultiVectorSettings]. Here
        the loss stage's tiles are score tiles (token similarities included), and across processes
        ``path="tiled"`` is the ring exchange (each process holds its own rows and one visiting block, never
        every process's documents), the others gather.

        Args:
            model: the ``MultiVectorEncoder`` to train (column 0 embedded as ``task="query"``, the others as
                ``"document"``, unless the collator set a column's task).
            scale: multiplies the scores (``1 / temperature``); 1.0 as sentence-transformers (MaxSim is a sum
                over query tokens); with MeanMaxSim about the average query length.
            similarity_fct: ``None``: the model's own score (``model.similarity``, as sentence-transformers 6.3:
                MaxSim, MeanMaxSim where ``model.similarity_fn_name`` is ``"meanmaxsim"``; with 6.2 installed,
                MaxSim, its default); ``colbert_scores`` (MaxSim), ``mean_colbert_scores`` (MeanMaxSim) or
                ``xtr_scores`` / ``XTRScores(top_k)`` (XTR), from
                ``sentence_transformers.multi_vector_encoder.scoring``; or ``"maxsim"`` / ``"meanmaxsim"`` /
                ``"xtr"``. XTR's top-k runs over every in-batch document token (every process's with
                ``gather_across_devices``, as theirs): a first streaming pass over the same tiles keeps each
                query token's running top-``k`` tokens, then the scoring pass scores tile by tile with them.
                Exactly ``top_k`` tokens per query token, as ``torch.topk``; among tokens tied at the
                ``top_k``-th similarity (a document repeated in the batch), those first in
                sentence-transformers' flat ``documents x tokens`` order. (``torch.topk`` on the CPU picks
                tied elements in an order of its selection algorithm, not of their index: with a hard
                negative shared by every row, it agreed with this rule in only 5 of 49 (batch, top_k) cases
                with a tie, and there the loss and gradients differ from theirs, by up to 0.8% in the loss in
                an audit. Without exact ties the retrieval is theirs.)
            mini_batch_size: rows per encoder forward; sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead of
                ``mini_batch_size``, as sentence-transformers; a query's ColBERT expansion positions count
                as real tokens (the encoder runs over them and the loss scores them).
            score_mini_batch_size: kept for sentence-transformers' signature and config (default:
                ``mini_batch_size``); the scoring tiles are sized from ``memory_budget`` (or ``tile_size``)
                instead, and never change the result.
            gather_across_devices: score each process's queries against every process's documents,
                gathered, or by ring exchange with ``path="tiled"``. Token rows are padded to the widest of
                every process first (processes may hold different numbers of rows and tokens); XTR's top-k
                runs over every process's document tokens either way (under the ring, by a first pass of
                the document blocks around it).
            show_progress_bar: tqdm bars over the mini-batches of both passes.

        References:
            - Khattab and Zaharia, ColBERT: Efficient and Effective Passage Search via Contextualized Late
              Interaction over BERT, 2020: https://huggingface.co/papers/2004.12832
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (query, positive) pairs or (query, positive, negative_1, ..., negative_n) tuples.
            2. A ``MultiVectorEncoder`` (outputs ``token_embeddings`` and a scoring ``attention_mask``).

        Inputs:
            | Texts | Labels |
            |---|---|
            | (query, positive) pairs | none |
            | (query, positive, negative_1, ..., negative_n) | none |

        Relations:
            - Same loss and gradients as ``MultiVectorMultipleNegativesRankingLoss`` and
              ``CachedMultiVectorMultipleNegativesRankingLoss`` (sentence-transformers) with MaxSim,
              MeanMaxSim or XTR scoring.

        Example:
            ```python
            from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
            from st_cached_losses import CachedMultiVectorLoss

            model = MultiVectorEncoder("answerdotai/ModernBERT-base")
            loss = CachedMultiVectorLoss(model, mini_batch_size=8)
            trainer = MultiVectorEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            MultiVectorSettings(
                scale=scale,
                similarity_fct=similarity_fct,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                score_mini_batch_size=score_mini_batch_size,
                gather_across_devices=gather_across_devices,
                show_progress_bar=show_progress_bar,
                **engine,
            ),
        )

    @property
    def score_mini_batch_size(self) -> int | str:
        """sentence-transformers' scoring chunk (default ``mini_batch_size``); config only: the tiles are sized
        from ``memory_budget`` / ``tile_size``."""
        s = self.settings
        return s.score_mini_batch_size if s.score_mini_batch_size is not None else s.mini_batch_size

    @score_mini_batch_size.setter
    def score_mini_batch_size(self, value: int | None) -> None:
        self.update_settings(score_mini_batch_size=value)

    def check_lists(self, features: list[Any], lists: ListColumns) -> None:
        """Lists of hard negatives (each row its own number, empty allowed), every one a candidate of every
        query, as ``CachedMNRLoss`` takes them, on one process and across processes (gathered, or on the ring);
        one positive per row."""
        owner = type(self).__name__
        check_list_columns(
            [batch_size_of(f) for f in features],
            lists,
            owner,
            one_positive="Give one positive per row (lists of hard negatives are taken), or CachedMNRLoss for "
            "several positives of dense embeddings.",
        )
        if isinstance(self.similarity, XTR):
            raise ValueError(
                f"{owner}: XTR's scores retrieve each query's top tokens over a block of every row's columns, which "
                "lists (each row its own number) do not make: use MaxSim or MeanMaxSim with lists of hard "
                "negatives, or give columns of one text per row to XTR."
            )

    def build_stage(self) -> InfoNCE:
        s = self.settings

        terms = functools.partial(mnrl_terms, ONE_DIRECTION, "joint", None, 0.0)
        return InfoNCE(
            owner=type(self).__name__,
            terms=terms,
            similarity=self.stage_score(),
            scale=s.scale,
            plan=s.plan(),
            gather=s.gather_across_devices,
            form=TokenRows(),
            refuse_lists=functools.partial(_list_refusal, type(self).__name__),
        )
