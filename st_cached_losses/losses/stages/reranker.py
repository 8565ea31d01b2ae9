"""The reranker's stage: the cross-entropy of each query's positive among ``scale * activation_fn(score)`` of
its pairs, the cached quantity being each (query, document) pair's raw score (sentence-transformers'
cross-encoder ``MultipleNegativesRankingLoss``). The activation runs here, with autograd over the raw scores,
so a learnable activation (``nn.PReLU``) gets its exact gradient, averaged over the processes as the model's is;
across processes the loss is the mean over every process's queries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.distributed import is_distributed, world_size
from st_cached_losses.functional.placement import agree_on_sizes, mean_scale_grad
from st_cached_losses.losses.base import CachedLoss, Stage, StageInput, StageOutput, StepData

__all__ = ["PairScores"]


@dataclass(eq=False, kw_only=True)
class PairScores(Stage):
    """A reranker's in-batch negatives ranking loss over its pairs' scores.

    Args:
        owner: the loss's class name, for messages.
        scale: multiplies the activated scores; a falsy one (0 or None) is not applied, as theirs.
        activation_fn: applied to each pair's score before scaling; None: the raw score. Its parameters that
            require grad are ``step.inputs`` (the loss hands them over), their gradients returned.
    """

    owner: str
    scale: float | None
    activation_fn: Callable[[Tensor], Tensor] | None

    def check(self, features: Sequence[Any]) -> None:
        """The text columns were checked when the pairs were made (the loss's ``pairs``)."""

    def prepare(self, loss: CachedLoss, features: list[Any], inputs: Sequence[Any]) -> StepData:
        return StepData(queries=len(inputs[0]) if len(inputs) else 0)

    def loss_of(self, scores: Sequence[Tensor], batch_size: int, total_rows: int | None) -> Tensor:
        """The loss of the pairs' raw scores (pieces of the ``(B * (1 + k),)`` scores in pair order,
        column-major): this process's mean over its ``batch_size`` queries, or with ``total_rows`` (every
        process's queries) its share, ``sum of its rows' losses * world size / total_rows``, whose average
        over processes (DDP's) is the mean over every process's queries."""
        # (B, 1 + k): row i holds query i's positive first
        logits = torch.cat([t.reshape(-1) for t in scores]).reshape(-1, batch_size).T
        if self.activation_fn is not None:
            logits = self.activation_fn(logits)
        if self.scale:
            logits = logits * self.scale
        labels = torch.zeros(batch_size, dtype=torch.long, device=logits.device)
        if total_rows is None:
            return F.cross_entropy(logits, labels)
        return F.cross_entropy(logits, labels, reduction="sum") * (world_size() / total_rows)

    def _total_rows(self, scores: Tensor, batch_size: int) -> int | None:
        """Every process's query count (None in one process); checks that the scores are finite, on every
        process alike (one small all-gather, which every process reaches after its forwards)."""
        # one finite number per query iff its scores are: the processes may score different numbers of pairs
        per_row = scores.detach().reshape(-1, batch_size).sum(0, keepdim=True).T
        sizes = agree_on_sizes([per_row], across_processes=True)
        return sum(sizes) if sizes is not None and is_distributed() else None

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        batch_size = batch.step.queries
        if batch_size is None:
            raise ValueError(
                f"{self.owner} scores the pairs of a step: call the loss on the text columns (loss(inputs)), "
                "which makes the pairs, rather than calculate_loss directly."
            )
        scores = batch.embeddings
        total = self._total_rows(torch.cat([s.reshape(-1) for s in scores]), batch_size)
        if not with_grad:
            with torch.no_grad():
                return StageOutput(self.loss_of(scores, batch_size, total).detach())
        leaves = [s.detach().requires_grad_() for s in scores]
        params = dict(batch.step.inputs)
        with torch.enable_grad():
            loss = self.loss_of(leaves, batch_size, total)
            found = torch.autograd.grad(loss, [*leaves, *params.values()], allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(s) for g, s in zip(found, leaves)]
        # the activation belongs to the loss, outside the DDP-wrapped model: its gradient is averaged over the
        # processes here, as DDP averages the model's (a parameter the loss does not reach has no gradient, on
        # every process alike)
        averaged = [mean_scale_grad(g) for g in found[len(leaves) :]]
        input_grads = {k: g for k, g in zip(params, averaged) if g is not None}
        return StageOutput(loss.detach(), grads, input_grads)
