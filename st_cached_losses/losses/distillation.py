"""What the cached distillation losses share: teacher scores in the labels, the student's pairwise scores
of each query against its own candidates (``st_cached_losses.functional.distill``, in row chunks), and
an optional weighted in-batch InfoNCE term over the whole batch (the core's, gathered across processes
with ``gather_across_devices``), as FlagEmbedding adds it to the teacher's KL.

A loss of this family supplies its pairwise score (`_pairwise`), how the cached embeddings are scored
(`_prepared`: XTR's retrieval), the score of the InfoNCE term (`_infonce_similarity`), its objective and
the teacher's targets from the labels."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.functional import Similarity, scale_value
from st_cached_losses.functional.distill import DistillObjective, distill_loss_and_grad, margin_targets
from st_cached_losses.functional.terms import mnrl_terms
from st_cached_losses.losses._base import (
    CachedInfoNCEBase,
    LossStageOptions,
    LossTerms,
    StageOutput,
    StepData,
)
from st_cached_losses.losses.settings import ONE_DIRECTION, Setting, check_infonce_weight

logger = logging.getLogger(__name__)

__all__ = ["DistillationBase", "similarity_or_none"]

#: the queries (one tensor, or one per column), the columns, and the map of their gradients back to the
#: cached embeddings' (queries' gradients summed)
Prepared = tuple[list[Tensor], list[Tensor], Callable[[list[Tensor], list[Tensor]], list[Tensor]]]


def _identity(embeddings: list[Tensor]) -> Prepared:
    return embeddings[:1], embeddings[1:], lambda gq, gc: [gq[0], *gc]


class DistillationBase(CachedInfoNCEBase):
    """The core of [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss],
    [`CachedMarginMSELoss`][st_cached_losses.losses.cached_distill.CachedMarginMSELoss] and their
    multi-vector forms: the distillation term in row chunks plus ``infonce_weight`` times the in-batch
    InfoNCE of the query against every column of every row (the first candidate column the positive),
    at scale ``infonce_scale``."""

    #: which distillation loss
    objective: ClassVar[DistillObjective]
    #: the weight of the in-batch InfoNCE term (0: the distillation loss alone, nothing else computed)
    infonce_weight = Setting[float](
        check=check_infonce_weight, validate=lambda loss, value: loss._validate_infonce_weight(value)
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        mini_batch_size: int | str,
        mini_batch_num_tokens: int | str | None,
        infonce_weight: float,
        infonce_scale: float,
        gather_across_devices: bool,
        show_progress_bar: bool,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        super().__init__(
            model,
            scale=scale_value(infonce_scale, "infonce_scale"),
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.gather_across_devices = gather_across_devices
        self.infonce_weight = infonce_weight
        self._checked_teacher_scale = False

    def _set_infonce_scale(self, old: float, new: float) -> None:
        self.scale = new

    #: The in-batch InfoNCE term's scale (1 / its temperature): a view of the core's ``scale``.
    infonce_scale = Setting[float](view=lambda loss: loss.scale, after=_set_infonce_scale)

    def _validate_infonce_weight(self, value: float) -> float:
        """An InfoNCE term needs an in-batch score: refused where the pairwise score has none."""
        if value:
            self._infonce_similarity(value)
        return value

    # ------------------------------------------------------------------ a loss's parts

    def _pairwise(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The student's score of row ``i`` of the queries against row ``i`` of a column, ``(b,)``."""
        raise NotImplementedError

    def _prepared(self, embeddings: list[Tensor]) -> Prepared:
        """The embeddings as `_pairwise` scores them (default: as cached)."""
        return _identity(embeddings)

    def _infonce_similarity(self, weight: float | None = None) -> Any:
        """The core's score of the InfoNCE term (``weight``: the term's weight, for the refusal's words)."""
        raise NotImplementedError

    def _temperatures(self) -> tuple[float, float]:
        """The student's and the teacher's temperatures (the KL objective)."""
        return 1.0, 1.0

    def _targets(self, labels: Tensor, n_rows: int, n_columns: int) -> Tensor:
        """The teacher's scores ``(B, N)`` (KL) or margins ``(B, N - 1)`` (margin MSE) from the labels."""
        owner = type(self).__name__
        if self.objective == "margin_mse":
            return margin_targets(labels, n_rows, n_columns, owner)
        if labels.shape != (n_rows, n_columns):
            raise ValueError(
                f"{owner} expects teacher scores of shape (batch_size, N) = ({n_rows}, {n_columns}) for N "
                f"candidate columns, but got {tuple(labels.shape)}."
            )
        return labels

    def _check_teacher(self, targets: Tensor) -> None:
        """Once per loss, sentence-transformers' check of the teacher's softmax (NaN raises, underflow warns)."""
        if self._checked_teacher_scale or self.objective != "kl":
            return
        self._checked_teacher_scale = True
        from sentence_transformers.util import check_teacher_targets

        teacher_temperature = self._temperatures()[1]
        probabilities = torch.softmax(targets.detach().float() / teacher_temperature, dim=1)
        check_teacher_targets(probabilities, targets, teacher_temperature, type(self).__name__)

    # ------------------------------------------------------------------ the template's seams

    def _check_columns(self, features: list[dict[str, Any]]) -> None:
        if len(features) < 3:
            raise ValueError(self._too_few_columns(len(features)))
        super()._check_columns(features)

    def _too_few_columns(self, n: int) -> str:
        return (
            f"{type(self).__name__} expects at least 3 columns (at least 3 sentence features: query, positive, "
            f"negative_1, ...), but got {n}. A distillation loss compares the teacher's and the student's scores "
            "of at least two candidates (a softmax over one is constant): add a negative column."
        )

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        return LossTerms(mnrl_terms(ONE_DIRECTION, "joint", None, 0.0, n_columns), self._infonce_similarity())

    def _chunk_rows(self, embeddings: list[Tensor]) -> int:
        """Rows per distillation chunk, from ``memory_budget``: a chunk's score intermediates (per row and
        column, a row's elements, or for token rows the query x document token similarities) and their
        gradient."""
        q, c = embeddings[0], embeddings[1]
        per_pair = q.shape[1] * c.shape[1] if q.dim() == 3 else q.shape[-1]
        per_row = max(per_pair * (len(embeddings) - 1) * 4 * 3, 1)
        return max(1, min(self.memory_budget // per_row, 1 << 16))

    def _loss_stage(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData, with_grad: bool
    ) -> StageOutput:
        """The distillation loss of the cached embeddings (and ``infonce_weight`` times the in-batch
        InfoNCE), and with ``with_grad`` its gradient wrt every column."""
        owner = type(self).__name__
        if labels is None:
            raise ValueError(
                f"{owner} needs the teacher's scores as the labels (a 'label' / 'score' column of the dataset), "
                "got none."
            )
        if len(embeddings) < 3:
            raise ValueError(self._too_few_columns(len(embeddings)))
        sizes = self._agree(embeddings)  # also the finiteness check, on every process
        n_rows, n_columns = embeddings[0].shape[0], len(embeddings) - 1
        targets = self._targets(labels.to(embeddings[0].device), n_rows, n_columns)
        self._check_teacher(targets)
        # across processes each process returns its share W / B_global of the global mean, as the core does
        row_weight = len(sizes) / sum(sizes) if sizes is not None else None
        queries, columns, back = self._prepared(embeddings)
        student_temperature, teacher_temperature = self._temperatures()
        out = distill_loss_and_grad(
            queries,
            columns,
            targets,
            self._pairwise(),
            self.objective,
            student_temperature=student_temperature,
            teacher_temperature=teacher_temperature,
            row_weight=row_weight,
            chunk_rows=self._chunk_rows(embeddings),
            with_grad=with_grad,
        )
        loss = out.loss
        grads = None
        if with_grad:
            assert out.grad_queries is not None and out.grad_columns is not None
            grads = back(out.grad_queries, out.grad_columns)
        weight = self.infonce_weight
        if weight:
            options = self._options(step, n_rows, n_columns, self.scale)
            nce = self._ranking(embeddings, options, sizes, with_grad)
            loss = loss + weight * nce.loss.to(loss.dtype)
            if grads is not None:
                assert nce.grad_anchors is not None
                nce_grads = [nce.grad_anchors, *nce.grad_candidates]
                grads = [g + weight * n.to(g.dtype) for g, n in zip(grads, nce_grads)]
        return StageOutput(loss, grads)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        """sentence-transformers' interface: the loss of already computed embeddings (one ``(B, ...)`` tensor
        per column), with autograd to them where they require grad."""
        return self.calculate_loss([[e] for e in embeddings], labels)

    def _autograd_loss(self, embeddings: list[Tensor], labels: Tensor | None, step: StepData) -> Tensor:
        """The loss with exactly the computed gradient wrt each embedding, as a graph."""
        with_grad = any(e.requires_grad for e in embeddings)
        out = self._loss_stage(embeddings, labels, step, with_grad=with_grad)
        if out.grads is None:
            return out.loss
        # the value, with exactly the computed gradient wrt each embedding ((e - e) is exactly 0)
        return out.loss + sum(((e - e.detach()) * g.to(e.dtype)).sum() for e, g in zip(embeddings, out.grads))

    def _extras(self) -> dict[str, Any]:
        """The config's extras: the InfoNCE term where it is on, the gathering, then the changed settings."""
        extras: dict[str, Any] = {}
        if self.infonce_weight:
            extras.update(infonce_weight=self.infonce_weight, infonce_scale=self.infonce_scale)
            if self.gather_across_devices:
                extras["gather_across_devices"] = True
        return {**extras, **self._changed_settings()}


def similarity_or_none(similarity: Similarity | None, owner: str, weight: float) -> Similarity:
    """The InfoNCE term's score, refused (naming the fix) where the pairwise score has no matrix form and
    the term is on."""
    if similarity is None:
        raise ValueError(
            f"{owner}: infonce_weight={weight!r} needs an in-batch score of every query against every "
            "document, which this similarity_fct has no form of: use pairwise_dot_score or pairwise_cos_sim "
            "(sentence_transformers.util), or set infonce_weight=0."
        )
    return similarity
