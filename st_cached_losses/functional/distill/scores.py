"""Distillation from a teacher's scores: the student's score of each query against its own candidates, and
the KL divergence to the teacher's softmax (``DistillKLDivLoss``) or the mean squared error of the margins
(``MarginMSELoss``), with the gradient wrt every embedding, in row chunks.

Both losses are sums over the rows (KL ``batchmean`` is the sum over rows divided by the rows; the MSE of
the margins the sum divided by rows x margins), so a chunk of rows is scored, differentiated and dropped
before the next: the largest intermediate is one chunk's pairwise scores (for token rows, one chunk's
``(b, q_tokens, d_tokens)`` similarities per column), whatever the batch and the number of candidates.
Each chunk's loss goes through autograd on leaves of its own rows, so any pairwise score function
``f(a, b) -> (b,)`` is exact, theirs included.

Shapes: ``B`` rows, ``N`` candidate columns (the positive first, then the hard negatives), ``b`` rows of a
chunk; an embedding row is ``(d,)``, or a packed token row ``(t, d + 1)`` (see
[`multi_vector`][st_cached_losses.functional.representations.multi_vector])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.precision import fp32_loss_stage

__all__ = ["DistillObjective", "DistillOutput", "distill_loss_and_grad", "margin_targets"]

#: ``"kl"``: KL divergence of the student's softmax over the candidates from the teacher's;
#: ``"margin_mse"``: mean squared error between the student's and the teacher's margins (positive - negative)
DistillObjective = Literal["kl", "margin_mse"]


@dataclass
class DistillOutput:
    """What [`distill_loss_and_grad`][st_cached_losses.functional.distill.scores.distill_loss_and_grad] returns."""

    #: 0-d, detached: the loss (this process's share of it, with ``row_weight``)
    loss: Tensor
    #: with ``with_grad``, the gradient wrt each of ``queries`` (in their order and dtype)
    grad_queries: list[Tensor] | None = None
    #: with ``with_grad``, the gradient wrt each candidate column
    grad_columns: list[Tensor] | None = None


def margin_targets(labels: Tensor, n_rows: int, n_columns: int, owner: str) -> Tensor:
    """The teacher's margins ``(B, N - 1)`` from ``labels`` as sentence-transformers' ``MarginMSELoss`` takes
    them: ``(B, N)`` scores (positive first: margins ``s_pos - s_neg``), ``(B, N - 1)`` margins, or, with one
    negative, ``(B,)`` margins."""
    n_negatives = n_columns - 1
    batch = n_rows
    if labels.dim() == 1:
        if n_negatives != 1:
            raise ValueError(
                f"{owner} got 1D labels (shape {tuple(labels.shape)}) but {n_negatives} negative columns: 1D "
                "margins need exactly one negative column; give (batch_size, num_negatives) margins or "
                "(batch_size, num_negatives + 1) scores."
            )
        labels = labels.unsqueeze(1)
    if labels.dim() == 2 and labels.shape[1] == n_negatives + 1:
        labels = labels[:, :1] - labels[:, 1:]
    if labels.dim() != 2 or labels.shape != (n_rows, n_negatives):
        raise ValueError(
            f"{owner} got labels of shape {tuple(labels.shape)}, expected ({batch}, {n_negatives}) margins or "
            f"({batch}, {n_negatives + 1}) scores for {n_negatives} negative columns: the teacher's scores as "
            "1) lists of differences between the positive's and each negative's score (length num_negatives), "
            "or 2) lists of the positive's and the negatives' scores (length num_negatives + 1)."
        )
    return labels


@fp32_loss_stage
def distill_loss_and_grad(
    queries: Sequence[Tensor],
    columns: Sequence[Tensor],
    targets: Tensor,
    pairwise: Callable[[Tensor, Tensor], Tensor],
    objective: DistillObjective,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    row_weight: float | None = None,
    chunk_rows: int = 1024,
    with_grad: bool = True,
) -> DistillOutput:
    """The distillation loss of the student's pairwise scores against the teacher's, and its gradient.

    Args:
        queries: the queries' embeddings ``(B, ...)``: one tensor scored against every column, or one per
            column (a score whose queries carry per-column data, XTR's retrieval); their gradients are
            returned separately, one per tensor.
        columns: ``N`` candidate columns ``(B, ...)``, the positive first.
        targets: the teacher: ``(B, N)`` scores (``"kl"``) or ``(B, N - 1)`` margins (``"margin_mse"``,
            see [`margin_targets`][st_cached_losses.functional.distill.scores.margin_targets]); no gradient.
        pairwise: ``f(q, c) -> (b,)``, the score of row ``i`` of ``q`` against row ``i`` of ``c``.
        objective: ``"kl"``: ``student_temperature**2 * KL(softmax(targets / teacher_temperature) ||
            softmax(scores / student_temperature))`` per row (sentence-transformers' ``DistillKLDivLoss``);
            ``"margin_mse"``: ``mean_j ((s_pos - s_neg_j) - targets_j)**2`` per row (``MarginMSELoss``).
        student_temperature: the student's softmax temperature; ``"kl"`` only.
        teacher_temperature: the teacher's softmax temperature; ``"kl"`` only.
        row_weight: the weight of each row's loss in the returned sum (default ``1 / B``, the mean; across
            processes ``W / B_global``, this process's share of the global mean).
        chunk_rows: rows scored (and differentiated) at once; sets the memory, not the result.
        with_grad: also return the gradients.

    Returns:
        [`DistillOutput`][st_cached_losses.functional.distill.scores.DistillOutput].
    """
    n_rows = columns[0].shape[0]
    if len(queries) not in (1, len(columns)):
        raise ValueError(
            f"queries must be one tensor or one per column ({len(columns)}), got {len(queries)}."
        )
    weight = row_weight if row_weight is not None else 1.0 / max(n_rows, 1)
    width = targets.shape[1] if targets.dim() == 2 else 0
    if objective == "margin_mse":
        weight = weight / max(width, 1)  # the mean over the margins too
    targets = targets.detach()
    total = torch.zeros((), dtype=torch.float64)
    grads_q = [torch.zeros_like(q) for q in queries] if with_grad else None
    grads_c = [torch.zeros_like(c) for c in columns] if with_grad else None
    for start in range(0, n_rows, max(chunk_rows, 1)):
        rows = slice(start, min(start + chunk_rows, n_rows))
        q_leaves = [q[rows].detach().requires_grad_(with_grad) for q in queries]
        c_leaves = [c[rows].detach().requires_grad_(with_grad) for c in columns]
        with torch.enable_grad() if with_grad else torch.no_grad():
            scores = torch.stack(
                [pairwise(q_leaves[j if len(q_leaves) > 1 else 0], c) for j, c in enumerate(c_leaves)], dim=1
            )  # (b, N)
            target = targets[rows]
            if objective == "kl":
                student = F.log_softmax(scores / student_temperature, dim=1)
                teacher = F.softmax(target.to(scores.dtype) / teacher_temperature, dim=1)
                # xlogy: a teacher probability of exactly 0 adds 0, as nn.KLDivLoss
                per_row = (torch.xlogy(teacher, teacher) - teacher * student).sum(1) * student_temperature**2
            else:
                margins = scores[:, :1] - scores[:, 1:]  # (b, N - 1)
                per_row = (margins - target.to(margins.dtype)).pow(2).sum(1)
            chunk_loss = per_row.sum() * weight
        total += chunk_loss.detach().double().cpu()
        if with_grad and chunk_loss.requires_grad:
            assert grads_q is not None and grads_c is not None
            found = torch.autograd.grad(chunk_loss, [*q_leaves, *c_leaves], allow_unused=True)
            for buffer, g in zip([*grads_q, *grads_c], found):
                if g is not None:
                    buffer[rows] += g.to(buffer.dtype)
    device = columns[0].device
    return DistillOutput(total.to(device=device, dtype=torch.float32), grads_q, grads_c)
