"""Distillation from a teacher's scores with GradCache, for a ``SentenceTransformer``: sentence-transformers'
``DistillKLDivLoss`` and ``MarginMSELoss`` with the memory of one encoder mini-batch, optionally plus an
in-batch InfoNCE term (the family's core: [`DistillationBase`][st_cached_losses.losses.distillation.DistillationBase])."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

from sentence_transformers.util import pairwise_cos_sim, pairwise_dot_score
from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.functional import Similarity
from st_cached_losses.functional.distill import DistillObjective
from st_cached_losses.losses._base import LossStageOptions
from st_cached_losses.losses.citations import DISTILL_KL_CITATION, GRADCACHE_CITATION, MARGIN_MSE_CITATION
from st_cached_losses.losses.distillation import DistillationBase, similarity_or_none
from st_cached_losses.losses.settings import Setting, check_temperature

__all__ = ["CachedDistillKLDivLoss", "CachedMarginMSELoss", "infonce_similarity_of"]


def infonce_similarity_of(similarity_fct: Callable[..., Tensor]) -> Similarity | None:
    """The core's in-batch score that a pairwise score is the diagonal of: ``pairwise_dot_score`` ->
    ``"dot"``, ``pairwise_cos_sim`` -> ``"cosine"`` (a bare ``functools.partial`` counts as the function);
    None for any other."""
    fn: Any = similarity_fct
    if isinstance(fn, functools.partial) and not fn.args and not fn.keywords:
        fn = fn.func
    return {pairwise_dot_score: "dot", pairwise_cos_sim: "cosine"}.get(fn)  # type: ignore[return-value]


def _check_pairwise(name: str, value: Any) -> Any:
    if not callable(value):
        raise ValueError(
            f"{name} must be a pairwise score f(a, b) -> (len(a),), e.g. sentence_transformers.util."
            f"pairwise_dot_score or pairwise_cos_sim, got {value!r}."
        )
    return value


class _DenseDistill(DistillationBase):
    """The dense losses' parts: the pairwise score is the user's ``similarity_fct``, called on row chunks."""

    similarity_fct = Setting[Callable[..., Tensor]](check=_check_pairwise)

    def _pairwise(self) -> Callable[[Tensor, Tensor], Tensor]:
        return self.similarity_fct

    def _infonce_similarity(self, weight: float | None = None) -> Similarity:
        weight = weight if weight is not None else self.infonce_weight
        return similarity_or_none(infonce_similarity_of(self.similarity_fct), type(self).__name__, weight)


class CachedDistillKLDivLoss(_DenseDistill):
    _citations = (GRADCACHE_CITATION, DISTILL_KL_CITATION)
    equivalent_st_loss = "DistillKLDivLoss"
    objective: ClassVar[DistillObjective] = "kl"

    def __init__(
        self,
        model: nn.Module,
        similarity_fct: Callable[..., Tensor] = pairwise_dot_score,
        temperature: float = 1.0,
        student_temperature: float | None = None,
        teacher_temperature: float | None = None,
        *,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        infonce_weight: float = 0.0,
        infonce_scale: float = 20.0,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        sentence-transformers' ``DistillKLDivLoss`` with GradCache: the KL divergence of the student's
        softmax over each query's candidates from the teacher's, the teacher's scores given as the labels,
        with the memory of one encoder mini-batch whatever the batch and the number of hard negatives;
        optionally plus a weighted in-batch InfoNCE term over the whole batch (FlagEmbedding's
        distillation recipe).

        The batch (queries and every candidate column, ``B x (k + 1)`` texts) is embedded mini-batch by
        mini-batch without a graph; the loss and its gradient wrt every embedding are computed in row
        chunks (the student's pairwise scores are a ``(B, k + 1)`` matrix); the encoder is then replayed
        with the cached gradients. The same loss and gradients as ``DistillKLDivLoss``.

        The constructor takes ``DistillKLDivLoss``'s arguments in their positional order, then ours,
        keyword-only, then the engine's knobs and the loss stage's plan
        ([`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]; none changes the result).
        Every argument is a setting, read and assigned between steps.

        Args:
            model: the ``SentenceTransformer`` (the student) to train.
            similarity_fct: the student's pairwise score ``f(a, b) -> (len(a),)``, as theirs
                (``pairwise_dot_score`` by default; ``pairwise_cos_sim``, or any pairwise function).
            temperature: the temperature of both softmaxes, unless one is given below; the loss is
                multiplied by ``student_temperature**2``.
            student_temperature: the student's softmax temperature (default ``temperature``).
            teacher_temperature: the teacher's softmax temperature (default ``temperature``).
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            infonce_weight: the weight of an in-batch InfoNCE term added to the loss: each query against its
                own candidates and every other row's (the first candidate column is the positive), with the
                score of ``similarity_fct`` as a matrix (``pairwise_dot_score``: dot product,
                ``pairwise_cos_sim``: cosine). 0 (the default): the distillation loss alone.
            infonce_scale: the InfoNCE term's scale (``1 / temperature``), e.g. 20 for cosine (0.05).
            gather_across_devices: the InfoNCE term scores each process's queries against every process's
                candidates (gathered, or by ring exchange with ``path="tiled"``); the distillation term is
                each row's own.
            show_progress_bar: tqdm bars over the mini-batches.

        References:
            - Lin et al., Distilling Dense Representations for Ranking using Tightly-Coupled Teachers,
              2020: https://huggingface.co/papers/2010.11386
            - Xiao et al., C-Pack: Packed Resources For General Chinese Embeddings (FlagEmbedding's
              distillation plus in-batch negatives), 2023: https://huggingface.co/papers/2309.07597
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (query, positive, negative_1, ..., negative_n) tuples, n >= 1.
            2. The teacher's score of each candidate, ``(batch_size, n + 1)``, as the labels.

        Inputs:
            | Texts | Labels |
            |---|---|
            | (query, positive, negative_1, ..., negative_n) | teacher scores ``[s_pos, s_neg_1, ..., s_neg_n]`` |

        Relations:
            - The same loss and gradients as ``DistillKLDivLoss`` (sentence-transformers) with the same
              arguments (and ``infonce_weight=0``), on one process and across processes.
            - [`CachedMarginMSELoss`][st_cached_losses.losses.cached_distill.CachedMarginMSELoss] distils the
              teacher's margins instead.

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedDistillKLDivLoss

            model = SentenceTransformer("all-MiniLM-L6-v2")
            # train_dataset: query, positive, negative_1..negative_31 and a "label" column of 32 teacher scores
            loss = CachedDistillKLDivLoss(model, mini_batch_size=64, infonce_weight=0.1)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            infonce_weight=0.0,
            infonce_scale=infonce_scale,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.similarity_fct = similarity_fct
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
        """sentence-transformers' keys (the temperatures that differ from ``temperature`` only), then
        our extras in use."""
        from sentence_transformers.util import similarity_fct_name

        config: dict[str, Any] = {
            "similarity_fct": similarity_fct_name(self.similarity_fct),
            "temperature": self.temperature,
        }
        if self.student_temperature != self.temperature:
            config["student_temperature"] = self.student_temperature
        if self.teacher_temperature != self.temperature:
            config["teacher_temperature"] = self.teacher_temperature
        return {**config, **self._extras()}


class CachedMarginMSELoss(_DenseDistill):
    _citations = (GRADCACHE_CITATION, MARGIN_MSE_CITATION)
    equivalent_st_loss = "MarginMSELoss"
    objective: ClassVar[DistillObjective] = "margin_mse"

    def __init__(
        self,
        model: nn.Module,
        similarity_fct: Callable[..., Tensor] = pairwise_dot_score,
        *,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        infonce_weight: float = 0.0,
        infonce_scale: float = 20.0,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        sentence-transformers' ``MarginMSELoss`` with GradCache: the mean squared error between the
        student's margins ``s(q, pos) - s(q, neg_j)`` and the teacher's, with the memory of one encoder
        mini-batch whatever the batch and the number of hard negatives; optionally plus a weighted
        in-batch InfoNCE term over the whole batch.

        Embedded, scored and replayed as [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss];
        the same loss and gradients as ``MarginMSELoss``. The constructor takes ``MarginMSELoss``'s
        arguments, then ours, keyword-only, then the engine's knobs and the loss stage's plan
        ([`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]). The inherited ``scale`` /
        ``temperature`` are the InfoNCE term's (``infonce_scale``).

        Args:
            model: the ``SentenceTransformer`` (the student) to train.
            similarity_fct: the student's pairwise score (``pairwise_dot_score`` by default, as theirs).
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            infonce_weight: the weight of an in-batch InfoNCE term (see
                [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss]);
                0 (the default): the margin loss alone.
            infonce_scale: the InfoNCE term's scale (``1 / temperature``).
            gather_across_devices: the InfoNCE term across every process's candidates.
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
            - The same loss and gradients as ``MarginMSELoss`` (sentence-transformers) with the same
              ``similarity_fct`` (and ``infonce_weight=0``).

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedMarginMSELoss

            model = SentenceTransformer("all-MiniLM-L6-v2")
            loss = CachedMarginMSELoss(model, mini_batch_size=64)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            infonce_weight=0.0,
            infonce_scale=infonce_scale,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.similarity_fct = similarity_fct
        self.infonce_weight = infonce_weight

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' key, then our extras in use."""
        from sentence_transformers.util import similarity_fct_name

        config = {
            "similarity_fct": similarity_fct_name(self.similarity_fct),
            "mini_batch_size": self.mini_batch_size,
        }
        return {**config, **self._extras()}
