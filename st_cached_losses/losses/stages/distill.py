"""The distillation stage: the student's pairwise scores of each query against its own candidates, and the KL
divergence to the teacher's softmax (``DistillKLDivLoss``) or the mean squared error of the margins
(``MarginMSELoss``) against the teacher's scores in the labels, in row chunks
([`distill_loss_and_grad`][st_cached_losses.functional.distill.scores.distill_loss_and_grad])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.functional.distill.scores import DistillObjective, distill_loss_and_grad, margin_targets
from st_cached_losses.losses.base import Stage, StageInput, StageOutput
from st_cached_losses.losses.settings import DEFAULT_PLAN, Plan

__all__ = ["Distillation", "Prepared", "as_cached"]

#: the queries (one tensor, or one per column), the columns, and the map of their gradients back to the
#: cached rows' (the queries' gradients summed)
Prepared = tuple[list[Tensor], list[Tensor], Callable[[list[Tensor], list[Tensor]], list[Tensor]]]


def as_cached(embeddings: list[Tensor]) -> Prepared:
    """The rows as cached: the queries scored against every column."""
    return embeddings[:1], embeddings[1:], lambda gq, gc: [gq[0], *gc]


@dataclass(eq=False, kw_only=True)
class Distillation(Stage):
    """A teacher's scores distilled into the student's (see the module's notes).

    Args:
        owner: the loss's class name, for messages.
        objective: ``"kl"`` or ``"margin_mse"``.
        pairwise: the student's score of row ``i`` of the queries against row ``i`` of a column, ``(b,)``.
        student_temperature: the KL objective's softmax temperature of the student's scores.
        teacher_temperature: the KL objective's softmax temperature of the teacher's scores.
        plan: the loss stage's plan; the stage uses its ``memory_budget``: bytes a row chunk's score
            intermediates (and their gradient) may take.
        gather: across processes each process returns its share of the global mean (the InfoNCE core's
            weighting), each row's loss being its own.
        prepared: the cached rows as ``pairwise`` scores them (XTR's retrieval; default as cached).
        token_rows: the rows are packed token rows (a chunk's intermediates are token similarities).
        form: the engine's cache form the stage reads (token rows).
    """

    plan_fields: ClassVar[frozenset[str]] = frozenset({"memory_budget"})

    owner: str
    objective: DistillObjective
    pairwise: Callable[[Tensor, Tensor], Tensor]
    student_temperature: float = 1.0
    teacher_temperature: float = 1.0
    plan: Plan = DEFAULT_PLAN
    gather: bool = False
    prepared: Callable[[list[Tensor]], Prepared] = as_cached
    token_rows: bool = False
    form: CacheForm | None = None
    min_columns: int = 3
    _checked_teacher: bool = field(default=False, repr=False)

    def columns_message(self, n: int) -> str | None:
        return (
            f"{self.owner} expects at least 3 columns (at least 3 sentence features: query, positive, "
            f"negative_1, ...), but got {n}. A distillation loss compares the teacher's and the student's scores "
            "of at least two candidates (a softmax over one is constant): add a negative column."
        )

    def check(self, features: Sequence[Any]) -> None:
        if len(features) < 3:
            raise ValueError(self.columns_message(len(features)))
        super().check(features)

    def _targets(self, labels: Tensor, n_rows: int, n_columns: int) -> Tensor:
        """The teacher's scores ``(B, N)`` (KL) or margins ``(B, N - 1)`` (margin MSE) from the labels."""
        if self.objective == "margin_mse":
            return margin_targets(labels, n_rows, n_columns, self.owner)
        if labels.shape != (n_rows, n_columns):
            raise ValueError(
                f"{self.owner} expects teacher scores of shape (batch_size, N) = ({n_rows}, {n_columns}) for N "
                f"candidate columns, but got {tuple(labels.shape)}."
            )
        return labels

    def _check_teacher(self, targets: Tensor) -> None:
        """Once per stage, sentence-transformers' check of the teacher's softmax (NaN raises, underflow warns)."""
        if self._checked_teacher or self.objective != "kl":
            return
        self._checked_teacher = True
        from sentence_transformers.util import check_teacher_targets

        probabilities = torch.softmax(targets.detach().float() / self.teacher_temperature, dim=1)
        check_teacher_targets(probabilities, targets, self.teacher_temperature, self.owner)

    def _chunk_rows(self, embeddings: list[Tensor]) -> int:
        """Rows per chunk, from ``memory_budget``: a chunk's score intermediates (per row and column, a row's
        elements, or for token rows the query x document token similarities) and their gradient."""
        q, c = embeddings[0], embeddings[1]
        per_pair = q.shape[1] * c.shape[1] if self.token_rows else q.shape[-1]
        per_row = max(per_pair * (len(embeddings) - 1) * 4 * 3, 1)
        return max(1, min(self.plan.memory_budget // per_row, 1 << 16))

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        embeddings, labels = batch.embeddings, batch.labels
        if labels is None:
            raise ValueError(
                f"{self.owner} needs the teacher's scores as the labels (a 'label' / 'score' column of the "
                "dataset), got none."
            )
        if len(embeddings) < 3:
            raise ValueError(self.columns_message(len(embeddings)))
        sizes = batch.sizes(self.gather)  # also the finiteness check, on every process
        n_rows, n_columns = embeddings[0].shape[0], len(embeddings) - 1
        targets = self._targets(labels.to(embeddings[0].device), n_rows, n_columns)
        self._check_teacher(targets)
        # across processes each process returns its share W / B_global of the global mean, as the core does
        row_weight = len(sizes) / sum(sizes) if sizes is not None else None
        queries, columns, back = self.prepared(embeddings)
        out = distill_loss_and_grad(
            queries,
            columns,
            targets,
            self.pairwise,
            self.objective,
            student_temperature=self.student_temperature,
            teacher_temperature=self.teacher_temperature,
            row_weight=row_weight,
            chunk_rows=self._chunk_rows(embeddings),
            with_grad=with_grad,
        )
        if not with_grad:
            return StageOutput(out.loss)
        assert out.grad_queries is not None and out.grad_columns is not None
        return StageOutput(out.loss, back(out.grad_queries, out.grad_columns))
