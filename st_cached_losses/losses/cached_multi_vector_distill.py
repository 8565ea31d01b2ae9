"""Distillation from a teacher's scores with GradCache, for a ``MultiVectorEncoder`` (late interaction:
MaxSim, MeanMaxSim, XTR): sentence-transformers' ``MultiVectorDistillKLDivLoss`` and
``MultiVectorMarginMSELoss`` with the memory of one encoder mini-batch (the
[`Distillation`][st_cached_losses.losses.stages.distill.Distillation] stage over token rows), optionally plus an
in-batch InfoNCE term."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from st_cached_losses.engine.cache_form import TokenRows
from st_cached_losses.engine.checks import check_mini_batch_size
from st_cached_losses.functional.distill.scores import DistillObjective
from st_cached_losses.functional.representations.multi_vector import XTR, MaxSim
from st_cached_losses.losses.base import Stage
from st_cached_losses.losses.cached_distill import (
    DistillSettings,
    KLTemperatureAttributes,
    KLTemperatures,
    distillation_stage,
)
from st_cached_losses.losses.cached_multi_vector import TokenScoreLoss
from st_cached_losses.losses.citations import DISTILL_KL_CITATION, GRADCACHE_CITATION, MARGIN_MSE_CITATION
from st_cached_losses.losses.settings import EngineSettings, redefault, setting
from st_cached_losses.losses.similarity import PAIRWISE_TOKENS_KL, PAIRWISE_TOKENS_MARGIN, PairwiseTokens
from st_cached_losses.losses.stages.distill import Distillation, Prepared, as_cached

#: the encoder's rows per mini-batch where ``mini_batch_size`` is None (sentence-transformers' default, which
#: embeds the whole batch at once)
DEFAULT_MINI_BATCH_SIZE = 32

__all__ = [
    "CachedMultiVectorDistillKLDivLoss",
    "CachedMultiVectorMarginMSELoss",
    "MultiVectorDistillKLDivSettings",
    "MultiVectorMarginMSESettings",
    "XTRPrepared",
]


def _without_mask_grad(grad: Tensor, like: Tensor) -> Tensor:
    """A packed row's gradient in the cached rows' dtype, 0 in the mask channel."""
    grad = grad.to(like.dtype)
    grad[..., -1] = 0
    return grad


@dataclass(frozen=True)
class XTRPrepared:
    """XTR's retrieval before the pairwise scores (a distillation stage's ``prepared``): for the KL loss
    (``xtr_kd_scores``) each query token's top-k over every document of the batch; for the margin loss
    (``xtr_scores_pairwise``, called per column) over that column's documents."""

    score: XTR
    objective: DistillObjective
    budget: int

    def __call__(self, embeddings: list[Tensor]) -> Prepared:
        score, queries, columns = self.score, embeddings[0], embeddings[1:]
        if self.objective == "kl":
            pools = [score.with_column_data(columns)]  # query-major ids over every document
        else:
            pools = [score.with_column_data([c]) for c in columns]
        cols = [c for pool in pools for c in pool]
        rows = [score.with_row_data(queries, pool, self.budget) for pool in pools]

        def back(grad_rows: list[Tensor], grad_cols: list[Tensor]) -> list[Tensor]:
            grad_q = sum(score.without_row_data(g) for g in grad_rows)
            assert isinstance(grad_q, Tensor)
            return [
                _without_mask_grad(grad_q, queries),
                *[_without_mask_grad(g, c) for g, c in zip(grad_cols, columns)],
            ]

        return rows, cols, back


def _mini_batch_size(name: str, value: Any) -> Any:
    if value is not None:
        check_mini_batch_size(value)
    return value


@dataclass(frozen=True, kw_only=True)
class _MultiVectorDistill(DistillSettings):
    """The multi-vector distillation losses' settings: sentence-transformers' ``mini_batch_size`` of None (the
    whole batch at once: ours runs mini-batches of 32), the InfoNCE term's scale 1 (MaxSim sums over tokens)."""

    mini_batch_size: int | str | None = setting(  # type: ignore[assignment]  # theirs: None, the whole batch
        None,
        doc=EngineSettings.declaration("mini_batch_size").metadata["doc"]
        + " None (theirs: the whole batch at "
        "once): 32 rows.",
        check=_mini_batch_size,
        config="always",
    )
    infonce_scale: float = redefault(DistillSettings, "infonce_scale", 1.0)
    similarity_fct: Callable[..., Tensor] | str | None = setting(
        None,
        doc="The multi-vector distillation score: None (the default: the model's own, model.similarity_pairwise "
        "as sentence-transformers 6.3: MaxSim, MeanMaxSim for a 'meanmaxsim' model; MaxSim with 6.2), 'maxsim', "
        "'meanmaxsim' or "
        "'xtr', sentence-transformers' "
        "functions of the loss (colbert_kd_scores... for the KL loss, colbert_scores_pairwise... for the margin "
        "loss), or the core's MaxSim / XTR.",
        config="always",
        config_form=lambda settings, value: settings.similarity_kind.config_name(value),
    )

    #: the kind of ``similarity_fct`` (the KL loss's or the margin loss's scores)
    similarity_kind: ClassVar[PairwiseTokens]

    @property
    def score(self) -> MaxSim | XTR:
        """The core's token score of the distillation term (and of the InfoNCE term)."""
        return self.resolved("similarity_fct")

    def infonce_similarity(self) -> Any:
        return self.score

    def engine(self) -> dict[str, Any]:
        engine = super().engine()
        if engine["mini_batch_size"] is None:
            engine["mini_batch_size"] = DEFAULT_MINI_BATCH_SIZE
        return engine

    def validate(self) -> None:
        # the similarity resolved once (its kind is the class's: the KL loss's scores or the margin loss's)
        self.__dict__["_resolved_similarity_fct"] = self.similarity_kind.resolve(self.similarity_fct)
        super().validate()


@dataclass(frozen=True, kw_only=True)
class MultiVectorDistillKLDivSettings(_MultiVectorDistill, KLTemperatures):
    """[`CachedMultiVectorDistillKLDivLoss`][st_cached_losses.losses.cached_multi_vector_distill.CachedMultiVectorDistillKLDivLoss]'s settings."""

    owner: ClassVar[str] = "CachedMultiVectorDistillKLDivLoss"
    similarity_kind: ClassVar[PairwiseTokens] = PAIRWISE_TOKENS_KL
    #: sentence-transformers' keys (the temperatures that differ from ``temperature`` follow it)
    config_keys: ClassVar[tuple[str, ...]] = ("similarity_fct", "temperature", "mini_batch_size")


@dataclass(frozen=True, kw_only=True)
class MultiVectorMarginMSESettings(_MultiVectorDistill):
    """[`CachedMultiVectorMarginMSELoss`][st_cached_losses.losses.cached_multi_vector_distill.CachedMultiVectorMarginMSELoss]'s settings."""

    owner: ClassVar[str] = "CachedMultiVectorMarginMSELoss"
    similarity_kind: ClassVar[PairwiseTokens] = PAIRWISE_TOKENS_MARGIN
    #: sentence-transformers' two keys
    config_keys: ClassVar[tuple[str, ...]] = ("similarity_fct", "mini_batch_size")


def _stage(loss: TokenScoreLoss, objective: DistillObjective) -> Stage:
    s = loss.settings
    score = loss.stage_score()
    student, teacher = s.temperatures() if objective == "kl" else (1.0, 1.0)
    distill = Distillation(
        owner=type(loss).__name__,
        objective=objective,
        pairwise=score.pairwise,
        student_temperature=student,
        teacher_temperature=teacher,
        plan=s.plan(),
        gather=s.gather_across_devices,
        prepared=XTRPrepared(score, objective, s.memory_budget) if isinstance(score, XTR) else as_cached,
        token_rows=True,
        form=TokenRows(),
    )
    return distillation_stage(distill, s, form=distill.form, similarity=score)


class CachedMultiVectorDistillKLDivLoss(KLTemperatureAttributes, TokenScoreLoss):
    name = "multi_vector_distill_kl"
    aliases = ("multi-vector-distill-kl",)
    st_names = ("MultiVectorDistillKLDivLoss",)
    settings_class = MultiVectorDistillKLDivSettings
    distillation = True
    citations = (GRADCACHE_CITATION, DISTILL_KL_CITATION)
    equivalent_st_loss = "MultiVectorDistillKLDivLoss"
    model_kind = "MultiVectorEncoder"

    def __init__(
        self,
        model: nn.Module,
        *,
        similarity_fct: Callable[..., Tensor] | str | None = None,
        temperature: float = 1.0,
        student_temperature: float | None = None,
        teacher_temperature: float | None = None,
        mini_batch_size: int | str | None = None,
        mini_batch_num_tokens: int | str | None = None,
        infonce_weight: float = 0.0,
        infonce_scale: float = 1.0,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Any,
    ) -> None:
        """
        sentence-transformers' ``MultiVectorDistillKLDivLoss`` with GradCache: the KL divergence of the
        student's softmax over each query's candidate documents (MaxSim, MeanMaxSim or XTR scores) from
        the teacher's, the teacher's scores as the labels, with the memory of one encoder mini-batch
        whatever the batch and the number of documents per query (PyLate trains with 32 and more);
        optionally plus a weighted in-batch InfoNCE term over the whole batch.

        The batch is embedded mini-batch by mini-batch without a graph (token embeddings and scoring masks
        cached, packed); the loss and its gradient wrt every token embedding are computed in row chunks
        (one chunk's ``(rows, q_tokens, d_tokens)`` similarities per column, sized from ``memory_budget``);
        the encoder is then replayed with the cached gradients. The same loss and gradients as
        ``MultiVectorDistillKLDivLoss``.

        The constructor takes ``MultiVectorDistillKLDivLoss``'s arguments (keyword-only, as theirs), then
        ours, then the engine's knobs and the loss stage's plan
        ([`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result).
        Its settings are a [`MultiVectorDistillKLDivSettings`][st_cached_losses.losses.cached_multi_vector_distill.MultiVectorDistillKLDivSettings];
        ``temperature`` is the KL's, the InfoNCE term's scale ``infonce_scale``.

        Args:
            model: the ``MultiVectorEncoder`` to train (column 0 embedded as ``task="query"``, the others as
                ``"document"``, unless the collator set a column's task).
            similarity_fct: ``None``: the model's own score (``model.similarity_pairwise``, as
                sentence-transformers 6.3: MaxSim, MeanMaxSim where ``model.similarity_fn_name`` is
                ``"meanmaxsim"``; with 6.2 installed, MaxSim, its default); ``colbert_kd_scores`` (MaxSim), ``mean_colbert_kd_scores`` (MeanMaxSim)
                or ``xtr_kd_scores`` / ``XTRKDScores(top_k)`` (XTR: each query token's top-k over every
                document token of the batch, as theirs), from
                ``sentence_transformers.multi_vector_encoder.scoring``; or ``"maxsim"`` / ``"meanmaxsim"`` /
                ``"xtr"``.
            temperature: the temperature of both softmaxes, unless one is given below; the loss is
                multiplied by ``student_temperature**2``.
            student_temperature: the student's softmax temperature (default ``temperature``).
            teacher_temperature: the teacher's softmax temperature (default ``temperature``).
            mini_batch_size: rows per encoder forward (or ``"auto"``); theirs embeds the documents in
                chunks of it with their graphs, ours without (and replays them); sets the memory, not
                the result. None (theirs: the whole batch at once): 32.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            infonce_weight: the weight of an in-batch InfoNCE term: each query against every document of
                every row, by the same score (the first document column is the positive); 0 (the
                default): the distillation loss alone.
            infonce_scale: the InfoNCE term's scale (1.0: MaxSim is a sum over query tokens).
            gather_across_devices: the InfoNCE term scores each process's queries against every process's
                documents (gathered, or by ring exchange with ``path="tiled"``); the distillation term is
                each row's own.
            show_progress_bar: tqdm bars over the mini-batches.

        References:
            - Santhanam et al., ColBERTv2: Effective and Efficient Retrieval via Lightweight Late
              Interaction, 2021: https://huggingface.co/papers/2112.01488
            - Lin et al., Distilling Dense Representations for Ranking using Tightly-Coupled Teachers,
              2020: https://huggingface.co/papers/2010.11386
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (query, document_1, ..., document_N) tuples, N >= 2.
            2. The teacher's score of each document, ``(batch_size, N)``, as the labels.

        Inputs:
            | Texts | Labels |
            |---|---|
            | (query, document_1, ..., document_N) | teacher scores ``[s_1, ..., s_N]`` |

        Relations:
            - The same loss and gradients as ``MultiVectorDistillKLDivLoss`` (sentence-transformers) with
              the same arguments (and ``infonce_weight=0``).

        Example:
            ```python
            from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
            from st_cached_losses import CachedMultiVectorDistillKLDivLoss

            model = MultiVectorEncoder("answerdotai/ModernBERT-base")
            loss = CachedMultiVectorDistillKLDivLoss(model, mini_batch_size=16)
            trainer = MultiVectorEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            MultiVectorDistillKLDivSettings(
                similarity_fct=similarity_fct,
                temperature=temperature,
                student_temperature=student_temperature,
                teacher_temperature=teacher_temperature,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                infonce_weight=infonce_weight,
                infonce_scale=infonce_scale,
                gather_across_devices=gather_across_devices,
                show_progress_bar=show_progress_bar,
                **engine,
            ),
        )

    @property
    def score(self) -> MaxSim | XTR:
        """The core's token score of the distillation term (and of the InfoNCE term): ``similarity_fct``
        resolved, or where it is None the model's own (MaxSim, or MeanMaxSim for a ``"meanmaxsim"`` model)."""
        return self.similarity

    def build_stage(self) -> Stage:
        return _stage(self, "kl")


class CachedMultiVectorMarginMSELoss(TokenScoreLoss):
    name = "multi_vector_margin_mse"
    aliases = ("multi-vector-margin-mse",)
    st_names = ("MultiVectorMarginMSELoss",)
    settings_class = MultiVectorMarginMSESettings
    distillation = True
    citations = (GRADCACHE_CITATION, MARGIN_MSE_CITATION)
    equivalent_st_loss = "MultiVectorMarginMSELoss"
    model_kind = "MultiVectorEncoder"

    def __init__(
        self,
        model: nn.Module,
        *,
        similarity_fct: Callable[..., Tensor] | str | None = None,
        mini_batch_size: int | str | None = None,
        mini_batch_num_tokens: int | str | None = None,
        infonce_weight: float = 0.0,
        infonce_scale: float = 1.0,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Any,
    ) -> None:
        """
        sentence-transformers' ``MultiVectorMarginMSELoss`` with GradCache: the mean squared error between
        the student's margins ``s(q, pos) - s(q, neg_j)`` (MaxSim, MeanMaxSim or XTR) and the teacher's,
        with the memory of one encoder mini-batch; optionally plus a weighted in-batch InfoNCE term.

        Embedded, scored and replayed as
        [`CachedMultiVectorDistillKLDivLoss`][st_cached_losses.losses.cached_multi_vector_distill.CachedMultiVectorDistillKLDivLoss];
        the same loss and gradients as ``MultiVectorMarginMSELoss``. Its settings are a
        [`MultiVectorMarginMSESettings`][st_cached_losses.losses.cached_multi_vector_distill.MultiVectorMarginMSESettings].

        Args:
            model: the ``MultiVectorEncoder`` to train.
            similarity_fct: ``None``: the model's own score (``model.similarity_pairwise``, as
                sentence-transformers 6.3: MaxSim, MeanMaxSim where ``model.similarity_fn_name`` is
                ``"meanmaxsim"``; with 6.2 installed, MaxSim, its default); ``colbert_scores_pairwise`` (MaxSim), ``mean_colbert_scores_pairwise``
                (MeanMaxSim) or ``xtr_scores_pairwise`` (XTR: the top-k over each column's documents, as
                theirs scores each column apart); or ``"maxsim"`` / ``"meanmaxsim"``.
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
                None (theirs: the whole batch at once): 32.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            infonce_weight: the weight of an in-batch InfoNCE term (see
                [`CachedMultiVectorDistillKLDivLoss`][st_cached_losses.losses.cached_multi_vector_distill.CachedMultiVectorDistillKLDivLoss]);
                0 (the default): the margin loss alone.
            infonce_scale: the InfoNCE term's scale.
            gather_across_devices: the InfoNCE term across every process's documents.
            show_progress_bar: tqdm bars over the mini-batches.

        References:
            - Hofstätter et al., Improving Efficient Neural Ranking Models with Cross-Architecture Knowledge
              Distillation, 2020: https://huggingface.co/papers/2010.02666
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (query, positive, negative_1, ..., negative_n) tuples, n >= 1.
            2. The teacher's scores or margins as the labels.

        Inputs:
            | Texts | Labels |
            |---|---|
            | (query, positive, negative) | ``s_pos - s_neg`` (one margin) |
            | (query, positive, negative_1, ..., negative_n) | margins ``[s_pos - s_neg_1, ...]``, or scores ``[s_pos, s_neg_1, ..., s_neg_n]`` |

        Relations:
            - The same loss and gradients as ``MultiVectorMarginMSELoss`` (sentence-transformers) with the
              same ``similarity_fct`` (and ``infonce_weight=0``).

        Example:
            ```python
            from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
            from st_cached_losses import CachedMultiVectorMarginMSELoss

            model = MultiVectorEncoder("answerdotai/ModernBERT-base")
            loss = CachedMultiVectorMarginMSELoss(model, mini_batch_size=16)
            trainer = MultiVectorEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            MultiVectorMarginMSESettings(
                similarity_fct=similarity_fct,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                infonce_weight=infonce_weight,
                infonce_scale=infonce_scale,
                gather_across_devices=gather_across_devices,
                show_progress_bar=show_progress_bar,
                **engine,
            ),
        )

    @property
    def score(self) -> MaxSim | XTR:
        """The core's token score of the distillation term (and of the InfoNCE term): ``similarity_fct``
        resolved, or where it is None the model's own (MaxSim, or MeanMaxSim for a ``"meanmaxsim"`` model)."""
        return self.similarity

    def build_stage(self) -> Stage:
        return _stage(self, "margin_mse")
