"""SPLADE's stage: a sparse encoder's base loss plus its FLOPS regularisers, their components returned
apart (``base_loss``, ``document_regularizer_loss``, ``query_regularizer_loss``, the regularisers weighted),
as sentence-transformers' ``SpladeLoss`` returns them.

* The base loss: sentence-transformers' multiple-negatives ranking loss (``SparseMultipleNegativesRankingLoss``)
  on the package's InfoNCE core (an [`InfoNCE`][st_cached_losses.losses.stages.infonce.InfoNCE] stage of the
  base loss's options, read at every step), chunked or tiled, gathered or by ring across processes; any other
  base loss with ``compute_loss_from_embeddings`` through autograd on the whole batch, as
  sentence-transformers computes it.
* The FLOPS regularisers (their ``FlopsLoss``, thresholds included) from column sums, with their analytic
  gradient ([`st_cached_losses.functional.representations.flops`][st_cached_losses.functional.representations.flops]); another regulariser
  through autograd.

Packed rows (the engine's compact cache, ``(B, k, 2)`` indices and values of the non-zero entries) are read
packed: the core scores them with [`SparseDot`][st_cached_losses.functional.representations.sparse.SparseDot], FLOPS by
scatter-add, and nothing ``B x V`` is built."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.functional.representations.flops import flops_loss_and_grad
from st_cached_losses.functional.representations.sparse import SparseDot
from st_cached_losses.losses.base import CachedLoss, Stage, StageInput, StageOutput, StepData
from st_cached_losses.losses.settings import Plan
from st_cached_losses.losses.sparse_cache import CompactSparseRows
from st_cached_losses.losses.stages.infonce import InfoNCE

__all__ = ["Regularizer", "Splade", "is_flops"]


def is_flops(regularizer: nn.Module) -> bool:
    """Whether a regulariser is sentence-transformers' ``FlopsLoss`` (computed from column sums)."""
    from sentence_transformers.sparse_encoder.losses import FlopsLoss

    return (
        isinstance(regularizer, FlopsLoss)
        and type(regularizer).compute_loss_from_embeddings is FlopsLoss.compute_loss_from_embeddings
    )


@dataclass(frozen=True)
class Regularizer:
    """A regulariser of some columns: its component's key, the module, its weight and its first column
    (the documents: every column but the first, or all; the queries: the first only)."""

    key: str
    module: nn.Module
    weight: float
    columns: slice


def _autograd_loss_and_grad(
    fn: Callable[[list[Tensor]], Tensor | dict[str, Tensor]], columns: Sequence[Tensor], with_grad: bool
) -> tuple[dict[str, Tensor] | Tensor, list[Tensor] | None]:
    """A loss of the whole batch through autograd (what sentence-transformers computes), and its gradient
    wrt each column: for base losses and regularisers that are not the core's."""
    leaves = [c.detach().requires_grad_(with_grad) for c in columns]
    with torch.enable_grad() if with_grad else torch.no_grad():
        out = fn(leaves)
    if not with_grad:
        return out, None
    total = torch.stack(list(out.values())).sum() if isinstance(out, dict) else out
    found = (
        torch.autograd.grad(total, leaves, allow_unused=True) if total.requires_grad else [None] * len(leaves)
    )
    grads = [g if g is not None else torch.zeros_like(c) for g, c in zip(found, leaves)]
    detached = {k: v.detach() for k, v in out.items()} if isinstance(out, dict) else out.detach()
    return detached, grads


def _weighted(regularizer: Any, weight: float, columns: list[Tensor]) -> Tensor:
    """A regulariser of the rows of ``columns`` together (their concatenation), weighted."""
    return regularizer.compute_loss_from_embeddings(torch.cat(columns)) * weight


@dataclass(eq=False, kw_only=True)
class Splade(Stage):
    """A base loss plus regularisers (see the module's notes).

    Args:
        owner: the loss's class name, for messages.
        base_loss: the base loss (its ``compute_loss_from_embeddings`` runs where ``ranking`` is None).
        ranking: the InfoNCE stage of the base loss's current options when the core computes it (a
            multiple-negatives ranking loss), else None.
        regularizers: the regularisers, in the components' order.
        form: the engine's cache form (packed rows when exact and smaller).
    """

    owner: str
    base_loss: nn.Module
    ranking: Callable[[], InfoNCE] | None
    regularizers: Sequence[Regularizer]
    form: CompactSparseRows

    def honoured_plan(self) -> frozenset[str]:
        """The base loss's ranking stage's, where the core computes it; none otherwise."""
        return self.ranking().honoured_plan() if self.ranking is not None else frozenset()

    def plans(self) -> list[Plan]:
        return self.ranking().plans() if self.ranking is not None else []

    def check(self, features: Sequence[Any]) -> None:
        if self.ranking is not None:
            self.ranking().check(features)  # the base loss's options are checked too, whoever set them

    def prepare(self, loss: CachedLoss, features: list[Any], inputs: Sequence[Any]) -> StepData:
        return self.ranking().prepare(loss, features, inputs) if self.ranking is not None else StepData()

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        embeddings = batch.embeddings
        parts: dict[str, Tensor] = {}
        grads: list[Tensor] | None
        # packed rows (the engine's compact cache): (B, k, 2) indices and values of the non-zero entries
        dim = self.form.dim if embeddings[0].dim() == 3 else None
        gather = False
        if self.ranking is not None:
            ranking = self.ranking()
            gather = ranking.gather
            if dim is not None:
                ranking = replace(ranking, similarity=SparseDot(dim))
            out = ranking(batch, with_grad)
            parts["base_loss"] = out.loss
            grads = out.grads
        else:
            base_loss: Any = self.base_loss
            labels = batch.labels
            base, grads = _autograd_loss_and_grad(
                lambda cols: base_loss.compute_loss_from_embeddings(cols, labels), embeddings, with_grad
            )
            parts.update(base if isinstance(base, dict) else {"base_loss": base})
        for reg in self.regularizers:
            columns = embeddings[reg.columns]
            own = grads[reg.columns] if grads is not None else None
            if is_flops(reg.module):
                flops = flops_loss_and_grad(
                    columns,
                    reg.module.threshold,  # type: ignore[arg-type]
                    grad_output=reg.weight,
                    with_grad=with_grad,
                    across_processes=gather,
                    accumulate=own,  # into the base loss's gradients, in place
                    dim=dim,
                )
                parts[reg.key] = flops.loss
                continue
            value, reg_grads = _autograd_loss_and_grad(
                functools.partial(_weighted, reg.module, reg.weight), columns, with_grad
            )
            assert isinstance(value, Tensor)
            parts[reg.key] = value
            if own is not None and reg_grads is not None:
                for g, r in zip(own, reg_grads):
                    g.add_(r.to(g.dtype))
        if grads is not None and dim is not None:
            # packed gradients name their entries by the embeddings' indices (the engine scatters them)
            for g, e in zip(grads, embeddings):
                g[..., 0] = e[..., 0]
        total = torch.stack([v.float() for v in parts.values()]).sum()
        return StageOutput(total, grads, parts=parts)
