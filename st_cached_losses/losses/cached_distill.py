"""Distillation from a teacher's scores with GradCache, for a ``SentenceTransformer``: sentence-transformers'
``DistillKLDivLoss`` and ``MarginMSELoss`` with the memory of one encoder mini-batch (the
[`Distillation`][st_cached_losses.losses.stages.distill.Distillation] stage), optionally plus an in-batch
InfoNCE term (a [`WeightedSum`][st_cached_losses.losses.stages.weighted.WeightedSum] with the
[`InfoNCE`][st_cached_losses.losses.stages.infonce.InfoNCE] stage)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from sentence_transformers.util import pairwise_dot_score
from torch import Tensor, nn

from st_cached_losses.functional.softmax.terms import mnrl_terms
from st_cached_losses.losses.base import CachedLoss, Stage
from st_cached_losses.losses.citations import DISTILL_KL_CITATION, GRADCACHE_CITATION, MARGIN_MSE_CITATION
from st_cached_losses.losses.ranking import ONE_DIRECTION
from st_cached_losses.losses.settings import (
    LossStageSettings,
    SharedSettings,
    check_scale,
    redefault,
    setting,
)
from st_cached_losses.losses.similarity import PAIRWISE, SimilarityKind
from st_cached_losses.losses.stages.distill import Distillation
from st_cached_losses.losses.stages.infonce import InfoNCE
from st_cached_losses.losses.stages.weighted import WeightedSum

__all__ = [
    "CachedDistillKLDivLoss",
    "CachedMarginMSELoss",
    "DistillKLDivSettings",
    "DistillSettings",
    "MarginMSESettings",
    "check_temperature",
    "distillation_stage",
    "refuse_idle_matmul_precision",
]


def check_temperature(name: str, value: Any) -> Any:
    """A distillation loss's softmax temperature: positive and finite (sentence-transformers' rule and words);
    None where it follows ``temperature`` (the student's and the teacher's)."""
    if value is None and name != "temperature":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value}.")
    return float(value)


def _infonce_weight(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(
            f"{name} must be a finite number >= 0 (0: no in-batch InfoNCE term), got {value!r}; e.g. 0.1."
        )
    return float(value)


@dataclass(frozen=True, kw_only=True)
class DistillSettings(LossStageSettings):
    """What every distillation loss of teacher scores has: the optional in-batch InfoNCE term added to the
    distillation loss (its weight and scale) and the processes' rows."""

    infonce_weight: float = setting(
        0.0,
        doc="The weight of an in-batch InfoNCE term added to the teacher's loss: each query against every row's "
        "candidates (the first candidate column the positive), by the loss's score as a matrix; 0: the "
        "distillation loss alone. Not on the sparse distillation losses.",
        check=_infonce_weight,
        config="never",
    )
    infonce_scale: float = setting(
        20.0,
        doc="The InfoNCE term's scale (1 / its temperature): 20 for the dense losses' cosine (0.05), 1 for the "
        "multi-vector ones (MaxSim sums over query tokens).",
        check=check_scale,
        config="never",
    )
    #: written by the config with the InfoNCE term only (``extras_config``)
    gather_across_devices: bool = redefault(SharedSettings, "gather_across_devices", False, config="never")

    def infonce_similarity(self) -> Any:
        """The InfoNCE term's in-batch score, or None where the loss's score has no matrix form."""
        raise NotImplementedError

    def validate(self) -> None:
        super().validate()
        if self.infonce_weight and self.infonce_similarity() is None:
            raise ValueError(
                f"{self.owner}: infonce_weight={self.infonce_weight!r} needs an in-batch score of every query against "
                "every document, which this similarity_fct has no form of: use pairwise_dot_score or pairwise_cos_sim "
                "(sentence_transformers.util), or set infonce_weight=0."
            )
        refuse_idle_matmul_precision(
            self, "the teacher's loss alone keeps fp32 products (a few scores a row)"
        )

    def idle_plan_hint(self, name: str) -> str:
        return (
            f"the teacher's loss plans its row chunks by memory_budget alone, and {name} sets the in-batch InfoNCE "
            f"term's blocks, which infonce_weight=0 leaves out: remove {name}, or set infonce_weight above 0"
        )

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """The in-batch InfoNCE term (sentence-transformers' distillation losses have none)."""
        return (
            *super().beyond_sentence_transformers(),
            *(("infonce_weight",) if self.infonce_weight else ()),
        )

    def extras_config(self) -> dict[str, Any]:
        """The InfoNCE term where it is on (with the gathering), then the plan's fields that differ from their
        defaults."""
        extras: dict[str, Any] = {}
        if self.infonce_weight:
            extras.update(infonce_weight=self.infonce_weight, infonce_scale=self.infonce_scale)
            if self.gather_across_devices:
                extras["gather_across_devices"] = True
        return {**extras, **super().extras_config()}


@dataclass(frozen=True, kw_only=True)
class _DenseScore(DistillSettings):
    #: the kind of ``similarity_fct`` (its check, its config name, the arguments' names)
    similarity_kind: ClassVar[SimilarityKind] = PAIRWISE

    similarity_fct: Callable[..., Tensor] | str = setting(
        pairwise_dot_score,
        doc="The student's pairwise score f(a, b) -> (len(a),): 'dot' / 'cosine' (pairwise_dot_score / "
        "pairwise_cos_sim; the InfoNCE term then scores with the dot product / cosine), or any function.",
        check=PAIRWISE,
        config="always",
    )

    def infonce_similarity(self) -> Any:
        return PAIRWISE.infonce(self.resolved("similarity_fct"))


@dataclass(frozen=True, kw_only=True)
class KLTemperatures(DistillSettings):
    """The KL objective's temperatures, sentence-transformers' ``DistillKLDivLoss`` meaning."""

    temperature: float = setting(
        1.0,
        doc="The KL distillation losses' softmax temperature (both softmaxes, unless student_temperature / "
        "teacher_temperature says otherwise; the loss is multiplied by student_temperature ** 2), as "
        "sentence-transformers' DistillKLDivLoss.",
        check=check_temperature,
        config="always",
    )
    student_temperature: float | None = setting(
        None,
        doc="The KL loss's student softmax temperature (None: temperature).",
        check=check_temperature,
        config="never",
    )
    teacher_temperature: float | None = setting(
        None,
        doc="The KL loss's teacher softmax temperature (None: temperature).",
        check=check_temperature,
        config="never",
    )

    def temperatures(self) -> tuple[float, float]:
        """The student's and the teacher's temperatures, as used."""
        student = self.student_temperature if self.student_temperature is not None else self.temperature
        teacher = self.teacher_temperature if self.teacher_temperature is not None else self.temperature
        return student, teacher

    def keys_config(self) -> dict[str, Any]:
        """sentence-transformers' keys, ``temperature`` followed by the student's / teacher's where they
        differ from it."""
        student, teacher = self.temperatures()
        differing = {
            name: value
            for name, value in (("student_temperature", student), ("teacher_temperature", teacher))
            if value != self.temperature
        }
        config: dict[str, Any] = {}
        for name, value in super().keys_config().items():
            config[name] = value
            if name == "temperature":
                config.update(differing)
        return config


@dataclass(frozen=True, kw_only=True)
class DistillKLDivSettings(_DenseScore, KLTemperatures):
    """[`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss]'s settings."""

    owner: ClassVar[str] = "CachedDistillKLDivLoss"
    #: sentence-transformers' keys (the temperatures that differ from ``temperature`` follow it)
    config_keys: ClassVar[tuple[str, ...]] = ("similarity_fct", "temperature")


@dataclass(frozen=True, kw_only=True)
class MarginMSESettings(_DenseScore):
    """[`CachedMarginMSELoss`][st_cached_losses.losses.cached_distill.CachedMarginMSELoss]'s settings."""

    owner: ClassVar[str] = "CachedMarginMSELoss"
    #: sentence-transformers' keys
    config_keys: ClassVar[tuple[str, ...]] = ("similarity_fct", "mini_batch_size")


def refuse_idle_matmul_precision(settings: Any, kept: str) -> None:
    """Refuse ``matmul_precision`` where a distillation loss's in-batch InfoNCE term is off (``infonce_weight``
    0): it sets that term's products only, and ``kept`` says what the rest does instead."""
    if settings.matmul_precision is not None and not settings.infonce_weight:
        raise ValueError(
            f"{settings.owner}: matmul_precision={settings.matmul_precision!r} sets the in-batch InfoNCE term's "
            f"similarity products, and infonce_weight is 0: {kept}. Remove matmul_precision, or set "
            "infonce_weight above 0."
        )


def distillation_stage(distill: Stage, settings: Any, form: Any = None, similarity: Any = None) -> Stage:
    """The distillation stage alone, or with ``infonce_weight`` times the in-batch InfoNCE of the queries
    against every column of every row (the first candidate column the positive), at ``infonce_scale``, scored
    by ``similarity`` (None: the settings' ``infonce_similarity()``). ``settings``: a distillation loss's
    ([`DistillSettings`][st_cached_losses.losses.cached_distill.DistillSettings], or
    ``CachedEmbedDistillLoss``'s, which has the same InfoNCE fields)."""
    s = settings
    if not s.infonce_weight:
        return distill

    terms = functools.partial(mnrl_terms, ONE_DIRECTION, "joint", None, 0.0)
    infonce = InfoNCE(
        owner=distill.owner,
        terms=terms,
        similarity=similarity if similarity is not None else s.infonce_similarity(),
        scale=s.infonce_scale,
        plan=s.plan(),
        gather=s.gather_across_devices,
        form=form,
    )
    return WeightedSum(stages=[(1.0, distill), (s.infonce_weight, infonce)])


class KLTemperatureAttributes:
    """The KL losses' ``student_temperature`` and ``teacher_temperature`` as attributes (each ``temperature``
    unless given), read from and written to the loss's settings (``KLTemperatures``)."""

    settings: Any
    update_settings: Callable[..., None]

    @property
    def student_temperature(self) -> float:
        """The student's softmax temperature (``temperature`` unless given)."""
        return self.settings.temperatures()[0]

    @student_temperature.setter
    def student_temperature(self, value: float | None) -> None:
        self.update_settings(student_temperature=value)

    @property
    def teacher_temperature(self) -> float:
        """The teacher's softmax temperature (``temperature`` unless given)."""
        return self.settings.temperatures()[1]

    @teacher_temperature.setter
    def teacher_temperature(self, value: float | None) -> None:
        self.update_settings(teacher_temperature=value)


class CachedDistillKLDivLoss(KLTemperatureAttributes, CachedLoss):
    name = "distill_kl"
    aliases = ("distill-kl",)
    st_names = ("DistillKLDivLoss",)
    settings_class = DistillKLDivSettings
    distillation = True
    citations = (GRADCACHE_CITATION, DISTILL_KL_CITATION)
    equivalent_st_loss = "DistillKLDivLoss"

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
        **engine: Any,
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
        ([`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result).
        Every argument is a setting ([`DistillKLDivSettings`][st_cached_losses.losses.cached_distill.DistillKLDivSettings]),
        read and assigned between steps. As in sentence-transformers, ``temperature`` is the KL's softmax
        temperature; the InfoNCE term's is ``1 / infonce_scale`` (this loss has no ``scale``).

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
            infonce_scale: the InfoNCE term's scale (``1 / its temperature``), e.g. 20 for cosine (0.05).
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
            DistillKLDivSettings(
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

    def build_stage(self) -> Stage:
        s = self.settings
        student, teacher = s.temperatures()
        distill = Distillation(
            owner=type(self).__name__,
            objective="kl",
            pairwise=s.resolved("similarity_fct"),
            student_temperature=student,
            teacher_temperature=teacher,
            plan=s.plan(),
            gather=s.gather_across_devices,
        )
        return distillation_stage(distill, s)


class CachedMarginMSELoss(CachedLoss):
    name = "margin_mse"
    aliases = ("margin-mse",)
    st_names = ("MarginMSELoss",)
    settings_class = MarginMSESettings
    distillation = True
    citations = (GRADCACHE_CITATION, MARGIN_MSE_CITATION)
    equivalent_st_loss = "MarginMSELoss"

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
        **engine: Any,
    ) -> None:
        """
        sentence-transformers' ``MarginMSELoss`` with GradCache: the mean squared error between the
        student's margins ``s(q, pos) - s(q, neg_j)`` and the teacher's, with the memory of one encoder
        mini-batch whatever the batch and the number of hard negatives; optionally plus a weighted
        in-batch InfoNCE term over the whole batch.

        Embedded, scored and replayed as [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss];
        the same loss and gradients as ``MarginMSELoss``. The constructor takes ``MarginMSELoss``'s
        arguments, then ours, keyword-only, then the engine's knobs and the loss stage's plan
        ([`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]); its settings are a
        [`MarginMSESettings`][st_cached_losses.losses.cached_distill.MarginMSESettings]. It has no ``scale``
        nor ``temperature``: the InfoNCE term's scale is ``infonce_scale``.

        Args:
            model: the ``SentenceTransformer`` (the student) to train.
            similarity_fct: the student's pairwise score (``pairwise_dot_score`` by default, as theirs).
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            infonce_weight: the weight of an in-batch InfoNCE term (see
                [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss]);
                0 (the default): the margin loss alone.
            infonce_scale: the InfoNCE term's scale (``1 / its temperature``).
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
            MarginMSESettings(
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

    def build_stage(self) -> Stage:
        s = self.settings
        distill = Distillation(
            owner=type(self).__name__,
            objective="margin_mse",
            pairwise=s.resolved("similarity_fct"),
            plan=s.plan(),
            gather=s.gather_across_devices,
        )
        return distillation_stage(distill, s)
