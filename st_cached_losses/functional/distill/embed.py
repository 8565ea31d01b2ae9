"""Embedding distillation, pointwise: each student embedding against the teacher's embedding of the same row
(sentence-transformers' ``EmbedDistillLoss``), optionally through a learned linear projection into the
teacher's space, with the gradient wrt every student embedding and wrt the projection's weight and bias.

Every row's term is its own (no softmax over the batch), so the loss is a sum over rows: a chunk of rows is
projected, compared, differentiated and dropped before the next. Each chunk's loss goes through autograd on
leaves of its own rows (and of the projection's parameters), with the very operations sentence-transformers
uses, so the gradients are theirs.

Shapes: ``B`` rows per column, ``K`` columns, student rows ``(B, d_s)``, teacher rows ``(B, d_t)``, the
projection's weight ``(d_t, d_s)`` and bias ``(d_t,)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.precision import accumulation_dtype, fp32_loss_stage

__all__ = ["EMBED_DISTANCES", "EmbedDistance", "EmbedDistillOutput", "embed_distill_loss_and_grad"]

#: ``"cosine"``: ``1 - cos(s, t)`` per row; ``"l2"``: ``||s - t||`` per row; ``"mse"``: the mean of the squared
#: differences over every element
EmbedDistance = Literal["cosine", "l2", "mse"]
EMBED_DISTANCES: tuple[str, ...] = ("mse", "l2", "cosine")


@dataclass
class EmbedDistillOutput:
    """What [`embed_distill_loss_and_grad`][st_cached_losses.functional.distill.embed.embed_distill_loss_and_grad]
    returns."""

    #: 0-d, detached: the loss (this process's share of it, with ``row_weight``)
    loss: Tensor
    #: with ``with_grad``, the gradient wrt each student column (in its dtype)
    grads: list[Tensor] | None = None
    #: with ``with_grad`` and a projection, the gradient wrt its weight ``(d_t, d_s)``
    grad_weight: Tensor | None = None
    #: with ``with_grad`` and a projection with a bias, the gradient wrt its bias ``(d_t,)``
    grad_bias: Tensor | None = None


def _distance(student: Tensor, teacher: Tensor, metric: EmbedDistance) -> Tensor:
    """The sum over the rows of ``metric``'s per-row term (``"mse"``: the sum of squares over the elements)."""
    if metric == "mse":
        return (student - teacher).pow(2).sum()
    if metric == "l2":
        return torch.norm(student - teacher, dim=-1).sum()
    return (1 - F.cosine_similarity(student, teacher, dim=-1)).sum()


@fp32_loss_stage
def embed_distill_loss_and_grad(
    students: Sequence[Tensor],
    teachers: Sequence[Tensor],
    metric: EmbedDistance,
    *,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    row_weight: float | None = None,
    chunk_rows: int = 4096,
    with_grad: bool = True,
) -> EmbedDistillOutput:
    """The mean over the columns of each column's distance loss between the (projected) student rows and the
    teacher's, and its gradients.

    Args:
        students: ``K`` student columns ``(B, d_s)``.
        teachers: the teacher's rows of each column ``(B, d_t)`` (no gradient); ``d_t == d_s`` without a
            projection.
        metric: ``"cosine"``, ``"l2"`` or ``"mse"`` ([`EmbedDistance`][st_cached_losses.functional.distill.embed.EmbedDistance]).
        weight: the projection's weight ``(d_t, d_s)`` (None: no projection); the student rows are mapped by
            ``s @ weight.T + bias`` before the distance.
        bias: the projection's bias ``(d_t,)`` or None.
        row_weight: the weight of each row's term (default ``1 / B``, the mean over the rows; across processes
            ``W / B_global``, this process's share of the global mean); ``"mse"`` divides it by ``d_t`` too.
        chunk_rows: rows projected (and differentiated) at once; sets the memory, not the result.
        with_grad: also return the gradients.

    Returns:
        [`EmbedDistillOutput`][st_cached_losses.functional.distill.embed.EmbedDistillOutput].
    """
    if metric not in EMBED_DISTANCES:
        raise ValueError(f"distance_metric must be one of 'mse', 'l2', 'cosine', but got '{metric}'.")
    if len(students) != len(teachers) or not students:
        raise ValueError(f"one teacher column per student column: got {len(teachers)} for {len(students)}.")
    n_rows = students[0].shape[0]
    dtype = accumulation_dtype(students[0])
    per_row = row_weight if row_weight is not None else 1.0 / max(n_rows, 1)
    per_row = per_row / len(students)  # the mean over the columns
    if metric == "mse":
        per_row = per_row / teachers[0].shape[-1]  # the mean over the elements
    w_leaf = weight.detach().to(dtype).requires_grad_(with_grad) if weight is not None else None
    b_leaf = (
        bias.detach().to(dtype).requires_grad_(with_grad) if bias is not None and weight is not None else None
    )
    total = torch.zeros((), dtype=torch.float64, device=students[0].device)
    grads = [torch.zeros_like(s) for s in students] if with_grad else None
    grad_w = torch.zeros_like(w_leaf) if with_grad and w_leaf is not None else None
    grad_b = torch.zeros_like(b_leaf) if with_grad and b_leaf is not None else None
    step = max(chunk_rows, 1)
    for k, (student, teacher) in enumerate(zip(students, teachers)):
        for start in range(0, n_rows, step):
            rows = slice(start, min(start + step, n_rows))
            leaf = student[rows].detach().to(dtype).requires_grad_(with_grad)
            with torch.enable_grad() if with_grad else torch.no_grad():
                projected = F.linear(leaf, w_leaf, b_leaf) if w_leaf is not None else leaf
                chunk_loss = _distance(projected, teacher[rows].detach().to(dtype), metric) * per_row
            total += chunk_loss.detach().double()
            if not with_grad:
                continue
            assert grads is not None
            wrt = [leaf, *(t for t in (w_leaf, b_leaf) if t is not None)]
            found = torch.autograd.grad(chunk_loss, wrt)
            grads[k][rows] += found[0].to(grads[k].dtype)
            if grad_w is not None:
                grad_w += found[1]
            if grad_b is not None:
                grad_b += found[2]
    return EmbedDistillOutput(
        total.to(torch.float32),
        grads,
        grad_w.to(weight.dtype) if grad_w is not None and weight is not None else None,
        grad_b.to(bias.dtype) if grad_b is not None and bias is not None else None,
    )
