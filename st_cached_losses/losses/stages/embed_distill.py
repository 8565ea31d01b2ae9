"""The embedding-distillation stage of [`CachedEmbedDistillLoss`][st_cached_losses.losses.cached_embed_distill.CachedEmbedDistillLoss]:
the teacher's embeddings (from the labels, or a live teacher's, embedded in ``prepare``) against the student's,
pointwise ([`embed_distill_loss_and_grad`][st_cached_losses.functional.distill.embed.embed_distill_loss_and_grad],
through the loss's projection, handed in as ``step.inputs``) and listwise
([`listwise_kl_loss_and_grad`][st_cached_losses.functional.distill.listwise.listwise_kl_loss_and_grad])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from st_cached_losses.functional.distill.embed import embed_distill_loss_and_grad
from st_cached_losses.functional.distill.listwise import listwise_kl_loss_and_grad, listwise_tile_size
from st_cached_losses.functional.placement import mean_scale_grad, ring_path
from st_cached_losses.losses.base import CachedLoss, Stage, StageInput, StageOutput, StepData, check_columns
from st_cached_losses.losses.settings import DEFAULT_PLAN, Plan
from st_cached_losses.losses.stages.infonce import GuideModel

__all__ = ["PROJECTION_INPUTS", "EmbedDistill"]

#: the names under which the loss hands its projection's weight and bias to the stage (``step.inputs``)
PROJECTION_INPUTS = ("projection.weight", "projection.bias")


@dataclass(eq=False, kw_only=True)
class EmbedDistill(Stage):
    """The teacher's embeddings distilled into the student's (see the module's notes): ``pointwise_weight``
    times the mean over the columns of each column's distance loss (through the projection in
    ``step.inputs``, whose gradients it returns) plus ``listwise_weight`` times the listwise KL of the anchors
    (column 0) over every row of the other columns.

    Args:
        owner: the loss's class name, for messages.
        metric: the pointwise distance (``"cosine"``, ``"l2"``, ``"mse"``).
        pointwise_weight: the pointwise term's weight (0: left out).
        listwise_weight: the listwise term's weight (0: left out).
        listwise_scale: the student's listwise logits' scale.
        teacher_scale: the teacher's listwise logits' scale.
        student_dim: the model's untruncated embedding width: teacher embeddings of that width are cut to
            narrower rows (MatryoshkaLoss's truncations), as sentence-transformers' ``MatryoshkaLoss`` cuts labels.
        teacher: the live teacher (its embeddings of every column, computed in ``prepare``), or None: labels.
        gather: the pointwise term returns this process's share of the global mean, the listwise term scores
            every process's candidates.
        plan: the loss stage's plan; the stage uses its ``path`` (across processes ``"tiled"`` passes the
            listwise term's candidate blocks around a ring of processes, nothing gathered; the others gather
            them), ``tile_size`` (the listwise term's logit tile side; None: from ``memory_budget``) and
            ``memory_budget`` (bytes of logit tiles, listwise, or of a row chunk's projections, pointwise).
    """

    plan_fields: ClassVar[frozenset[str]] = frozenset({"path", "tile_size", "memory_budget"})

    owner: str
    metric: str
    pointwise_weight: float = 1.0
    listwise_weight: float = 0.0
    listwise_scale: float = 20.0
    teacher_scale: float = 20.0
    student_dim: int | None = None
    teacher: GuideModel | None = None
    gather: bool = False
    plan: Plan = DEFAULT_PLAN
    min_columns: int = 1

    def columns_message(self, n: int) -> str | None:
        return f"{self.owner} needs at least one text column, got {n}."

    def check(self, features: Sequence[Any]) -> None:
        if self.listwise_weight and len(features) < 2:
            raise ValueError(
                f"{self.owner}: the listwise term (listwise_weight={self.listwise_weight}) ranks every candidate for "
                f"each anchor, so it needs at least two text columns (anchor, positive[, negatives...]); got "
                f"{len(features)}. Add a column or set listwise_weight=0."
            )
        check_columns(features, self.owner, self.min_columns, self.columns_message)
        if self.teacher is not None:
            self.teacher.check(features, self.owner)

    def prepare(self, loss: CachedLoss, features: list[Any], inputs: Sequence[Any]) -> StepData:
        if self.teacher is None:
            return StepData()
        return StepData(teacher=self.teacher.embed(loss, features))

    def _teacher_columns(self, batch: StageInput) -> list[Tensor]:
        """The teacher's rows of every column, from the live teacher or the labels: ``(B, d_t)`` broadcast to
        every column, ``(B, K, d_t)`` one per column, or a list of ``K`` ``(B, d_t)`` (``compute_loss_from_
        embeddings(embeddings, teacher_embeddings)``, sentence-transformers' form)."""
        n_columns = len(batch.embeddings)
        labels: Any = batch.labels
        if batch.step.teacher is not None:
            if labels is not None:
                raise ValueError(
                    f"{self.owner} got both a teacher model and labels: with teacher=... the teacher embeds every "
                    "column itself; drop the dataset's 'label' column, or set teacher=None to use the labels."
                )
            return list(batch.step.teacher)
        if labels is None:
            raise ValueError(
                f"{self.owner} requires pre-computed teacher embeddings as labels. Compute them once with the "
                "teacher and add them via `dataset.map(...)`, or pass teacher=<SentenceTransformer>."
            )
        if isinstance(labels, (list, tuple)):
            if len(labels) != n_columns:
                raise ValueError(
                    f"{self.owner} got {len(labels)} teacher embedding tensors for {n_columns} text columns."
                )
            return [t.detach() for t in labels]
        labels = labels.detach()
        if labels.dim() == 2:
            return [labels] * n_columns
        if labels.dim() == 3:
            if labels.size(1) != n_columns:
                raise ValueError(
                    f"Number of label columns ({labels.size(1)}) does not match number of input text columns "
                    f"({n_columns}). Either pass 3D labels with shape (batch_size, {n_columns}, teacher_dim), or "
                    "pass 2D labels of shape (batch_size, teacher_dim) to broadcast a single label across all "
                    "columns."
                )
            return list(labels.unbind(1))
        raise ValueError(
            f"Expected labels to be 2D (batch_size, teacher_dim) or 3D (batch_size, num_columns, teacher_dim); "
            f"got {labels.dim()}D."
        )

    def _pointwise_targets(
        self, teachers: list[Tensor], width: int, projection: Tensor | None
    ) -> list[Tensor]:
        """The teacher's rows the pointwise term compares with rows of ``width``: as they are with a
        projection, cut to ``width`` where they have the model's full width and the rows are narrower
        (MatryoshkaLoss's truncations, as sentence-transformers' ``MatryoshkaLoss`` cuts labels)."""
        d_t = teachers[0].shape[-1]
        if projection is not None:
            if projection.shape[1] != width:
                raise ValueError(
                    f"{self.owner}: the projection maps {projection.shape[1]}-dim student embeddings, got {width}-dim "
                    "ones: inside MatryoshkaLoss the truncated embeddings cannot go through the full-width "
                    "projection (EmbedDistillLoss fails the same way); use projection_dim=None, or the listwise term "
                    "alone (pointwise_weight=0), which needs no projection."
                )
            if projection.shape[0] != d_t:
                raise ValueError(
                    f"{self.owner}: the projection maps into {projection.shape[0]} dimensions but the teacher's "
                    f"embeddings have {d_t}; set projection_dim={d_t}."
                )
            return teachers
        if d_t == width:
            return teachers
        if d_t == self.student_dim and width < d_t:
            return [t[..., :width] for t in teachers]
        raise ValueError(
            f"{self.owner}: the teacher's embeddings have {d_t} dimensions and the student's {width}; set "
            f"projection_dim={d_t} to learn a projection into the teacher's space (or use the listwise term alone, "
            "pointwise_weight=0, which compares similarities, not embeddings)."
        )

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        embeddings, inputs = batch.embeddings, batch.step.inputs
        teachers = self._teacher_columns(batch)
        device = embeddings[0].device
        teachers = [t.to(device) for t in teachers]
        sizes = batch.sizes(self.gather)  # also the finiteness check, on every process
        row_weight = len(sizes) / sum(sizes) if sizes is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=device)
        grads = [torch.zeros_like(e) for e in embeddings] if with_grad else None
        input_grads: dict[str, Tensor] = {}
        if self.pointwise_weight:
            weight, bias = inputs.get(PROJECTION_INPUTS[0]), inputs.get(PROJECTION_INPUTS[1])
            targets = self._pointwise_targets(teachers, embeddings[0].shape[-1], weight)
            d_out = teachers[0].shape[-1]
            chunk = max(1, self.plan.memory_budget // max(4 * 4 * (embeddings[0].shape[-1] + d_out), 1))
            out = embed_distill_loss_and_grad(
                embeddings,
                targets,
                self.metric,  # type: ignore[arg-type]
                weight=weight,
                bias=bias,
                row_weight=row_weight,
                chunk_rows=chunk,
                with_grad=with_grad,
            )
            loss = loss + self.pointwise_weight * out.loss
            if with_grad:
                assert grads is not None and out.grads is not None
                grads = [g + self.pointwise_weight * o for g, o in zip(grads, out.grads)]
                for name, g in zip(PROJECTION_INPUTS, (out.grad_weight, out.grad_bias)):
                    if g is not None:
                        # the projection belongs to the loss, outside DDP: its gradient averaged here as DDP
                        # averages the model's
                        averaged = mean_scale_grad(self.pointwise_weight * g)
                        assert averaged is not None
                        input_grads[name] = averaged
        if self.listwise_weight:
            candidate_counts = [(len(embeddings) - 1) * s for s in sizes] if sizes is not None else None
            tile = self.plan.tile_size or listwise_tile_size(self.plan.memory_budget)
            listwise = listwise_kl_loss_and_grad(
                embeddings[0],
                torch.cat(embeddings[1:]),
                teachers[0],
                torch.cat(teachers[1:]),
                scale=self.listwise_scale,
                teacher_scale=self.teacher_scale,
                candidate_sizes=candidate_counts,
                ring=ring_path(self.plan.path),
                row_weight=row_weight,
                tile_size=tile,
                with_grad=with_grad,
            )
            loss = loss + self.listwise_weight * listwise.loss
            if with_grad:
                assert grads is not None
                assert listwise.grad_anchors is not None and listwise.grad_candidates is not None
                rows = [e.shape[0] for e in embeddings[1:]]
                found = [listwise.grad_anchors, *listwise.grad_candidates.split(rows)]
                grads = [g + self.listwise_weight * f for g, f in zip(grads, found)]
        return StageOutput(loss, grads, input_grads)
