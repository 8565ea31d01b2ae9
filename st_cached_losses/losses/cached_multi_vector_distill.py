"""Distillation from a teacher's scores with GradCache, for a ``MultiVectorEncoder`` (late interaction:
MaxSim, MeanMaxSim, XTR): sentence-transformers' ``MultiVectorDistillKLDivLoss`` and
``MultiVectorMarginMSELoss`` with the memory of one encoder mini-batch, optionally plus an in-batch
InfoNCE term (the family's core: [`DistillationBase`][st_cached_losses.losses.distillation.DistillationBase])."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.functional.distill import DistillObjective
from st_cached_losses.functional.multi_vector import XTR, MaxSim
from st_cached_losses.functional.parallel import pad_to_common_tokens
from st_cached_losses.losses._base import LossStageOptions
from st_cached_losses.losses.citations import DISTILL_KL_CITATION, GRADCACHE_CITATION, MARGIN_MSE_CITATION
from st_cached_losses.losses.distillation import DistillationBase, Prepared
from st_cached_losses.losses.settings import Setting, check_temperature

#: the encoder's rows per mini-batch where ``mini_batch_size`` is None (sentence-transformers' default, which
#: embeds the whole batch at once)
DEFAULT_MINI_BATCH_SIZE = 32

__all__ = [
    "CachedMultiVectorDistillKLDivLoss",
    "CachedMultiVectorMarginMSELoss",
    "resolve_pairwise_token_score",
]


def resolve_pairwise_token_score(similarity_fct: Any, objective: DistillObjective) -> MaxSim | XTR:
    """sentence-transformers' distillation scores as the core's token score: for the KL loss
    ``colbert_kd_scores`` (None), ``mean_colbert_kd_scores`` or ``xtr_kd_scores`` / ``XTRKDScores(top_k)``
    (XTR's top-k over every document of the batch); for the margin loss ``colbert_scores_pairwise`` (None),
    ``mean_colbert_scores_pairwise`` or ``xtr_scores_pairwise`` (XTR's top-k over each column's documents);
    a ``functools.partial`` may bind ``length_normalize`` / ``top_k`` and ``chunk_elements`` (a memory knob the
    chunks make moot); or ``"maxsim"`` / ``"meanmaxsim"`` / ``"xtr"``, or a [`MaxSim`][st_cached_losses.functional.multi_vector.MaxSim] / ``XTR``."""
    if similarity_fct is None:
        return MaxSim()
    if isinstance(similarity_fct, (MaxSim, XTR)):
        return similarity_fct
    if isinstance(similarity_fct, str):
        names: dict[str, MaxSim | XTR] = {"maxsim": MaxSim(), "meanmaxsim": MaxSim(True), "xtr": XTR()}
        if similarity_fct.lower() in names:
            return names[similarity_fct.lower()]
    from sentence_transformers.multi_vector_encoder import scoring

    kd = objective == "kl"
    maxsims = (
        {scoring.colbert_kd_scores: False, scoring.mean_colbert_kd_scores: True}
        if kd
        else {scoring.colbert_scores_pairwise: False, scoring.mean_colbert_scores_pairwise: True}
    )
    xtr_fn = scoring.xtr_kd_scores if kd else scoring.xtr_scores_pairwise
    fn: Any = similarity_fct
    keywords: dict[str, Any] = {}
    if isinstance(fn, functools.partial) and not fn.args:
        fn, keywords = fn.func, dict(fn.keywords)
    if kd and isinstance(fn, scoring.XTRKDScores) and not keywords:
        return XTR(fn.top_k)
    if fn is xtr_fn and not set(keywords) - {"top_k", "chunk_elements"}:
        return XTR(keywords.get("top_k", 256))
    if fn in maxsims and not set(keywords) - {"length_normalize", "chunk_elements"}:
        return MaxSim(bool(keywords.get("length_normalize", maxsims[fn])))
    names_of = ", ".join(f.__name__ for f in [*maxsims, xtr_fn]) + (", XTRKDScores(top_k)" if kd else "")
    raise ValueError(
        f"similarity_fct={similarity_fct!r} is not supported: the cached loss scores row chunks with the core's "
        f"MaxSim / XTR, so it takes sentence_transformers.multi_vector_encoder.scoring's {names_of} (optionally "
        "a functools.partial binding length_normalize / top_k and chunk_elements), 'maxsim', 'meanmaxsim' or "
        "'xtr', or st_cached_losses.functional.multi_vector.MaxSim / XTR."
    )


def _without_mask_grad(grad: Tensor, like: Tensor) -> Tensor:
    """A packed row's gradient in the cached rows' dtype, 0 in the mask channel."""
    grad = grad.to(like.dtype)
    grad[..., -1] = 0
    return grad


class _MultiVectorDistill(DistillationBase):
    """The multi-vector losses' parts: token rows cached packed, scored by MaxSim or XTR."""

    caches_tokens = True  # the engine caches packed token embeddings and masks
    model_kind = "MultiVectorEncoder"

    #: what was given (None: sentence-transformers' default score of the loss)
    similarity_fct = Setting[Any](after=lambda loss, old, new: loss._resolve(new))

    def _resolve(self, value: Any) -> None:
        self._score = resolve_pairwise_token_score(value, self.objective)

    @property
    def score(self) -> MaxSim | XTR:
        """The core's token score of the distillation term (and of the InfoNCE term)."""
        return self._score

    def _pairwise(self) -> Callable[[Tensor, Tensor], Tensor]:
        return self._score.pairwise

    def _infonce_similarity(self, weight: float | None = None) -> MaxSim | XTR:
        return self._score

    def _prepared(self, embeddings: list[Tensor]) -> Prepared:
        score = self._score
        if not isinstance(score, XTR):
            return super()._prepared(embeddings)
        queries, columns = embeddings[0], embeddings[1:]
        budget = self.memory_budget
        if self.objective == "kl":
            # xtr_kd_scores: each query token's top-k over every document of the batch (query-major ids)
            pools = [score.with_column_data(columns)]
        else:
            # xtr_scores_pairwise, called per column: the top-k over that column's documents
            pools = [score.with_column_data([c]) for c in columns]
        cols = [c for pool in pools for c in pool]
        rows = [score.with_row_data(queries, pool, budget) for pool in pools]

        def back(grad_rows: list[Tensor], grad_cols: list[Tensor]) -> list[Tensor]:
            grad_q = sum(score.without_row_data(g) for g in grad_rows)
            assert isinstance(grad_q, Tensor)
            return [
                _without_mask_grad(grad_q, queries),
                *[_without_mask_grad(g, c) for g, c in zip(grad_cols, columns)],
            ]

        return rows, cols, back

    def _gatherable(self, embeddings: list[Tensor]) -> list[Tensor]:
        return pad_to_common_tokens(embeddings)

    def _columns(self, features: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # each column's task, as sentence-transformers stamps it (a collator's choice kept): queries first
        return [
            {**f, "task": f.get("task", "query" if k == 0 else "document")} for k, f in enumerate(features)
        ]

    def _mini_batch_size_config(self) -> int | str | None:
        """As given: None (theirs: the whole batch at once; ours: the default mini-batches) while unchanged."""
        if self._mini_batch_size_given is None and self.mini_batch_size == DEFAULT_MINI_BATCH_SIZE:
            return None
        return self.mini_batch_size

    def _similarity_config(self) -> str:
        from sentence_transformers.multi_vector_encoder import scoring
        from sentence_transformers.util import similarity_fct_name

        fn = self.similarity_fct
        if fn is None:
            fn = scoring.colbert_kd_scores if self.objective == "kl" else scoring.colbert_scores_pairwise
        if isinstance(fn, str):
            return fn
        if isinstance(fn, MaxSim):
            return f"MaxSim(length_normalize={fn.length_normalize})"
        if isinstance(fn, XTR):
            return f"XTR(top_k={fn.top_k})"
        return similarity_fct_name(fn)


class CachedMultiVectorDistillKLDivLoss(_MultiVectorDistill):
    _citations = (GRADCACHE_CITATION, DISTILL_KL_CITATION)
    equivalent_st_loss = "MultiVectorDistillKLDivLoss"
    objective: ClassVar[DistillObjective] = "kl"

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
        **engine: Unpack[LossStageOptions],
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
        ([`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]; none changes the result).

        Args:
            model: the ``MultiVectorEncoder`` to train (column 0 embedded as ``task="query"``, the others as
                ``"document"``, unless the collator set a column's task).
            similarity_fct: ``None`` / ``colbert_kd_scores`` (MaxSim), ``mean_colbert_kd_scores`` (MeanMaxSim)
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
            mini_batch_size=mini_batch_size if mini_batch_size is not None else DEFAULT_MINI_BATCH_SIZE,
            mini_batch_num_tokens=mini_batch_num_tokens,
            infonce_weight=0.0,
            infonce_scale=infonce_scale,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.similarity_fct = similarity_fct
        self._mini_batch_size_given = mini_batch_size
        self.temperature = temperature
        self.student_temperature = student_temperature
        self.teacher_temperature = teacher_temperature
        self.infonce_weight = infonce_weight

    #: the temperature of both softmaxes, unless the student's or the teacher's is given
    temperature = Setting[float](check=check_temperature)
    #: the student's softmax temperature (None: ``temperature``)
    student_temperature = Setting[float](check=check_temperature, none_reads_as="temperature")
    #: the teacher's softmax temperature (None: ``temperature``)
    teacher_temperature = Setting[float](check=check_temperature, none_reads_as="temperature")

    def _temperatures(self) -> tuple[float, float]:
        return self.student_temperature, self.teacher_temperature

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' keys, then our extras in use."""
        config: dict[str, Any] = {
            "similarity_fct": self._similarity_config(),
            "temperature": self.temperature,
        }
        if self.student_temperature != self.temperature:
            config["student_temperature"] = self.student_temperature
        if self.teacher_temperature != self.temperature:
            config["teacher_temperature"] = self.teacher_temperature
        config["mini_batch_size"] = self._mini_batch_size_config()
        return {**config, **self._extras()}


class CachedMultiVectorMarginMSELoss(_MultiVectorDistill):
    _citations = (GRADCACHE_CITATION, MARGIN_MSE_CITATION)
    equivalent_st_loss = "MultiVectorMarginMSELoss"
    objective: ClassVar[DistillObjective] = "margin_mse"

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
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        sentence-transformers' ``MultiVectorMarginMSELoss`` with GradCache: the mean squared error between
        the student's margins ``s(q, pos) - s(q, neg_j)`` (MaxSim, MeanMaxSim or XTR) and the teacher's,
        with the memory of one encoder mini-batch; optionally plus a weighted in-batch InfoNCE term.

        Embedded, scored and replayed as
        [`CachedMultiVectorDistillKLDivLoss`][st_cached_losses.losses.cached_multi_vector_distill.CachedMultiVectorDistillKLDivLoss];
        the same loss and gradients as ``MultiVectorMarginMSELoss``.

        Args:
            model: the ``MultiVectorEncoder`` to train.
            similarity_fct: ``None`` / ``colbert_scores_pairwise`` (MaxSim), ``mean_colbert_scores_pairwise``
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
            mini_batch_size=mini_batch_size if mini_batch_size is not None else DEFAULT_MINI_BATCH_SIZE,
            mini_batch_num_tokens=mini_batch_num_tokens,
            infonce_weight=0.0,
            infonce_scale=infonce_scale,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.similarity_fct = similarity_fct
        self._mini_batch_size_given = mini_batch_size
        self.infonce_weight = infonce_weight

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' two keys, then our extras in use."""
        config = {
            "similarity_fct": self._similarity_config(),
            "mini_batch_size": self._mini_batch_size_config(),
        }
        return {**config, **self._extras()}
