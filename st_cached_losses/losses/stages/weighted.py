"""A weighted sum of stages: ``sum_k w_k * loss_k`` and its gradients, each stage on the same rows (a
distillation loss plus an in-batch InfoNCE term, as FlagEmbedding adds it to the teacher's KL). Every
process's row count is agreed on once for all of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.losses.base import CachedLoss, Stage, StageInput, StageOutput, StepData
from st_cached_losses.losses.settings import Plan

__all__ = ["WeightedSum"]


@dataclass(eq=False, kw_only=True)
class WeightedSum(Stage):
    """``sum_k weight_k * stage_k`` (a stage of weight 0 is still computed: leave it out instead).

    Args:
        stages: ``(weight, stage)`` pairs; the first stage's checks come first and its cache form is the
            sum's (every stage reads the same rows).
    """

    stages: Sequence[tuple[float, Stage]]

    @property
    def owner(self) -> str:  # type: ignore[override]
        return self.stages[0][1].owner

    @property
    def form(self) -> CacheForm | None:  # type: ignore[override]
        return self.stages[0][1].form

    def honoured_plan(self) -> frozenset[str]:
        return frozenset().union(*(stage.honoured_plan() for _, stage in self.stages))

    def plans(self) -> list[Plan]:
        return [plan for _, stage in self.stages for plan in stage.plans()]

    def check(self, features: Sequence[Any]) -> None:
        for _, stage in self.stages:
            stage.check(features)

    def prepare(self, loss: CachedLoss, features: list[Any], inputs: Sequence[Any]) -> StepData:
        step = StepData()
        for _, stage in self.stages:
            prepared = stage.prepare(loss, features, inputs)
            for f in fields(prepared):
                if getattr(prepared, f.name) is not None and f.name != "inputs":
                    setattr(step, f.name, getattr(prepared, f.name))
        return step

    def with_embeddings(self, step: StepData, embeddings: list[Tensor]) -> StepData:
        for _, stage in self.stages:
            step = stage.with_embeddings(step, embeddings)
        return step

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        loss: Tensor | None = None
        grads: list[Tensor] | None = None
        input_grads: dict[str, Tensor] = {}
        for weight, stage in self.stages:
            out = stage(batch, with_grad)
            if loss is None:  # the first stage as it is where its weight is 1 (the distillation loss)
                loss, grads, input_grads = out.loss, out.grads, dict(out.input_grads)
                if weight != 1.0:
                    loss = weight * loss
                    grads = [weight * g for g in grads] if grads is not None else None
                    input_grads = {k: weight * g for k, g in input_grads.items()}
                continue
            loss = loss + weight * out.loss.to(loss.dtype)
            if grads is not None and out.grads is not None:
                grads = [g + weight * n.to(g.dtype) for g, n in zip(grads, out.grads)]
            for name, g in out.input_grads.items():
                input_grads[name] = input_grads[name] + weight * g if name in input_grads else weight * g
        assert loss is not None  # at least one stage
        return StageOutput(loss, grads, input_grads)
