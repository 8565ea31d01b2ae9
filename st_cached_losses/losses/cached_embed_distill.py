"""Distillation of a teacher's embeddings with GradCache:
[`CachedEmbedDistillLoss`][st_cached_losses.losses.cached_embed_distill.CachedEmbedDistillLoss] (sentence-transformers'
``EmbedDistillLoss``, the teacher's embeddings in the labels or from a live frozen teacher), its settings
([`EmbedDistillSettings`][st_cached_losses.losses.cached_embed_distill.EmbedDistillSettings]) and its stage
([`EmbedDistill`][st_cached_losses.losses.cached_embed_distill.EmbedDistill]): the pointwise distance of each
student embedding to the teacher's ([`embed_distill_loss_and_grad`][st_cached_losses.functional.embed_distill.embed_distill_loss_and_grad],
through a learned projection where the widths differ) plus, with a weight, the listwise KL of the teacher's
softmax over every candidate of the global batch to the student's
([`listwise_kl_loss_and_grad`][st_cached_losses.functional.listwise.listwise_kl_loss_and_grad]).

Each row's pointwise term is its own, so that part of the stage is per row; the listwise term is a softmax per
anchor over every candidate, computed in tiles with running log-sum-exps."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from st_cached_losses.engine.features import model_device, unwrap_model
from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.embed_distill import EMBED_DISTANCES, embed_distill_loss_and_grad
from st_cached_losses.functional.listwise import listwise_kl_loss_and_grad, listwise_tile_size
from st_cached_losses.functional.parallel import mean_scale_grad
from st_cached_losses.functional.terms import mnrl_terms
from st_cached_losses.losses.base import CachedLoss, Stage, StageInput, StageOutput, StepData, check_columns
from st_cached_losses.losses.cached_distill import DistillSettings
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.ranking import ONE_DIRECTION, RankingSettings
from st_cached_losses.losses.settings import (
    LossStageSettings,
    check_nonnegative,
    check_scale,
    redefault,
    setting,
)
from st_cached_losses.losses.stages.infonce import GuideModel, InfoNCE
from st_cached_losses.losses.stages.weighted import WeightedSum

__all__ = ["EMBED_DISTILL_CITATION", "CachedEmbedDistillLoss", "EmbedDistill", "EmbedDistillSettings"]

#: the EmbedDistill paper (the model card's citation, as sentence-transformers' ``EmbedDistillLoss`` cites it)
EMBED_DISTILL_CITATION = """
@article{kim2023embeddistill,
    title={EmbedDistill: A Geometric Knowledge Distillation for Information Retrieval},
    author={Kim, Seungyeon and Rawat, Ankit Singh and Zaheer, Manzil and Jayasumana, Sadeep and Sadhanala, Veeranjaneyulu and Jitkrittum, Wittawat and Menon, Aditya Krishna and Fergus, Rob and Kumar, Sanjiv},
    year={2023},
    eprint={2301.12005},
    archivePrefix={arXiv},
    primaryClass={cs.IR}
}
"""

_PROJECTION = ("projection.weight", "projection.bias")


def _distance_metric(name: str, value: Any) -> str:
    if value not in EMBED_DISTANCES:
        raise ValueError(f"distance_metric must be one of 'mse', 'l2', 'cosine', but got '{value}'.")
    return str(value)


def _projection_dim(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive int (the teacher's embedding width) or None (no projection), got {value!r}."
        )
    return value


def _teacher(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, nn.Module):
        raise ValueError(
            f"{name} must be a SentenceTransformer (the frozen teacher, embedding every column in stage 1) or None "
            f"(the teacher's embeddings in the labels), got {type(value).__name__}."
        )
    return value


def _weight(name: str, value: Any) -> float:
    out = check_nonnegative(name, value, optional=False, example="1.0")
    assert out is not None
    return out


def _teacher_scale(name: str, value: Any) -> float | None:
    return None if value is None else check_scale(name, value)


def embedding_dimension(model: Any) -> int | None:
    """The model's (untruncated) embedding width, as sentence-transformers' versions ask it; None if it has
    none to say."""
    model = unwrap_model(model) if model is not None else None
    for name in ("get_embedding_dimension", "get_sentence_embedding_dimension"):
        get = getattr(model, name, None)
        if get is not None:
            dim = get()
            return dim if isinstance(dim, int) else None
    return None


@dataclass(frozen=True, kw_only=True)
class EmbedDistillSettings(LossStageSettings):
    """[`CachedEmbedDistillLoss`][st_cached_losses.losses.cached_embed_distill.CachedEmbedDistillLoss]'s settings:
    sentence-transformers' ``EmbedDistillLoss`` arguments (``distance_metric``, ``projection_dim``), the live
    teacher, the weights of the pointwise and the listwise terms, the listwise softmaxes' scales, gathering
    across processes, the engine's knobs and the loss stage's plan."""

    owner: ClassVar[str] = "CachedEmbedDistillLoss"

    distance_metric: str = setting(
        "cosine",
        doc="How each student embedding is compared with the teacher's: 'cosine' (1 - cosine similarity), 'l2' "
        "(Euclidean distance, the EmbedDistill paper's) or 'mse' (mean squared error), as EmbedDistillLoss.",
        check=_distance_metric,
        config="always",
    )
    projection_dim: int | None = setting(
        None,
        doc="The teacher's embedding width: a learned nn.Linear(student_dim, projection_dim) of the loss maps the "
        "student's embeddings into the teacher's space before the distance (None: no projection, the widths "
        "must agree); save_projection / load_projection keep it between runs.",
        check=_projection_dim,
        config="always",
    )
    teacher: nn.Module | None = setting(
        None,
        doc="A frozen teacher SentenceTransformer embedding every column in stage 1, mini-batch by mini-batch and "
        "without a graph, instead of the teacher's embeddings in the labels (None: the labels).",
        check=_teacher,
        module=True,
    )
    pointwise_weight: float = setting(
        1.0,
        doc="The weight of the pointwise term (each student embedding against the teacher's, distance_metric); "
        "0: the listwise term alone.",
        check=_weight,
    )
    listwise_weight: float = setting(
        0.0,
        doc="The weight of the listwise term: per anchor, the KL divergence of the student's softmax over every "
        "candidate of the global batch from the teacher's (both from cosine similarities of embeddings), the mean "
        "over the anchors; 0: the pointwise loss alone (EmbedDistillLoss).",
        check=_weight,
    )
    listwise_scale: float = setting(
        20.0,
        doc="The listwise term's student scale: its logits are listwise_scale * cos(student anchor, student "
        "candidate).",
        check=check_scale,
    )
    listwise_teacher_scale: float | None = setting(
        None,
        doc="The listwise term's teacher scale: its logits are listwise_teacher_scale * cos(teacher anchor, "
        "teacher candidate) (None: listwise_scale).",
        check=_teacher_scale,
    )
    infonce_weight: float = redefault(DistillSettings, "infonce_weight", 0.0)
    infonce_scale: float = redefault(DistillSettings, "infonce_scale", 20.0)
    gather_across_devices: bool = redefault(RankingSettings, "gather_across_devices", False)

    def validate(self) -> None:
        super().validate()
        if not self.pointwise_weight and not self.listwise_weight and not self.infonce_weight:
            raise ValueError(
                f"{self.owner}: pointwise_weight, listwise_weight and infonce_weight are all 0, so there is no loss; "
                "set one above 0 (e.g. listwise_weight=1.0)."
            )

    def teacher_scale(self) -> float:
        """The listwise term's teacher scale, as used."""
        return self.listwise_teacher_scale if self.listwise_teacher_scale is not None else self.listwise_scale

    def config(self) -> dict[str, Any]:
        """sentence-transformers' keys (``distance_metric``, ``projection_dim``), the mini-batches, then what
        differs from its default (the teacher, the terms' weights and scales, gathering, the tile size) and an
        ``"auto"`` loss's memory budget: every key a constructor argument."""
        config: dict[str, Any] = {
            "distance_metric": self.distance_metric,
            "projection_dim": self.projection_dim,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
        }
        extras = self.changed(
            (
                "teacher",
                "pointwise_weight",
                "listwise_weight",
                "listwise_scale",
                "listwise_teacher_scale",
                "infonce_weight",
                "infonce_scale",
                "gather_across_devices",
                "tile_size",
            )
        )
        return {**config, **extras, **self.auto_config()}


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
        path: across processes ``"tiled"`` passes the listwise term's candidate blocks around a ring of
            processes (nothing gathered); the others gather them.
        tile_size: the listwise term's logit tile side (None: from ``memory_budget``).
        memory_budget: bytes of logit tiles (listwise) / of a row chunk's projections (pointwise).
    """

    owner: str
    metric: str
    pointwise_weight: float = 1.0
    listwise_weight: float = 0.0
    listwise_scale: float = 20.0
    teacher_scale: float = 20.0
    student_dim: int | None = None
    teacher: GuideModel | None = None
    gather: bool = False
    path: str = "auto"
    tile_size: int | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET
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
            weight, bias = inputs.get(_PROJECTION[0]), inputs.get(_PROJECTION[1])
            targets = self._pointwise_targets(teachers, embeddings[0].shape[-1], weight)
            d_out = teachers[0].shape[-1]
            chunk = max(1, self.memory_budget // max(4 * 4 * (embeddings[0].shape[-1] + d_out), 1))
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
                for name, g in zip(_PROJECTION, (out.grad_weight, out.grad_bias)):
                    if g is not None:
                        # the projection belongs to the loss, outside DDP: its gradient averaged here as DDP
                        # averages the model's
                        averaged = mean_scale_grad(self.pointwise_weight * g)
                        assert averaged is not None
                        input_grads[name] = averaged
        if self.listwise_weight:
            candidate_counts = [(len(embeddings) - 1) * s for s in sizes] if sizes is not None else None
            tile = self.tile_size or listwise_tile_size(self.memory_budget)
            listwise = listwise_kl_loss_and_grad(
                embeddings[0],
                torch.cat(embeddings[1:]),
                teachers[0],
                torch.cat(teachers[1:]),
                scale=self.listwise_scale,
                teacher_scale=self.teacher_scale,
                candidate_sizes=candidate_counts,
                ring=self.path == "tiled",
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


class CachedEmbedDistillLoss(CachedLoss):
    name = "embed_distill"
    aliases = ("embed-distill",)
    st_names = ("EmbedDistillLoss",)
    settings_class = EmbedDistillSettings
    citations = (GRADCACHE_CITATION, EMBED_DISTILL_CITATION)
    equivalent_st_loss = "EmbedDistillLoss"
    #: one text column suffices (the arguments' dataset check reads it): each row is distilled on its own
    min_text_columns: ClassVar[int] = 1

    #: the learned projection into the teacher's space (``projection_dim``), or None
    projection: nn.Linear | None

    def __init__(
        self,
        model: nn.Module,
        distance_metric: str = "cosine",
        projection_dim: int | None = None,
        *,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        teacher: nn.Module | None = None,
        pointwise_weight: float = 1.0,
        listwise_weight: float = 0.0,
        listwise_scale: float = 20.0,
        listwise_teacher_scale: float | None = None,
        infonce_weight: float = 0.0,
        infonce_scale: float = 20.0,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Any,
    ) -> None:
        """
        sentence-transformers' ``EmbedDistillLoss`` with GradCache: each student embedding against the
        teacher's embedding of the same text (``distance_metric``, through a learned projection where the widths
        differ), with the memory of one encoder mini-batch; optionally plus a listwise term that distils the
        teacher's ranking of every candidate of the global batch, and a live frozen teacher instead of
        precomputed labels.

        The batch is embedded mini-batch by mini-batch without a graph; the loss and its gradients wrt every
        embedding (and the projection's) are computed from the cached rows; the encoder is then replayed with
        them. With the defaults it is the same loss and the same gradients as ``EmbedDistillLoss`` (every
        metric, with and without a projection, one or several columns), also inside ``MatryoshkaLoss``.

        The listwise term (``listwise_weight > 0``): for each anchor (column 0), the KL divergence of the
        student's softmax over every candidate (every row of the other columns, across processes every
        process's with ``gather_across_devices``) from the teacher's, the logits
        ``listwise_scale * cos(s_anchor, s_candidate)`` and ``listwise_teacher_scale * cos(t_anchor,
        t_candidate)``, the mean over the anchors. Computed in tiles with running log-sum-exps (never a
        ``B x C`` matrix); the student's and the teacher's widths may differ (it compares similarities, not
        embeddings, so it needs no projection).

        The constructor takes ``EmbedDistillLoss``'s arguments in their positional order, then ours,
        keyword-only, then the engine's knobs and the loss stage's plan
        ([`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result).
        Every argument is a setting ([`EmbedDistillSettings`][st_cached_losses.losses.cached_embed_distill.EmbedDistillSettings]),
        read and assigned between steps.

        Args:
            model: the student ``SentenceTransformer`` to train.
            distance_metric: ``"cosine"`` (1 - cosine similarity, the default), ``"l2"`` (Euclidean distance,
                the EmbedDistill paper's) or ``"mse"`` (mean squared error).
            projection_dim: the teacher's width: a learned ``nn.Linear(student_dim, projection_dim)`` (the loss's
                ``projection``, trained with the student) maps the student's embeddings into the teacher's space
                before the distance. As theirs, it is not saved with the model: ``save_projection`` /
                ``load_projection`` keep it between runs. None (default): no projection.
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            teacher: a frozen teacher ``SentenceTransformer``: it embeds every column in stage 1, mini-batch by
                mini-batch and without a graph (re-tokenising the texts when its tokenizer differs, as
                ``CachedGISTLoss``'s guide), instead of the teacher's embeddings in the labels; never trained.
                None (default): the labels.
            pointwise_weight: the pointwise term's weight (0: the listwise term alone).
            listwise_weight: the listwise term's weight (0, the default: the pointwise loss alone).
            listwise_scale: the student's listwise logits' scale (``1 / temperature``).
            listwise_teacher_scale: the teacher's listwise logits' scale (None: ``listwise_scale``).
            infonce_weight: the weight of an in-batch InfoNCE term added to the loss (sentence-transformers'
                ``MultipleNegativesRankingLoss`` of the same batch: the anchors against every row's candidates,
                the second column the positive, by cosine); 0 (the default): none. Needs two columns.
            infonce_scale: the InfoNCE term's scale (``1 / its temperature``).
            gather_across_devices: the pointwise term is the mean over every process's rows (each process's
                share), the listwise and InfoNCE terms rank every process's candidates (gathered, or passed
                around a ring of processes with ``path="tiled"``).
            show_progress_bar: tqdm bars over the mini-batches.

        References:
            - Kim et al., EmbedDistill: A Geometric Knowledge Distillation for Information Retrieval, 2023:
              https://huggingface.co/papers/2301.12005
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. The teacher's embeddings as the labels: ``(batch_size, teacher_dim)`` (every column targets the
               same embedding) or ``(batch_size, num_columns, teacher_dim)``; or ``teacher=`` and no labels.
            2. The listwise term: at least two columns (anchor, positive[, negatives...]).

        Inputs:
            | Texts | Labels |
            |---|---|
            | input | teacher embeddings ``(batch_size, teacher_dim)`` |
            | input_1, ..., input_N | teacher embeddings ``(batch_size, N, teacher_dim)`` |
            | input_1, ..., input_N | teacher embeddings ``(batch_size, teacher_dim)`` |
            | input_1, ..., input_N | none, with ``teacher=`` |

        Relations:
            - The same loss and gradients as ``EmbedDistillLoss`` (sentence-transformers) with the same
              arguments (and the defaults of ours).
            - [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss] distils a
              teacher's scores of each query's own candidates instead of its embeddings.

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedEmbedDistillLoss

            student = SentenceTransformer("all-MiniLM-L6-v2")
            teacher = SentenceTransformer("all-mpnet-base-v2")
            # train_dataset: (anchor, positive) texts, no label column: the teacher embeds them at each step
            loss = CachedEmbedDistillLoss(
                student, "cosine", projection_dim=768, teacher=teacher, listwise_weight=1.0, mini_batch_size=64
            )
            trainer = SentenceTransformerTrainer(model=student, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        self._model_tokenizer = getattr(model, "tokenizer", None)
        super().__init__(
            model,
            EmbedDistillSettings(
                distance_metric=distance_metric,
                projection_dim=projection_dim,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                teacher=teacher,
                pointwise_weight=pointwise_weight,
                listwise_weight=listwise_weight,
                listwise_scale=listwise_scale,
                listwise_teacher_scale=listwise_teacher_scale,
                infonce_weight=infonce_weight,
                infonce_scale=infonce_scale,
                gather_across_devices=gather_across_devices,
                show_progress_bar=show_progress_bar,
                **engine,
            ),
        )

    def _settings_changed(self, old: Any, new: Any) -> None:
        super()._settings_changed(old, new)
        if old is not None and old.projection_dim == new.projection_dim and "projection" in self._modules:
            return
        if new.projection_dim is None:
            self.projection = None
            return
        student_dim = embedding_dimension(self.model)
        if student_dim is None:
            raise ValueError(
                f"projection_dim: the model does not say its embedding width (get_embedding_dimension() gave "
                f"none), so the projection nn.Linear(student_dim, {new.projection_dim}) cannot be built; end the "
                "model with a Pooling (or Dense) module, or set projection_dim=None."
            )
        self.projection = nn.Linear(student_dim, new.projection_dim, device=model_device(self.model))

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """The projection's weight and bias (the stage returns their gradients), nothing without one."""
        projection = self._modules.get("projection")
        if projection is None:
            return {}
        assert isinstance(projection, nn.Linear)
        inputs = {_PROJECTION[0]: projection.weight}
        if projection.bias is not None:
            inputs[_PROJECTION[1]] = projection.bias
        return inputs

    def build_stage(self) -> Stage:
        s = self.__dict__["_settings"]
        teacher = None
        if s.teacher is not None:
            model = unwrap_model(self.model)
            retokenize = GuideModel.must_retokenize(s.teacher, model, self._model_tokenizer)
            teacher = GuideModel(s.teacher, retokenize, self._model_tokenizer)
        distill = EmbedDistill(
            owner=type(self).__name__,
            metric=s.distance_metric,
            pointwise_weight=s.pointwise_weight,
            listwise_weight=s.listwise_weight,
            listwise_scale=s.listwise_scale,
            teacher_scale=s.teacher_scale(),
            student_dim=embedding_dimension(self.model),
            teacher=teacher,
            gather=s.gather_across_devices,
            path=s.path,
            tile_size=s.tile_size,
            memory_budget=s.memory_budget,
        )
        if not s.infonce_weight:
            return distill
        # the anchors against every row's candidates, the first candidate column the positive (sentence-
        # transformers' MultipleNegativesRankingLoss), by cosine at infonce_scale
        infonce = InfoNCE(
            owner=distill.owner,
            terms=functools.partial(mnrl_terms, ONE_DIRECTION, "joint", None, 0.0),
            similarity="cosine",
            scale=s.infonce_scale,
            path=s.path,
            tile_size=s.tile_size,
            memory_budget=s.memory_budget,
            matmul_precision=s.matmul_precision,
            gather=s.gather_across_devices,
        )
        return WeightedSum(stages=[(1.0, distill), (s.infonce_weight, infonce)])

    # ------------------------------------------------------------------ the projection, as theirs

    def save_projection(self, path: str | os.PathLike[str]) -> None:
        """Write the projection's weights (safetensors) for a later run (``load_projection``): the trainer saves
        the model, not the loss's parameters.

        Args:
            path: the file to write.

        Raises:
            ValueError: the loss has no projection (``projection_dim`` is None).
        """
        from safetensors.torch import save_model

        if self.projection is None:
            raise ValueError(
                "No projection layer to save. Construct CachedEmbedDistillLoss with projection_dim=<int> if you "
                "want a learnable projection."
            )
        save_model(self.projection, str(path))

    def load_projection(self, path: str | os.PathLike[str]) -> None:
        """Load projection weights written by ``save_projection`` (theirs or ours: the same file). Without a
        projection one is made from the file's shape (``projection_dim`` set to its width).

        Args:
            path: a safetensors file written by ``save_projection``.

        Raises:
            ValueError: the saved shape does not fit the student's width or the configured projection.
        """
        from safetensors.torch import load_file

        state = load_file(str(path))
        out_features, in_features = state["weight"].shape
        if self.projection is None:
            student_dim = embedding_dimension(self.model)
            if in_features != student_dim:
                raise ValueError(
                    f"Saved projection expects student embeddings of dim {in_features}, but the current student "
                    f"model outputs {student_dim}-dim embeddings."
                )
            self.update_settings(projection_dim=out_features)
        assert self.projection is not None
        if self.projection.in_features != in_features or self.projection.out_features != out_features:
            raise ValueError(
                f"Saved projection shape ({in_features} -> {out_features}) does not match the configured projection "
                f"shape ({self.projection.in_features} -> {self.projection.out_features})."
            )
        self.projection.load_state_dict(state)
